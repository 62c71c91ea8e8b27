"""`smallem batch`: many requests, one a line, through the batched engine; JSON answers on stdout.
A Ctrl-C leaves whole lines (exit 130); a reader that goes away ends the run quietly (exit 141)."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Annotated, Any, BinaryIO

import typer

from .. import defaults, options
from ..errors import UsageError
from . import args
from .app import app, bad_input, err, fail, load_run
from .console import BROKEN_PIPE_EXIT, stdout_to_devnull

if TYPE_CHECKING:  # torch, through the engine: loaded once the command runs, not to parse it
    from rich.progress import Progress as Bar

    from ..engine.request import Request
    from ..engine.scheduler import Progress


def open_input(file: str | None) -> BinaryIO:
    """FILE, or stdin for `-` or for no argument on a pipe."""
    if file is None or file == "-":
        if file is None and sys.stdin.isatty():
            raise UsageError("no requests: give a FILE, or pipe them on stdin (one a line)")
        return sys.stdin.buffer
    try:
        return open(file, "rb")  # closed by the command, after the run
    except FileNotFoundError:
        raise UsageError(f"input file not found: {file}") from None
    except OSError as e:
        raise UsageError(f"cannot read {file}: {e.strerror or e}") from None


@contextmanager
def whole_line() -> Iterator[None]:
    """Around one line's write: a Ctrl-C waits for the line's end, a second one interrupts at once."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield  # signals reach only the main thread; a handler set outside Python cannot be put back
        return
    caught: list[int] = []

    def hold(signum: int, frame: object) -> None:
        if caught:
            raise KeyboardInterrupt
        caught.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def write_held(writer: Any, closed: type[Exception]) -> None:
    """After a Ctrl-C: the answers a Writer holds go out, until a second Ctrl-C or the reader goes away."""
    try:
        writer.close()
    except KeyboardInterrupt:
        pass
    except closed:
        stdout_to_devnull()


class Display:
    """What `batch` tells on stderr: a progress line on a terminal (not with --quiet), a summary at the end."""

    def __init__(self, show: bool) -> None:
        self.start = time.monotonic()
        self.answered = self.rejected = self.tokens = 0
        self.acceptance: float | None = None
        self.bar: Bar | None = None
        if show:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            # stdout stays ours: a redirected stdout would send the answers to stderr
            columns = SpinnerColumn(), TextColumn("batch {task.completed:.0f} done"), TextColumn("{task.fields[info]}")
            self.bar = Progress(
                *columns, TimeElapsedColumn(), console=err, transient=True, redirect_stdout=False, redirect_stderr=False
            )
            self.task = self.bar.add_task("batch", total=None, info="")
            self.bar.start()

    def progress(self, p: Progress) -> None:
        self.acceptance = p.acceptance
        if self.bar is not None:
            rate = p.tokens / p.elapsed_s if p.elapsed_s else 0.0
            self.bar.update(self.task, info=f"{rate:,.1f} tok/s, acceptance {p.acceptance:.2f}")

    def answer(self, tokens: int = 0, rejected: bool = False) -> None:
        self.answered += 1
        self.rejected += rejected
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(self.task, completed=self.answered)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def summary(self) -> str:
        elapsed = time.monotonic() - self.start
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        acc = f", acceptance {self.acceptance:.2f}" if self.acceptance is not None else ""
        return (
            f"{self.answered} requests ({self.rejected} rejected): {self.tokens} tokens in {elapsed:.2f} s, "
            f"{rate:.1f} tok/s{acc}"
        )


