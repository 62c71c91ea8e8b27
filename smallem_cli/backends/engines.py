"""How a run's passes are computed, chosen once and handed to the engine: "eager" (PyTorch: the reference, and
the GPU's), "native" (the C++ kernels, the widest build this CPU runs) or "native-avx2"."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..model.llama import Transformer
from ..model.weights import laid_out
from .native.kernels import ENGINES as NATIVE_BUILDS
from .native.kernels import Log

if TYPE_CHECKING:
    from ..model.llama import MTPModule
    from .native import NativeSteps

    Models = Iterable[Transformer | MTPModule]

NATIVE = tuple(NATIVE_BUILDS)  # the native engine's builds: the widest this CPU runs, and its AVX2 one
ENGINES = ("auto", "eager", *NATIVE)
BENCH_ENGINES = ("eager", *NATIVE[::-1])  # slowest first: the AVX2 build before the widest


class Backend:
    """What runs a run's passes: PyTorch (eager), or a native build for each model `prepare` gave steps
    (the others eager: `label` "partly native"). Nothing lives on the models, so backends can share them."""

    def __init__(self, name: str = "eager") -> None:
        assert name in BENCH_ENGINES, name
        self.name = self.label = name
        self._steps: dict[int, tuple[object, NativeSteps]] = {}  # id(model) -> (model, its steps)
        self._refused: set[int] = set()
        # the target's passes give the eager ones' tokens: no quantized file's matrix in integer products
        self.exact = True

    def steps(self, model: object) -> NativeSteps | None:
        got = self._steps.get(id(model))
        return got[1] if got is not None and got[0] is model else None

    def prepare(self, target: Transformer, models: Models, log: Log | None = None, int8: Models = ()) -> str:
        """Native steps for the target and the proposer's models (`int8`: those read as int8), before
        anything is timed -> `label`: the name, "eager" where no model could have them, or "partly <name>"."""
        if self.name == "eager":
            for m in [target, *models]:
                if isinstance(m, Transformer):
                    m.materialize()
            return self.label
        from . import native  # its kernels are built by the system's compiler, once

        quiet = log or (lambda _: None)
        small = {id(m) for m in int8 if m is not target}  # the target's matrices are never int8
        said: dict[str, list[str]] = {}  # a reason that holds for several models is said once
        every = list({id(m): m for m in [target, *models]}.values())
        with laid_out():
            for m in every:
                if id(m) in self._steps or id(m) in self._refused:
                    continue
                try:
                    steps = native.NativeSteps(m, target, quiet, cache_root(), self.name, id(m) in small)
                    self._steps[id(m)] = (m, steps)
                except (native.NativeUnavailable, OSError) as e:
                    self._refused.add(id(m))
                    said.setdefault(str(e), []).append(type(m).__name__)
            for m in every:  # what runs eager reads its weights in float32
                if self.steps(m) is None and isinstance(m, Transformer):
                    m.materialize()
        for why, names in said.items():
            quiet(f"native decode step unavailable ({', '.join(names)}): {why}")
        ready = [s for m in every if (s := self.steps(m)) is not None]
        self.label = self.name if len(ready) == len(every) else "eager" if not ready else f"partly {self.name}"
        kinds = sorted({k for s in ready for k in s.kinds})
        target_steps = self.steps(target)
        self.exact = target_steps is None or not any(k.startswith("q") for k in target_steps.kinds)
        if kinds not in ([], ["f16"]):  # what the weights are read as, where not the family's float16
            self.label += f" ({'+'.join(kinds)})"
        return self.label


def cache_root() -> Path:
    """Where the native kernels are built: $SMALLEM_CACHE, else $XDG_CACHE_HOME/smallem, else ~/.cache/smallem."""
    if env := os.environ.get("SMALLEM_CACHE"):
        return Path(os.path.expanduser(env))
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(os.path.expanduser(xdg)) if xdg else Path.home() / ".cache") / "smallem"


def fastest(engines: Iterable[str]) -> str:
    """The fastest of these engines (by BENCH_ENGINES' order): the one a peer is compared with."""
    given = set(engines)
    return next((e for e in reversed(BENCH_ENGINES) if e in given), "eager")


def chosen(engine: str) -> str:
    """--engine (or bench's --engines), or for "auto" $SMALLEM_ENGINE where set (read at run, not import)."""
    return os.environ.get("SMALLEM_ENGINE") or engine if engine == "auto" else engine


def engine_mode(engine: str, device: torch.device) -> str:
    """--engine -> the backend's name (auto: native on a CPU); ValueError for an unknown or impossible one."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}: use {', '.join(ENGINES)}")
    if engine in NATIVE and device.type != "cpu":
        raise ValueError(f"--engine {engine} runs on a CPU only: use eager (or auto) on {device.type}")
    if engine == "auto":
        return "native" if device.type == "cpu" else "eager"
    return engine


def bench_engines(engines: str, device: torch.device) -> tuple[str, ...]:
    """--engines of bench: "auto" or a comma-separated list of eager, native-avx2 and native."""
    if engines == "auto":
        return ("eager", "native") if engine_mode("auto", device) != "eager" else ("eager",)
    names = tuple(dict.fromkeys(e.strip() for e in engines.split(",") if e.strip()))
    if not names or any(e not in BENCH_ENGINES for e in names):
        raise ValueError(f"--engines takes {', '.join(BENCH_ENGINES)} (comma-separated), or auto; got {engines!r}")
    for e in names:
        engine_mode(e, device)
    return names
