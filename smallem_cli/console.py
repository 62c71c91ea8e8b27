"""Terminal helpers for the CLI: Ctrl-C, a training progress display, a streaming text writer."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, Protocol, TextIO

if TYPE_CHECKING:  # train imports torch: seconds the command line does not wait for before it parses
    from rich.console import Console

    from .train import Progress as P
    from .train import ProgressFn


def quiet_ctrl_c() -> None:
    """Ctrl-C raises KeyboardInterrupt as usual, except while a module is being imported: then
    the process exits 130 at once. A library's import may swallow the interrupt or be left half
    loaded by it (torch, loading numpy, does both), so it cannot be handled there."""

    def on_ctrl_c(signum: int, frame: FrameType | None) -> None:
        f = frame
        while f is not None:
            if f.f_code.co_filename.startswith("<frozen importlib"):
                os._exit(130)  # nothing is written while loading: nothing is lost
            f = f.f_back
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():  # where Python handles signals
        signal.signal(signal.SIGINT, on_ctrl_c)


def progress_printer(name: str, err: Console) -> ProgressFn:
    """A rich progress bar on a terminal; a plain line every 30 s in a log file."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    if err.is_terminal:
        bar = Progress(
            TextColumn(f"{name}"), BarColumn(), TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=err
        )
        bar.start()
        task = bar.add_task(name, total=1.0, info="")

        def show(p: P) -> None:
            info = f"step {p.step} loss {p.loss:.3f} {p.tokens_per_s:,.0f} tok/s"
            if p.val_loss is not None:
                info += f" val {p.val_loss:.3f}"
            bar.update(task, completed=p.done, info=info)
            if p.done >= 1.0:
                bar.stop()

        return show
    last = [0.0]

    def log(p: P) -> None:
        if time.monotonic() - last[0] >= 30 or p.done >= 1.0:
            last[0] = time.monotonic()
            val = f" val {p.val_loss:.3f}" if p.val_loss is not None else ""
            extra = "".join(f" {k} {v:.3f}" for k, v in p.extra.items())
            eta = p.elapsed_s * (1 - p.done) / p.done if p.done > 0 else 0.0
            print(
                f"{name} step {p.step} loss {p.loss:.3f}{extra}{val} {p.tokens_per_s:,.0f} tok/s "
                f"seen {p.tokens_seen:,} eta {eta:.0f}s",
                file=sys.stderr,
                flush=True,
            )

    return log


class Decoder(Protocol):
    """What decodes tokens to text: a `tokenizers.Tokenizer`, or anything with its `decode`."""

    def decode(self, ids: list[int]) -> str: ...


class TextStream:
    """Decodes a growing token list and writes only the new, complete characters."""

    def __init__(self, tokenizer: Decoder, out: TextIO | None) -> None:
        self.tok, self.out = tokenizer, out  # out None: keep the tokens, write nothing
        self.ids: list[int] = []
        self.printed = 0

    def push(self, ids: list[int], final: bool = False) -> None:
        self.ids.extend(ids)
        if self.out is None:
            return
        text = self.tok.decode(self.ids)
        end = len(text) if final else len(text.rstrip("\ufffd"))  # hold back a split UTF-8 character
        if end > self.printed:
            self.out.write(text[self.printed : end])
            self.out.flush()
            self.printed = end