@app.command()
def batch(
    file: Annotated[
        str | None, typer.Argument(metavar="[FILE|-]", help="requests, one a line; '-' or a pipe reads stdin")
    ] = None,
    target: args.Target = defaults.TARGET,
    proposer: args.Proposer = None,
    k: args.K = None,
    max_new_tokens: args.MaxNew = defaults.MAX_NEW_TOKENS,
    temperature: args.Temperature = defaults.TEMPERATURE,
    top_k: args.TopK = None,
    top_p: args.TopP = None,
    min_p: args.MinP = None,
    penalty: args.Penalty = 1.0,
    seed: args.Seed = defaults.SEED,
    max_batch: args.MaxBatch = defaults.MAX_BATCH,
    ordered: Annotated[bool, typer.Option("--ordered", help="answers in input order (held until their turn)")] = False,
    device: args.Device = defaults.DEVICE,
    threads: args.Threads = None,
    engine: args.Engine = defaults.ENGINE,
    tokenizer: args.Tokenizer = None,
    proposer_vocab: args.ProposerVocab = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="nothing on stderr but errors")] = False,
    tree: args.Tree = defaults.TREE,
    weights: args.Weights = defaults.PROPOSER_WEIGHTS,
) -> None:
    """Answer many requests, one a line of FILE (or stdin), decoded together: a JSON line each on stdout.

    A line is a prompt, or a JSON object: {"prompt": "...", "id": ..., "max_new_tokens": 50, ...}, or "messages"
    ([{"role": ..., "content": ...}], through the target's chat template) in place of "prompt"; its other fields are
    "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed" and "stop" (a string or a list).

    Fields left out take the options below. A line's id, unless it gives one, is its number in the input.

    Each line gets one answer: {"id", "text", "tokens", "stats"}, or {"id", "error"} for a bad line.
    """
    from ..engine import family
    from ..spec.sampling import NonFiniteError
    from . import batch_io

    with ExitStack() as opened:
        with bad_input():
            proposer = proposer or family.default_proposer(target, temperature == 0)
            slack = options.slack(proposer, k)
            options.check_sampling(temperature, top_k, top_p, seed, min_p, penalty, max_new_tokens=max_new_tokens)
            vocab = options.proposer_vocab(True, proposer_vocab)  # a batch mixes modes: the greedy head, the default
            source = open_input(file)  # before the models load: a missing file fails at once
            if source is not sys.stdin.buffer:
                opened.enter_context(source)  # closed after the run, or a failed load
            tgt, eng = load_run(
                target, proposer, device, tokenizer, vocab, options.tree(tree), weights, engine, threads, quiet, k,
                max_batch=max_batch, share=False,
            )  # fmt: skip

        asked = batch_io.Defaults(
            max_new_tokens, temperature, top_k, top_p, seed, min_p=min_p, repetition_penalty=penalty
        )
        writer = batch_io.Writer(sys.stdout, whole_line, ordered)
        shown = Display(show=not quiet and err.is_terminal)

        def requests() -> Iterator[Request]:
            def encode(prompt: str | list[dict[str, str]]) -> list[int]:
                if isinstance(prompt, str):
                    return tgt.tok.encode(prompt).ids
                return options.prompt_ids(tgt.tok, None, tgt.chat, prompt)  # UsageError: the line's error

            lines = batch_io.parse_lines(source, asked, encode, eng.context, slack)
            for item in lines:
                if isinstance(item, batch_io.Rejected):
                    writer.put(item.index, {"id": item.id, "error": item.error})
                    shown.answer(rejected=True)
                else:
                    yield item

        if eng.max_batch < max_batch and not quiet:
            fits = eng.max_batch
            err.print(f"--max-batch {max_batch} lowered to {fits}: the memory here holds the cache of {fits} sequences")
        try:
            for fin in eng.run(requests(), progress=shown.progress):
                writer.put(fin.request.index, batch_io.answer(fin))
                shown.answer(tokens=len(fin.tokens))
            writer.close()
        except KeyboardInterrupt:
            shown.stop()  # the bar goes before the line
            write_held(writer, batch_io.OutputClosed)
            err.print("interrupted")
            raise typer.Exit(130) from None
        except batch_io.OutputClosed:  # the reader went away: nobody is left to tell
            stdout_to_devnull()
            raise typer.Exit(BROKEN_PIPE_EXIT) from None
        except NonFiniteError as e:  # the answers written stay; the run stops loudly
            shown.stop()
            raise fail(str(e), 1) from None
        finally:
            shown.stop()
    if not quiet:
        err.print(shown.summary())
