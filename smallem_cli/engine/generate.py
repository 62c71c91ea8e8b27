"""One prompt, generated on the engine with a batch of one: a pool of one sequence hands its pages
out in order, so its passes take the fast paths (`TargetRunner.one_pass`, `ModelProposer._chain`)."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator

from ..backends.engines import Backend
from ..model.llama import Transformer
from ..spec.sampling import Sampling
from ..stats import Stats
from .build import build
from .config import EngineConfig
from .family import LoadedProposer
from .request import Request
from .scheduler import Emitted, Engine


def answer(engine: Engine, request: Request, stats: Stats | None = None) -> Iterator[list[int]]:
    """Each round's tokens of `request` on `engine` as soon as verified; `stats` updated in place, valid even if the
    caller stops early. Closed early, between rounds, a conversation's request keeps its cache."""
    with contextlib.closing(engine.events([request])) as events:
        for event in events:
            if isinstance(event, Emitted):
                if stats is not None:
                    stats.copy_from(event.stats)
                if event.tokens:
                    yield event.tokens


def generate(
    target: Transformer, proposer: LoadedProposer, prompt: list[int], max_new_tokens: int, k: int,
    sampling: Sampling = Sampling(), end_ids: Collection[int] = (), backend: Backend | None = None,
) -> tuple[list[int], Stats]:  # fmt: skip
    """One prompt on an engine of its own, a batch of one -> its tokens and statistics."""
    stats = Stats(proposer.name, k)
    if max_new_tokens < 1:
        return [], stats
    engine = build(EngineConfig(target, proposer, backend or Backend(), k=k, end_ids=end_ids))
    chunks = answer(engine, Request(0, 0, tuple(prompt), max_new_tokens, sampling), stats)
    return [t for chunk in chunks for t in chunk], stats
