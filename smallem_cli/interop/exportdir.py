"""An export's folder, written whole or not at all: built under a temporary name beside its
destination and swapped in, so that an error, Ctrl-C or SIGTERM leaves the destination as it
was; what an export killed outright left behind is cleared by the next one."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .. import atomic
from ..model import checkpoint


class ExportError(ValueError):
    """A model that cannot be exported faithfully, or a destination that may not be written."""


def check_destination(outdir: Path, inputs: tuple[Path, ...], overwrite: bool) -> None:
    """An export may write `outdir`: a folder or nothing (`atomic.check_replaceable`), holding none of its
    inputs, empty unless `overwrite`. Called before the checkpoint is read: a refusal comes at once."""
    for p, suffix in orphans(outdir, folder=True):  # `.old`: the previous `outdir`, if the swap never happened
        if suffix == "old" and not outdir.exists():
            p.rename(outdir)
        else:
            shutil.rmtree(p, ignore_errors=True)
    atomic.check_replaceable(outdir, folder=True)
    for src in inputs:  # replacing the folder would delete the export's own input
        if src.resolve().is_relative_to(outdir.resolve()):
            raise ExportError(f"cannot export into {outdir}: it holds the input {src}; choose another folder")
    if outdir.exists() and any(outdir.iterdir()) and not overwrite:
        raise FileExistsError(f"{outdir} exists and is not empty (pass --overwrite to replace it)")


def write_export(outdir: Path, tensors: dict[str, torch.Tensor], jsons: dict[str, Any], tokenizer_json: Path) -> None:
    """The folder built under a temporary name, then swapped in for `outdir`, which any exception leaves as it was."""
    outdir.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = (outdir.with_name(f".{outdir.name}.{os.getpid()}.{x}") for x in ("tmp", "old"))
    shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted run with this process id
    with sigterm_raises():
        tmp.mkdir()
        try:
            checkpoint.write_safetensors(tensors, tmp / "model.safetensors", {"format": "pt"})  # transformers checks it
            for name, obj in jsons.items():
                (tmp / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            shutil.copyfile(tokenizer_json, tmp / "tokenizer.json")
            # Judged again just before the swap: while the folder was built, `outdir` may have become
            # something else, which the rename would move aside and `rmtree` then fail to remove.
            if atomic.check_replaceable(outdir, folder=True):
                outdir.rename(old)
            tmp.rename(outdir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if old.exists() and not outdir.exists():
                old.rename(outdir)  # put the previous folder back
            raise
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM (a `kill`, a stopped job) raises SystemExit(143) in the main thread, so the
    export's clean-up runs as for Ctrl-C; a second SIGTERM is ignored while it does."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def orphans(out: Path, folder: bool) -> Iterator[tuple[Path, str]]:
    """(path, "tmp" or "old") of each `.NAME.PID.tmp` / `.old` beside `out` that a dead export left behind."""
    if not out.parent.is_dir():
        return
    for p in sorted(out.parent.glob(f".{out.name}.*.*")):
        pid, _, suffix = p.name.removeprefix(f".{out.name}.").partition(".")
        kind_ok = p.is_dir() if folder else p.is_file()
        if suffix not in ("tmp", "old") or not pid.isdigit() or not kind_ok or p.is_symlink():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            yield p, suffix
        except (OverflowError, OSError):  # no process id (not an export's), or alive (another user's)
            pass
