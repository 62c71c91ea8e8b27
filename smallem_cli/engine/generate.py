"""One prompt, generated on the engine with a batch of one.

    prefill      the prompt goes through the target (and the proposer); the target's last
                 logits give the first new token, `last`.
    round        the proposer guesses d_1..d_k; one target pass reads [last, d_1..d_k]
                 and scores k+1 positions; verification keeps n guesses and adds one
                 token of the target's; both caches roll back to what was kept.

The loop is the engine's (`engine.runner`, `engine.scheduler`): the same prefill, verify
pass, verification and rollback as a batch of many, one host sync per round. A pool that
holds one sequence hands its pages out in order, so its passes take the fast paths a batch
of one has: the target's native step over one view of the slab (`TargetRunner.one_pass`),
and the proposer's round of guesses in one native call (`proposers._ModelGuess._chain`).
"""

from __future__ import annotations

from collections.abc import Iterator

from ..backends.engines import Backend
from ..defaults import PAGE_SIZE
from ..model.llama import Transformer
from ..spec.sampling import Sampling
from ..stats import Stats
from .build import assemble
from .family import Proposer
from .pool import PagePool, pages_for
from .request import Request
from .scheduler import Emitted, Engine, round_ahead


def engine_for_one(
    target: Transformer,
    proposer: Proposer,
    n_tokens: int,
    k: int,
    stop_token: int | None,
    backend: Backend | None = None,
    page_size: int = PAGE_SIZE,
) -> Engine:
    """An engine for one sequence of a prompt and new tokens, n_tokens positions in all."""
    n_pages = pages_for(n_tokens + round_ahead(k, proposer.tree), page_size) + 1
    pool = PagePool(n_pages, page_size)
    return assemble(target, proposer, backend or Backend(), pool, k, auto_k=False, max_batch=1, eot=stop_token)


def stream(
    target: Transformer,
    proposer: Proposer,
    prompt: list[int],
    max_new_tokens: int,
    k: int,
    sampling: Sampling = Sampling(),
    stop_token: int | None = None,
    stats: Stats | None = None,
    backend: Backend | None = None,
) -> Iterator[list[int]]:
    """Generate, yielding the tokens of each round as soon as they are verified.

    `stats` (if given) is updated in place, so it is valid even if the caller stops early
    (a stop string, say: see `stops`). The stop token ends generation and is not yielded.
    `backend`: what runs the passes, prepared by the caller (None: eager).
    """
    if max_new_tokens < 1:
        return
    engine = engine_for_one(target, proposer, len(prompt) + max_new_tokens, k, stop_token, backend)
    request = Request(0, 0, tuple(prompt), max_new_tokens, sampling)
    for event in engine.events([request]):
        if isinstance(event, Emitted):
            if stats is not None:
                stats.copy_from(event.stats)
            if event.tokens:
                yield event.tokens


def generate(
    target: Transformer,
    proposer: Proposer,
    prompt: list[int],
    max_new_tokens: int,
    k: int,
    sampling: Sampling = Sampling(),
    stop_token: int | None = None,
    backend: Backend | None = None,
) -> tuple[list[int], Stats]:
    """All new tokens at once, with their statistics."""
    stats = Stats(proposer.name, k)
    out: list[int] = []
    for chunk in stream(target, proposer, prompt, max_new_tokens, k, sampling, stop_token, stats, backend):
        out.extend(chunk)
    return out, stats
