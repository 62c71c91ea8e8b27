"""`smallem generate`: one prompt's continuation on stdout, its statistics on stderr."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from .. import defaults, options
from . import args
from .app import app, bad_input, err, fail, load_run, stats_line
from .console import text_out


@app.command()
def generate(
    prompt: Annotated[str | None, typer.Argument(help="prompt text; '-' or a pipe reads stdin")] = None,
    target: args.Target = defaults.TARGET,
    proposer: args.Proposer = None,
    k: args.K = None,
    max_new_tokens: args.MaxNew = defaults.MAX_NEW_TOKENS,
    temperature: args.Temperature = defaults.TEMPERATURE,
    top_k: args.TopK = None,
    top_p: args.TopP = None,
    min_p: args.MinP = None,
    penalty: args.Penalty = 1.0,
    stops: Annotated[list[str] | None, typer.Option("--stop", help="end the text before it (repeatable)")] = None,
    seed: args.Seed = defaults.SEED,
    device: args.Device = defaults.DEVICE,
    tokenizer: args.Tokenizer = None,
    proposer_vocab: args.ProposerVocab = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no statistics on stderr")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="one JSON object: text, tokens, stats")] = False,
    engine: args.Engine = defaults.ENGINE,
    threads: args.RunThreads = None,
    tree: args.Tree = defaults.TREE,
    weights: args.Weights = defaults.PROPOSER_WEIGHTS,
    chat: Annotated[bool, typer.Option("--chat", help="the prompt as a user message in the chat template")] = False,
    system: Annotated[str | None, typer.Option(help="the system message (implies --chat)")] = None,
) -> None:
    """Generate a continuation of PROMPT. The text goes to stdout, statistics to stderr."""
    import json

    from ..engine import family
    from ..engine.generate import answer
    from ..engine.request import Request
    from ..engine.stops import StopPrinter
    from ..model.chat import chat_ids, messages
    from ..model.tokenizer import encode
    from ..spec.sampling import NonFiniteError, Sampling
    from ..stats import Stats

    with bad_input():
        proposer = proposer or family.default_proposer(target, temperature == 0)
        kk = options.pick_k(proposer, k, temperature == 0)
        options.check_sampling(temperature, top_k, top_p, seed, min_p, penalty, stops, max_new_tokens)
        text = options.read_prompt(prompt)
        vocab = options.proposer_vocab(temperature == 0, proposer_vocab)
        chat = chat or system is not None
        given = None if k is None else kk  # None: the proposer's default (an EAGLE head's, by this machine's costs)
        tgt, eng = load_run(
            target, proposer, device, tokenizer, vocab, options.tree(tree), weights, engine, threads, quiet, given, chat
        )
        tok = tgt.tok
        ids = chat_ids(tok, tgt.chat, messages(text, system)) if chat else encode(tok, text)
        options.check_context(len(ids), max_new_tokens, kk, eng.context)  # the model's, or what the memory holds

    request = Request(0, 0, tuple(ids), max_new_tokens, Sampling(temperature, top_k, top_p, seed, min_p, penalty))
    stats = Stats(proposer, eng.k_of(temperature == 0), backend=eng.backend)
    out = StopPrinter(tok.decode, None if json_out else text_out(), stops or [])
    try:
        for chunk in answer(eng, request, stats):
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
