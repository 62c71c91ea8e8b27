"""A request being decoded: its tokens, its place in the target's cache, its own randomness."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..spec.verify import Warp
from ..stats import Stats
from .request import Request
from .stops import StopPrinter


@dataclass
class Seq:
    req: Request
    uid: int  # its key in the page pool and in the proposer's state
    gen: torch.Generator  # seeded by the request alone: its output does not depend on the batch
    warp: Warp | None  # None: greedy
    stats: Stats
    k: int  # draft tokens per round (greedy requests may get fewer under load: `scheduler.load_k`)
    tokens: list[int] = field(default_factory=list)  # prompt, then every token emitted
    last: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))  # [1]: not yet cached
    cached: int = 0  # positions of the target's cache in use: every token but `last`
    seen: torch.Tensor | None = None  # the penalty's context: bool [V], every token so far (None: no penalty)
    stops: StopPrinter | None = None  # the request's stop strings, watching the text as it grows
    submitted_s: float = field(default_factory=time.perf_counter)
    preempted: int = 0  # times its pages were taken back (recomputed at its next admission)
    # a conversation's: the target's states at its cached positions, to start its next request's proposer
    states: list[torch.Tensor] | None = None

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - len(self.req.prompt)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.req.prompt) :]
