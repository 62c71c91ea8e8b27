"""One prompt, generated on the batch engine with a batch of one (`engine/`).

    prefill      the prompt goes through the target (and the proposer); the target's last
                 logits give the first new token, `last`.
    round        the proposer guesses d_1..d_k; one target pass reads [last, d_1..d_k]
                 and scores k+1 positions; verification keeps n guesses and adds one
                 token of the target's; both caches roll back to what was kept.

The loop is the engine's (`engine.runner`, `engine.scheduler`): the same prefill, verify
pass, verification and rollback as a batch of many, one host sync per round. What is
particular to one prompt: the page pool holds that one sequence, so its pages lie in
order and the target's verify pass runs its compiled step where the model has one
(`TargetRunner.verify_pass`); the proposer is the one built for this generation, with its own
cache, compiled steps and fused graphs (`EachGuess`).
"""

from __future__ import annotations

from collections.abc import Iterator

from ..defaults import PAGE_SIZE
from ..model.cache import pages_for
from ..model.llama import Transformer
from ..spec.proposers import MTPProposer, Proposer
from ..spec.sampling import Sampling
from ..stats import Stats
from .forward import slab_for
from .pool import PagePool
from .proposers import EachGuess, MTPGuess
from .request import Request
from .runner import TargetRunner
from .scheduler import Emitted, Engine, round_ahead


def cache_pages(n_tokens: int, page_size: int = PAGE_SIZE) -> int:
    return pages_for(n_tokens, page_size) + 1


def engine_for_one(
    target: Transformer, proposer: Proposer, n_tokens: int, k: int, stop_token: int | None, page_size: int = PAGE_SIZE
) -> Engine:
    """An engine for one sequence of a prompt and new tokens, n_tokens positions in all.

    An MTP proposer set to grow token trees (`MTPProposer.tree`) runs in the engine's batched form,
    its module's cache in the pool beside the target's."""
    tree = proposer.tree if isinstance(proposer, MTPProposer) else None
    n_pages = cache_pages(n_tokens + round_ahead(k, tree), page_size)
    pool = PagePool(n_pages, page_size)
    t = TargetRunner(target, slab_for(target, n_pages * page_size, target.embed_tokens.weight.device), pool)
    if isinstance(proposer, MTPProposer) and tree is not None:
        proposer.release()  # its own cache is not used: the module's lives in the pool
        mtp = MTPGuess(target, proposer.mtp, pool, proposer.head)
        return Engine(t, mtp, k, auto_k=False, max_batch=1, eot=stop_token, tree=tree)
    given = [proposer]

    def once() -> Proposer:  # the proposer serves one sequence: a second start would be a bug
        if not given:
            raise RuntimeError("a one-prompt generation restarted its proposer")
        return given.pop()

    return Engine(t, EachGuess(once, proposer.name), k, auto_k=False, max_batch=1, eot=stop_token)


def stream(
    target: Transformer,
    proposer: Proposer,
    prompt: list[int],
    max_new_tokens: int,
    k: int,
    sampling: Sampling = Sampling(),
    stop_token: int | None = None,
    stats: Stats | None = None,
    page_size: int = PAGE_SIZE,
) -> Iterator[list[int]]:
    """Generate, yielding the tokens of each round as soon as they are verified.

    `stats` (if given) is updated in place, so it is valid even if the caller stops early
    (a stop string, say: see `stops`). The stop token ends generation and is not yielded.
    The proposer is released when the generation ends, however it ends.
    """
    if max_new_tokens < 1:
        proposer.release()
        return
    engine = engine_for_one(target, proposer, len(prompt) + max_new_tokens, k, stop_token, page_size)
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
) -> tuple[list[int], Stats]:
    """All new tokens at once, with their statistics."""
    stats = Stats(proposer.name, k)
    out: list[int] = []
    for chunk in stream(target, proposer, prompt, max_new_tokens, k, sampling, stop_token, stats):
        out.extend(chunk)
    return out, stats
