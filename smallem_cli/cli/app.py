"""What every command shares: the Typer app, the error line, stderr and the tables on stdout."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.text import Text

from .. import options
from ..errors import INPUT_ERRORS, one_line

if TYPE_CHECKING:
    from ..engine.config import EngineConfig
    from ..engine.family import Target as Model
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


def load_run(
    target: Path,
    proposer: str,
    device: str,
    tokenizer: Path | None,
    vocab: int,
    tree: tuple[int, int] | None,
    weights: str,
    engine: str,
    threads: int | None,
    quiet: bool,
    chat: bool = False,
    share: bool = True,
) -> tuple[Model, EngineConfig]:
    """What every command that runs the engine loads: the target (`chat`: its chat template checked first), the
    proposer (`vocab`: its head's cut), the backend with every model's native steps built, the thread count set
    (`share`: by default fewer threads while other processes run) -> the target and the engine's config (its end
    tokens and decoder the target's). INPUT_ERRORS on bad input."""
    import torch

    from ..backends.engines import Backend, chosen, engine_mode
    from ..engine import family
    from ..engine.config import EngineConfig

    dev = family.pick_device(device)
    backend = Backend(engine_mode(chosen(engine), dev))
    tgt = family.load_target(target, dev, tokenizer, chat)
    loaded = family.load_proposer(proposer, tgt, dev, vocab, tree, weights)
    if n := options.threads(threads) or (options.threads_for_load(torch.get_num_threads()) if share else None):
        torch.set_num_threads(n)
    # every model the run may use, given its native steps (built once) before the clock starts
    backend.prepare(tgt.model, loaded.models, None if quiet else err.print, loaded.models if loaded.int8 else ())
    return tgt, EngineConfig(tgt.model, loaded, backend, end_ids=tgt.chat.end_ids, decode=tgt.tok.decode)


def stats_line(stats: Stats) -> str:
    """A generation's statistics, as `generate` and `chat` print them."""
    return (
        f"{stats.new_tokens} tokens in {stats.elapsed_s:.2f} s: {stats.tokens_per_s:.1f} tok/s, "
        f"acceptance {stats.acceptance_rate:.2f}, {stats.tokens_per_pass:.2f} tokens/pass "
        f"({stats.proposer}, k={stats.k}, {stats.backend})"
    )
