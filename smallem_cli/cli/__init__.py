"""The `smallem` command: parse, load, call, print. Library modules never print."""

from __future__ import annotations

import sys

from .console import BROKEN_PIPE_EXIT, StdoutClosed, StdoutError, guard_streams, quiet_ctrl_c, stdout_to_devnull

quiet_ctrl_c()  # first: Ctrl-C while the libraries below load exits 130, without a traceback

from . import batch, bench, chat, evaluate, export, generate, serve, train  # noqa: E402, F401  (each registers its commands)
from .app import app as command  # noqa: E402  (`app` stays the module's name here)
from .app import fail  # noqa: E402


def main() -> None:
    """The `smallem` entry point. Ctrl-C anywhere, the libraries' import included, exits 130 quietly;
    a reader of stdout that goes away ends the run quietly (141); stdout closed or full is one line, exit 1."""
    guard_streams()
    try:
        try:
            command()  # typer turns a KeyboardInterrupt in a command into exit 130
        finally:
            sys.stdout.flush()  # here, not at exit: a failure is told like any other write's
    except KeyboardInterrupt:  # one that lands in typer's own set-up, before any command runs
        raise SystemExit(130) from None
    except StdoutClosed:
        stdout_to_devnull()
        raise SystemExit(BROKEN_PIPE_EXIT) from None
    except StdoutError as e:
        stdout_to_devnull()
        fail(str(e))  # the error line
        raise SystemExit(1) from None
