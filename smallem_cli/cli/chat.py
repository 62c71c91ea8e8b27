"""`smallem chat`: a conversation in the terminal, each answer streamed as it is verified; its cache
outlives each answer (`Request.session`). Ctrl-C stops an answer, Ctrl-D (or the end of stdin) the session."""

from __future__ import annotations

import contextlib
import signal
import sys
from types import FrameType
from typing import Annotated

import typer

from .. import defaults, options
from ..errors import UsageError, one_line
from . import args
from .app import app, bad_input, err, fail, load_run, stats_line
from .console import text_out


@app.command()
def chat(
    target: args.Target = defaults.TARGET,
    proposer: args.Proposer = None,
    k: args.K = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="per answer")] = defaults.MAX_NEW_TOKENS,
    temperature: args.Temperature = defaults.TEMPERATURE,
    top_k: args.TopK = None,
    top_p: args.TopP = None,
    min_p: args.MinP = None,
    penalty: args.Penalty = 1.0,
    seed: Annotated[int, typer.Option(help="the first answer's; each next answer's is one more")] = defaults.SEED,
    system: Annotated[str | None, typer.Option(help="the system message")] = None,
    device: args.Device = defaults.DEVICE,
    tokenizer: args.Tokenizer = None,
    engine: args.Engine = defaults.ENGINE,
    weights: args.Weights = defaults.PROPOSER_WEIGHTS,
    threads: args.RunThreads = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no statistics on stderr")] = False,
) -> None:
    """Talk with a chat model: a line of stdin is a message, the answer streams to stdout."""
    from ..engine import family
    from ..engine.generate import answer
    from ..engine.request import Request
    from ..engine.stops import StopPrinter
    from ..model.chat import ChatError, chat_ids
    from ..model.tokenizer import TokenizerError
    from ..spec.sampling import NonFiniteError, Sampling
    from ..stats import Stats

    with bad_input():
        proposer = proposer or family.default_proposer(target, temperature == 0)
        kk = options.pick_k(proposer, k, temperature == 0)
        options.check_sampling(temperature, top_k, top_p, seed, min_p, penalty, [], max_new_tokens)
        vocab = defaults.proposer_vocab(temperature == 0)
        # one conversation's cache, grown up to the context or the memory
        given = None if k is None else kk  # None: the proposer's default (an EAGLE head's, by this machine's costs)
        tgt, eng = load_run(
            target, proposer, device, tokenizer, vocab, None, weights, engine, threads, quiet, given, chat=True
        )
        if tgt.chat.template is None:
            raise UsageError(f"{target} has no chat template: `smallem generate` continues plain text")
    conversation = [] if system is None else [{"role": "system", "content": system}]
    ctrl_c = _CtrlC()
    previous = signal.signal(signal.SIGINT, ctrl_c)
    if callable(reconfigure := getattr(sys.stdin, "reconfigure", None)):
        reconfigure(errors="surrogateescape")  # bytes that are not UTF-8 reach the check below, not a traceback
    try:
        while (line := ctrl_c.read("> " if sys.stdin.isatty() else "")) is not None:
            if not line.strip():
                continue
            conversation.append({"role": "user", "content": line})
            try:
                _utf8(line)
                ids = chat_ids(tgt.tok, tgt.chat, conversation)
                options.check_context(len(ids), max_new_tokens, kk, eng.context)
            except (ChatError, TokenizerError, UsageError) as e:  # this message is refused; the conversation goes on
                conversation.pop()
                err.print(f"error: {one_line(str(e))}")
                continue
            sampling = Sampling(temperature, top_k, top_p, seed + len(conversation) // 2, min_p, penalty)
            request = Request(0, 0, tuple(ids), max_new_tokens, sampling, session=0)
            stats = Stats(proposer, eng.k_of(temperature == 0), backend=eng.backend)
            out = StopPrinter(tgt.tok.decode, text_out(), [])  # streamed as it comes, until a Ctrl-C
            try:
                with contextlib.closing(answer(eng, request, stats)) as chunks:
                    for chunk in chunks:
                        out.push(chunk)
                        if ctrl_c.hit:
                            break
            except NonFiniteError as e:
                raise fail(str(e), 1) from None
            out.push([], final=True)
            print(flush=True)
            conversation.append({"role": "assistant", "content": out.text})
            if ctrl_c.hit:
                err.print("(interrupted)")
            elif not quiet:
                err.print(f"{stats_line(stats)}; {stats.reused} of {len(ids)} prompt tokens from the cache")
    finally:
        signal.signal(signal.SIGINT, previous)


def _utf8(line: str) -> None:
    try:
        line.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: a byte of stdin that was not UTF-8
        raise UsageError(f"the message is not valid UTF-8 (at character {e.start + 1}); it was not sent") from None


class _CtrlC:
    """The SIGINT handler of a session. At the prompt, Ctrl-C clears the line; anywhere else it
    raises a flag, read between rounds: the answer then stops where its cache is whole."""

    def __init__(self) -> None:
        self.reading = self.hit = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.reading:
            raise KeyboardInterrupt
        self.hit = True

    def read(self, prompt: str) -> str | None:
        """The next message; None at the end of input (Ctrl-D)."""
        self.reading, self.hit = True, False
        try:
            while True:
                try:
                    return input(prompt)
                except EOFError:
                    if prompt:
                        print()
                    return None
                except KeyboardInterrupt:
                    print()
        finally:
            self.reading = False
