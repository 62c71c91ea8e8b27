"""The options several commands take, declared once (each command gives its own default): `args.Target`, ..."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .. import defaults

Target = Annotated[Path, typer.Option(help="target: a smallem checkpoint, a Hugging Face model folder or a GGUF file")]
Proposer = Annotated[str | None, typer.Option(help=defaults.PROPOSER_HELP)]
Device = Annotated[str, typer.Option(help="auto | cpu | cuda | cuda:N")]
Threads = Annotated[int | None, typer.Option(help="torch CPU threads")]
RunThreads = Annotated[int | None, typer.Option(help="CPU threads (default: all, fewer while other processes run)")]
_K_HELP = (
    f"proposals per round, 1..{defaults.MAX_K} (default: per proposer and mode); greedy requests get none while more "
    f"than {defaults.SPECULATE_UP_TO} decode together (but a lookup's)"
)
K = Annotated[int | None, typer.Option("-k", "--k", help=_K_HELP)]
MaxBatch = Annotated[int, typer.Option(help="requests decoded together, at most")]
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
Tree = Annotated[int, typer.Option("--tree", help=defaults.TREE_HELP)]
Weights = Annotated[str, typer.Option("--proposer-weights", help=defaults.WEIGHTS_HELP)]
DataDir = Annotated[Path, typer.Option("--data", help="the corpus folder that `smallem data` writes")]
