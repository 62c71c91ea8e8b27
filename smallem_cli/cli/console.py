"""Terminal helpers: Ctrl-C, closed or full standard streams, training progress, streamed text."""

from __future__ import annotations

import errno
import io
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:  # train imports torch: seconds the command line does not wait for before it parses
    from rich.console import Console

    from ..train.loop import Progress as TrainProgress
    from ..train.loop import ProgressFn


def quiet_ctrl_c() -> None:
    """Ctrl-C raises KeyboardInterrupt, except during an import: then the process exits 130 at once (an
    import may swallow the interrupt or be left half done by it: torch, loading numpy, does both)."""

    def on_ctrl_c(signum: int, frame: FrameType | None) -> None:
        while frame is not None:
            if frame.f_code.co_filename.startswith("<frozen importlib"):
                os._exit(130)  # nothing is written while loading: nothing is lost
            frame = frame.f_back
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():  # where Python handles signals
        signal.signal(signal.SIGINT, on_ctrl_c)


BROKEN_PIPE_EXIT = 128 + 13  # what a command killed by SIGPIPE gives: the reader went away


class StdoutClosed(Exception):
    """The reader of stdout went away (`smallem generate | head -c 10`): a quiet end. Not an OSError,
    so that no handler of bad input (nor click's, which exits 1) takes it for one."""


class StdoutError(Exception):
    """stdout cannot be written (closed, or a full disk): one line on stderr, exit 1."""


class _Closed(io.TextIOBase):
    """A stdout the process was started without (`>&-`): only a command that prints fails."""

    def write(self, s: str) -> int:
        raise OSError(errno.EBADF, "stdout is closed")


class _Guarded(io.TextIOBase):
    """sys.stdout whose failed write or flush raises StdoutClosed (a broken pipe) or StdoutError."""

    def __init__(self, raw: TextIO) -> None:
        self.raw = raw

    @contextmanager
    def _failing(self) -> Iterator[None]:
        try:
            yield
        except BrokenPipeError:
            raise StdoutClosed from None
        except OSError as e:
            raise StdoutError(f"cannot write to stdout: {e.strerror or e}") from None

    def write(self, s: str) -> int:
        with self._failing():
            return self.raw.write(s)

    def flush(self) -> None:
        with self._failing():
            self.raw.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self.raw.isatty()

    def fileno(self) -> int:
        return self.raw.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self.raw.encoding


# A model's text may hold control characters: on a terminal, ESC starts a sequence that can recolour,
# clear or remap the screen (a random model switches it to line-drawing glyphs), so each one is shown
# as its Unicode control picture. Newline and tab stay; a pipe or a file gets the bytes unchanged.
_PICTURES = {c: 0x2400 + c for c in range(0x20) if chr(c) not in "\n\t"} | {0x7F: 0x2421}
_PICTURES |= {c: 0xFFFD for c in range(0x80, 0xA0)}  # C1 controls (CSI is 0x9B on some terminals)


class _Shown(_Guarded):
    """A terminal's view of model text: control characters made visible, not obeyed."""

    def write(self, s: str) -> int:
        return super().write(s.translate(_PICTURES))  # one character for one: its length is the text's


def text_out() -> TextIO:
    """Where a command prints a model's text: stdout, made safe to show when it is a terminal."""
    return _Shown(sys.stdout) if sys.stdout.isatty() else sys.stdout  # type: ignore[return-value]


def guard_streams() -> None:
    """A closed stdin reads as empty; a failed write to stdout is a StdoutError or StdoutClosed (`main`)."""
    if sys.stdin is None:
        sys.stdin = open(os.devnull, encoding="utf-8")
    if sys.stdout is None:
        sys.stdout = _Closed()
    if not isinstance(sys.stdout, _Guarded):
        sys.stdout = _Guarded(sys.stdout)


def stdout_to_devnull() -> None:
    """After stdout failed: point it at /dev/null, or Python's flush at exit warns with a traceback."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):  # not a file: nothing to redirect
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def progress_printer(name: str, err: Console) -> ProgressFn:
    """A rich progress bar on a terminal (from the first step); a plain line every 30 s in a log file. A line the run
    tells (a str: resumed, interrupted, evaluating) is printed at once."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    def status(p: TrainProgress) -> str:
        val = f" val {p.val_loss:.3f}" if p.val_loss is not None else ""
        extra = "".join(f" {k} {v:.3f}" for k, v in p.extra.items())
        return f"step {p.step} loss {p.loss:.3f}{extra}{val} {p.tokens_per_s:,.0f} tok/s"

    if err.is_terminal:
        bar = Progress(
            TextColumn(name), BarColumn(), TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=err
        )
        task = bar.add_task(name, total=1.0, info="")

        def show(p: TrainProgress | str) -> None:
            if isinstance(p, str):
                bar.stop()  # a run that stops, or ends its steps, leaves no bar drawn behind it
                err.print(f"{name}: {p}")
                return
            bar.start()  # (again, after a line: the bar goes on below it)
            bar.update(task, completed=p.done, info=status(p))
            if p.done >= 1.0:
                bar.stop()

        return show
    last = [0.0]

    def log(p: TrainProgress | str) -> None:
        if isinstance(p, str):
            print(f"{name}: {p}", file=sys.stderr, flush=True)
            return
        if time.monotonic() - last[0] >= 30 or p.done >= 1.0:
            last[0] = time.monotonic()
            eta = p.elapsed_s * (1 - p.done) / p.done if p.done > 0 else 0.0
            print(f"{name} {status(p)} seen {p.tokens_seen:,} eta {eta:.0f}s", file=sys.stderr, flush=True)

    return log
