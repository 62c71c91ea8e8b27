"""What every command shares: the Typer app, the error line, stderr and the tables on stdout."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.text import Text

from .. import defaults as D
from .. import options as O

if TYPE_CHECKING:
    from ..backends.engines import Backend
    from ..engine.family import Proposer as Loaded
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
    err.print(Text.assemble(("error:", "red"), " " + O.one_line(msg)), soft_wrap=True)
    return typer.Exit(code)


@contextmanager
def bad_input(*more: type[Exception]) -> Iterator[None]:
    """Bad input raised inside (INPUT_ERRORS, or one of `more`) ends the command: its error line, exit 2."""
    try:
        yield
    except (*O.INPUT_ERRORS, *more) as e:
        raise fail(str(e)) from None


# Options that several commands take, declared once (each command gives its own default)
Target = Annotated[Path, typer.Option(help="target: a smallem checkpoint, a Hugging Face Llama folder or a GGUF file")]
Proposer = Annotated[str | None, typer.Option(help=D.PROPOSER_HELP)]
Device = Annotated[str, typer.Option(help="auto | cpu | cuda | cuda:N")]
Threads = Annotated[int | None, typer.Option(help="torch CPU threads")]
RunThreads = Annotated[int | None, typer.Option(help="CPU threads (default: all, fewer while other processes run)")]
K = Annotated[
    int | None,
    typer.Option(
        "-k",
        "--k",
        help=f"proposals per round, 1..16 (default: per proposer and mode); greedy requests get none while"
        f" more than {D.SPECULATE_UP_TO} decode together",
    ),
]
Engine = Annotated[str, typer.Option(help="auto ($SMALLEM_ENGINE, or native on a CPU) | native | native-avx2 | eager")]
# The sampling options `generate`, `chat` and `batch` share (`batch`: a request's fields left out)
MaxNew = Annotated[int, typer.Option("--max-new-tokens", "-n")]
Temperature = Annotated[float, typer.Option(help="0 = greedy")]
TopK = Annotated[int | None, typer.Option("--top-k")]
TopP = Annotated[float | None, typer.Option("--top-p")]
MinP = Annotated[float | None, typer.Option("--min-p", help="drop tokens < MIN_P x the top probability")]
Penalty = Annotated[float, typer.Option("--repetition-penalty", help="on every token so far (1 = off)")]
Seed = Annotated[int, typer.Option()]
Tokenizer = Annotated[Path | None, typer.Option(help="tokenizer.json (default: beside the target)")]
ProposerVocab = Annotated[
    int | None, typer.Option(help="proposer head: top-N frequent tokens (0 = all) (default: per mode)")
]
Tree = Annotated[int, typer.Option("--tree", help=D.TREE_HELP)]
Weights = Annotated[str, typer.Option("--proposer-weights", help=D.WEIGHTS_HELP)]
DataDir = Annotated[Path, typer.Option("--data", help="the corpus folder that `smallem data` writes")]


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
) -> tuple[Model, Loaded, Backend]:
    """What `generate` and `chat` load alike: the target, the proposer (`vocab`: its head's cut),
    the backend with every model's native steps built, the thread count set. INPUT_ERRORS on bad input."""
    import torch

    from ..backends.engines import Backend, chosen, engine_mode
    from ..engine import family

    dev = family.pick_device(device)
    tgt = family.load_target(target, dev, tokenizer)
    loaded = family.load_proposer(proposer, tgt, dev, vocab, tree, weights)
    backend = Backend(engine_mode(chosen(engine), dev))
    if n_threads := O.threads(threads) or O.threads_for_load(torch.get_num_threads()):
        torch.set_num_threads(n_threads)
    # every model the run may use, given its native steps (built once) before the clock starts
    backend.prepare(tgt.model, loaded.models, None if quiet else err.print, loaded.models if loaded.int8 else ())
    return tgt, loaded, backend


def stats_line(stats: Stats) -> str:
    """A generation's statistics, as `generate` and `chat` print them."""
    return (
        f"{stats.new_tokens} tokens in {stats.elapsed_s:.2f} s: {stats.tokens_per_s:.1f} tok/s, "
        f"acceptance {stats.acceptance_rate:.2f}, {stats.tokens_per_pass:.2f} tokens/pass "
        f"({stats.proposer}, k={stats.k}, {stats.backend})"
    )
