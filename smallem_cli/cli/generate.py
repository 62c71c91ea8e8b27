"""`smallem generate`: one prompt's continuation on stdout, its statistics on stderr."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from .. import defaults as D
from .. import options as O
from . import app as A
from .app import app, bad_input, err, fail, load_run, stats_line
from .console import text_out


@app.command()
def generate(
    prompt: Annotated[str | None, typer.Argument(help="prompt text; '-' or a pipe reads stdin")] = None,
    target: A.Target = D.TARGET,
    proposer: A.Proposer = None,
    k: A.K = None,
    max_new_tokens: A.MaxNew = D.MAX_NEW_TOKENS,
    temperature: A.Temperature = D.TEMPERATURE,
    top_k: A.TopK = None,
    top_p: A.TopP = None,
    min_p: A.MinP = None,
    penalty: A.Penalty = 1.0,
    stops: Annotated[list[str] | None, typer.Option("--stop", help="end the text before it (repeatable)")] = None,
    seed: A.Seed = D.SEED,
    device: A.Device = D.DEVICE,
    tokenizer: A.Tokenizer = None,
    proposer_vocab: A.ProposerVocab = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no statistics on stderr")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="one JSON object: text, tokens, stats")] = False,
    engine: A.Engine = D.ENGINE,
    threads: A.RunThreads = None,
    tree: A.Tree = D.TREE,
    weights: A.Weights = D.PROPOSER_WEIGHTS,
    chat: Annotated[bool, typer.Option("--chat", help="the prompt as a user message in the chat template")] = False,
    system: Annotated[str | None, typer.Option(help="the system message (implies --chat)")] = None,
) -> None:
    """Generate a continuation of PROMPT. The text goes to stdout, statistics to stderr."""
    import json

    from ..engine import family
    from ..engine.generate import stream
    from ..engine.stops import StopPrinter
    from ..model.chat import chat_ids, messages
    from ..model.tokenizer import encode
    from ..spec.sampling import NonFiniteError, Sampling
    from ..stats import Stats

    with bad_input():
        proposer = proposer or family.default_proposer(target, temperature == 0)
        kk = O.pick_k(proposer, k, temperature == 0)
        O.check_sampling(temperature, top_k, top_p, seed, min_p, penalty, stops, max_new_tokens)
        text = O.read_prompt(prompt)
        O.check_vocab(proposer_vocab)
        vocab = D.proposer_vocab(temperature == 0, proposer_vocab)
        tgt, loaded, backend = load_run(
            target, proposer, device, tokenizer, vocab, O.tree(tree), weights, engine, threads, quiet
        )
        tok = tgt.tok
        ids = chat_ids(tok, tgt.chat, messages(text, system)) if chat or system is not None else encode(tok, text)
        O.check_context(len(ids), max_new_tokens, kk, tgt.model.cfg.max_seq_len)

    sampling = Sampling(temperature, top_k, top_p, seed, min_p, penalty)
    stats = Stats(proposer, kk, backend=backend.label)
    out = StopPrinter(tok.decode, None if json_out else text_out(), stops or [])
    try:
        for chunk in stream(tgt.model, loaded, ids, max_new_tokens, kk, sampling, tgt.chat.end_ids, stats, backend):
            if out.push(chunk):  # a stop string: the text ends before it, and generation here
                break
        out.push([], final=True)
    except KeyboardInterrupt:  # keep what was generated: printed, or in the JSON marked as interrupted
        if json_out:
            record = {"text": out.text, "tokens": out.ids, "stats": stats.as_dict(), "interrupted": True}
            print(json.dumps(record), flush=True)
        sys.stdout.flush()
        err.print("\ninterrupted")
        raise typer.Exit(130) from None
    except NonFiniteError as e:  # what was printed stays; the run stops loudly
        sys.stdout.flush()
        raise fail(str(e), 1) from None
    print(json.dumps({"text": out.text, "tokens": out.ids, "stats": stats.as_dict()}) if json_out else "")
    if not quiet:
        err.print(stats_line(stats))
