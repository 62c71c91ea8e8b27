"""One prompt, generated on the engine with a batch of one: a pool of one sequence hands its pages
out in order, so its passes take the fast paths (`TargetRunner.one_pass`, `_ModelGuess._chain`)."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator

from ..backends.engines import Backend
from ..defaults import PAGE_SIZE
from ..model.llama import Transformer
from ..spec.sampling import Sampling
from ..stats import Stats
from .build import assemble, cache_budget, pool_pages, sequence_bytes
from .family import Proposer
from .pool import PagePool, pages_for
from .request import Request
from .scheduler import Emitted, Engine, round_ahead

FIRST_CHAT_POSITIONS = 1024  # a conversation's cache at first: it doubles as the conversation outgrows it


def engine_for_chat(
    target: Transformer, proposer: Proposer, k: int, end_ids: Collection[int], backend: Backend | None = None
) -> tuple[Engine, int]:
    """An engine for one conversation, its cache grown up to the context or the memory -> (it, the context)."""
    context = target.cfg.max_seq_len
    per_sequence = sequence_bytes([target, *proposer.models], context, PAGE_SIZE, proposer.tree)
    context = min(context, context * cache_budget(target.embed_tokens.weight.device) // per_sequence)
    pool = PagePool(pool_pages(1, min(context, FIRST_CHAT_POSITIONS), PAGE_SIZE, proposer.tree), PAGE_SIZE)
    max_pages = pool_pages(1, context, PAGE_SIZE, proposer.tree)
    engine = assemble(
        target, proposer, backend or Backend(), pool, k, auto_k=False, max_batch=1, end_ids=end_ids, max_pages=max_pages
    )
    return engine, context


def stream(
    target: Transformer,
    proposer: Proposer,
    prompt: list[int],
    max_new_tokens: int,
    k: int,
    sampling: Sampling = Sampling(),
    end_ids: Collection[int] = (),
    stats: Stats | None = None,
    backend: Backend | None = None,
) -> Iterator[list[int]]:
    """Each round's tokens as soon as verified; `stats` updated in place, valid even if the caller stops early."""
    if max_new_tokens < 1:
        return
    pool = PagePool(pages_for(len(prompt) + max_new_tokens + round_ahead(k, proposer.tree), PAGE_SIZE) + 1, PAGE_SIZE)
    engine = assemble(target, proposer, backend or Backend(), pool, k, auto_k=False, max_batch=1, end_ids=end_ids)
    yield from answer(engine, Request(0, 0, tuple(prompt), max_new_tokens, sampling), stats)


def answer(engine: Engine, request: Request, stats: Stats | None = None) -> Iterator[list[int]]:
    """`stream` on `engine`. Closed early, between rounds, a conversation's request keeps its cache."""
    with contextlib.closing(engine.events([request])) as events:
        for event in events:
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
    end_ids: Collection[int] = (),
    backend: Backend | None = None,
) -> tuple[list[int], Stats]:
    stats = Stats(proposer.name, k)
    chunks = stream(target, proposer, prompt, max_new_tokens, k, sampling, end_ids, stats, backend)
    return [t for chunk in chunks for t in chunk], stats
