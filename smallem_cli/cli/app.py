"""What every command shares: the Typer app, the error line, stderr and the tables on stdout."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.text import Text

from .. import options
from ..errors import INPUT_ERRORS, UsageError, one_line

if TYPE_CHECKING:
    import torch

    from ..engine.family import Target as Model
    from ..engine.proposers import Proposer
    from ..engine.scheduler import Engine
    from ..stats import Stats

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Generate text from small language models with speculative decoding.",
)
# Markup off: messages hold paths and names the user chose, and `[/]` in one is not markup.
err = Console(stderr=True, soft_wrap=True, markup=False, highlight=False)


class _Tables:
    """Tables go to stdout (whatever it is when they print); wide enough to stay readable when piped."""

    def print(self, *objects: object) -> None:
        width = None if sys.stdout.isatty() else 200
        Console(file=sys.stdout, width=width, markup=False, highlight=False).print(*objects)


tables = _Tables()


def fail(msg: str, code: int = 2) -> typer.Exit:
    """Print `error: msg` as one line on stderr; the caller raises the returned Exit."""
    err.print(Text.assemble(("error:", "red"), " " + one_line(msg)), soft_wrap=True)
    return typer.Exit(code)


@contextmanager
def bad_input(*more: type[Exception]) -> Iterator[None]:
    """Bad input raised inside (INPUT_ERRORS, or one of `more`) ends the command: its error line, exit 2."""
    try:
        yield
    except (*INPUT_ERRORS, *more) as e:
        raise fail(str(e)) from None


def new_file(path: Path, option: str, overwrite: bool) -> None:
    """Refuse an output that is a folder, that exists without --overwrite (nothing is replaced unasked), that is
    no regular file (a link, a device), or whose folder cannot be made or written in."""
    from .. import atomic

    if path.is_dir():
        raise fail(f"{path} is a folder, not a file: choose another {option}")
    if path.exists() and not overwrite:
        raise fail(f"{path} exists: pass --overwrite to replace it, or {option} to write elsewhere")
    writable(path, option)
    try:
        atomic.check_replaceable(path)
    except OSError as e:
        raise fail(f"{option}: {e}") from None


def writable(path: Path, option: str, folder: bool = False) -> None:
    """Refuse a destination that cannot be made, before any work: a file where a folder is needed, or a nearest
    existing folder above it that is a file or cannot be written in (the folders between are made)."""
    if folder and path.exists() and not path.is_dir():
        raise fail(f"{option} {path} is a file, not a folder: give a folder")
    above = path if folder else path.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise fail(f"{option} {path}: {above} is a file, not a folder")
    if not os.access(above, os.W_OK | os.X_OK):
        raise fail(f"{option} {path}: cannot write in {above}")


def load_run(target: Path, proposer: str, device: str, tokenizer: Path | None, vocab: int, tree: tuple[int, int] | None,
             weights: str, engine: str, threads: int | None, quiet: bool, k: int | None, chat: bool = False,
             max_batch: int = 1, share: bool = True, suffix_shared: bool = True) -> tuple[Model, Engine]:  # fmt: skip
    """What a command that runs the engine loads: the target (`chat`: its chat template checked first), the proposer
    (`vocab`: its head's cut), the backend with every model's native steps built, the threads (`share`: fewer while
    other processes run) -> the target and its engine (`suffix_shared`: the suffix lookup reads every text it wrote
    before). INPUT_ERRORS on bad input."""
    import torch

    from ..backends.engines import Backend, chosen, engine_mode
    from ..engine import family
    from ..engine.build import build
    from ..engine.config import EngineConfig

    if max_batch < 1:
        raise UsageError(f"--max-batch must be >= 1, got {max_batch}")
    dev = family.pick_device(device)
    backend = Backend(engine_mode(chosen(engine), dev))
    tgt = family.load_target(target, dev, tokenizer, chat)
    loaded = family.load_proposer(proposer, tgt, dev, vocab, tree, weights)
    if n := options.threads(threads) or (options.threads_for_load(torch.get_num_threads()) if share else None):
        torch.set_num_threads(n)
    # every model the run may use, given its native steps (built once) before the clock starts
    backend.prepare(tgt.model, loaded.models, None if quiet else err.print, loaded.models if loaded.int8 else ())
    config = EngineConfig(
        tgt.model, loaded, backend, k, max_batch, end_ids=tgt.chat.end_ids, decode=tgt.tok.decode,
        suffix_shared=suffix_shared,
    )  # fmt: skip
    return tgt, build(config)


def target_alone(tgt: Model, device: torch.device, proposer: Proposer | None = None) -> Engine:
    """The batch engine of the target alone, `GEN_BATCH` sequences at once, for the text it writes to train on
    (`proposer`: one that drafts nothing but keeps what it is handed, `eagle_data.Recorder`)."""
    from .. import defaults
    from ..backends.engines import Backend, chosen, engine_mode
    from ..engine.build import build
    from ..engine.config import EngineConfig
    from ..engine.family import NONE

    backend = Backend(engine_mode(chosen("auto"), device))
    backend.prepare(tgt.model, [], err.print)
    config = EngineConfig(tgt.model, NONE, backend, None, defaults.GEN_BATCH, tgt.chat.end_ids, tgt.tok.decode)
    return build(config, proposer)


def stats_line(stats: Stats) -> str:
    """A generation's statistics, as `generate` and `chat` print them."""
    return (
        f"{stats.new_tokens} tokens in {stats.elapsed_s:.2f} s: {stats.tokens_per_s:.1f} tok/s, "
        f"acceptance {stats.acceptance_rate:.2f}, {stats.tokens_per_pass:.2f} tokens/pass "
        f"({stats.proposer}, k={stats.k}, {stats.backend})"
    )
