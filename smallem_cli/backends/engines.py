"""The decode engines a run may take, chosen once by the command line: "eager" (PyTorch: the
reference, and the path on a GPU) and the native C++ kernels on a CPU ("native", the widest
build this CPU runs, and "native-avx2", its AVX2 build, to time beside it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .native.kernels import ENGINES as NATIVE_BUILDS

if TYPE_CHECKING:
    from ..model.llama import Transformer
    from ..spec.proposers import Proposer

Log = Callable[[str], None]
NATIVE = tuple(NATIVE_BUILDS)  # the native engine's builds: the widest this CPU runs, and its AVX2 one
ENGINES = ("auto", "eager", *NATIVE)
BENCH_ENGINES = ("eager", *NATIVE[::-1])  # slowest first: the AVX2 build before the widest


def cache_root() -> Path:
    """Where the native kernels are built: $SMALLEM_CACHE, else $XDG_CACHE_HOME/smallem, else
    ~/.cache/smallem; a leading ~ in either is the home folder (as a shell would have it), not a
    folder named `~`."""
    env = os.environ.get("SMALLEM_CACHE")
    if env:
        return Path(os.path.expanduser(env))
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(os.path.expanduser(xdg)) if xdg else Path.home() / ".cache") / "smallem"


def fastest(engines: Iterable[str]) -> str:
    """The fastest of these engines (by BENCH_ENGINES' order): the one a peer is compared with."""
    given = set(engines)
    return next((e for e in reversed(BENCH_ENGINES) if e in given), "eager")


def chosen(engine: str) -> str:
    """--engine (or bench's --engines) as given, or for "auto" $SMALLEM_ENGINE where it is set: read
    when a command starts, never at import."""
    return os.environ.get("SMALLEM_ENGINE") or engine if engine == "auto" else engine


def engine_mode(engine: str, device: torch.device) -> str | None:
    """--engine -> None (eager), "native" (`native/`; auto on a CPU) or "native-avx2" (its AVX2
    build). ValueError for an unknown name, or a native engine on another device than a CPU."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}: use {', '.join(ENGINES)}")
    if engine in NATIVE and device.type != "cpu":
        raise ValueError(f"--engine {engine} runs on a CPU only: use eager (or auto) on {device.type}")
    if engine == "auto":
        return "native" if device.type == "cpu" else None
    return engine if engine in NATIVE else None


def prepare_engine(
    mode: str | None, target: Transformer, proposer: Proposer, ks: list[int], log: Log | None = None
) -> tuple[int, int]:
    """Load (or build, once) what `engine_mode`'s mode runs, before anything is timed ->
    (models ready, of how many). None: eager, nothing to do."""
    if mode is None:
        return 0, 1
    from . import native  # its kernels are built by the system's compiler, once

    models = [m for k in ks for m, *_ in proposer.passes(k)]
    return native.prepare(target, models, log or (lambda _: None), cache_root(), mode)  # type: ignore[arg-type]


def bench_engines(engines: str, device: torch.device) -> tuple[str, ...]:
    """--engines of bench: "auto" or a comma-separated list of eager, native-avx2 and native."""
    if engines == "auto":
        return ("eager", "native") if engine_mode("auto", device) else ("eager",)
    names = tuple(dict.fromkeys(e.strip() for e in engines.split(",") if e.strip()))
    if not names or any(e not in BENCH_ENGINES for e in names):
        raise ValueError(f"--engines takes {', '.join(BENCH_ENGINES)} (comma-separated), or auto; got {engines!r}")
    for e in names:
        engine_mode(e, device)
    return names
