"""An EAGLE head's default k, from this machine's costs (measured when the engine is built) and the head's acceptance.

A round of k draft tokens costs k c + v(k + 1) one-token target passes (c: one draft step; v(T): a verification pass
over T tokens) and yields 1 + a_1 + a_1 a_2 + ... + a_1..a_k tokens, a_j the acceptance of the j-th draft token once
those before it are accepted (the head's measured agreement at each depth, the last one's beyond). The k that yields
the most tokens per unit of cost is the default."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from .proposers import MTPProposer
from .target import TargetRunner

PAST = 64  # positions before the timed passes: a round's typical past
REPEATS = 5


def tokens_per_round(accept: Sequence[float], k: int) -> float:
    out, run = 1.0, 1.0
    for j in range(k):
        run *= accept[min(j, len(accept) - 1)]
        out += run
    return out


def best_k(accept: Sequence[float], c: float, v: Sequence[float]) -> int:
    """The k in 1 .. len(v) - 2 of the most tokens per cost; v[T] the T-token pass's cost (v[1] = 1), c a draft
    step's."""
    return max(range(1, len(v) - 1), key=lambda k: tokens_per_round(accept, k) / (k * c + v[k + 1]))


def _least(runs: list[Callable[[], object]]) -> list[float]:
    """Each run's least time over REPEATS rounds, the runs interleaved in each round after one warm-up of all:
    a burst of load elsewhere then slows every run alike, not one of them."""
    for run in runs:
        run()
    best = [float("inf")] * len(runs)
    for _ in range(REPEATS):
        for i, run in enumerate(runs):
            t0 = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def measure(target: TargetRunner, head: MTPProposer, k_max: int) -> tuple[list[float], float] | None:
    """(v [k_max + 2]: v[T] a T-token target pass over a past of PAST, in one-token passes (v[0] unused; never less
    than v[T - 1]), c: a draft step of `head`'s chain, likewise), timed on the native steps over the pool's first
    slots; None where the pool is too small for it."""
    steps, chain = target.steps, head.steps
    assert steps is not None and chain is not None
    if target.slab.shape[3] < PAST + k_max + 2:
        return None
    past = target.slab[:, :, :, :PAST]  # free pages: what the passes write there is written over before it is read
    ids = torch.ones(k_max + 2, dtype=torch.long)
    fed = (ids[:1], torch.zeros(1, head.mtp.cfg.dim))
    view = head.slab[:, :, :, : PAST + k_max + 1]
    runs: list[Callable[[], object]] = [lambda T=T: steps.step(ids[:T], past, T) for T in range(1, k_max + 2)]
    runs += [lambda k=k: chain.chain(head.head.ids, k, view, PAST, fed) for k in (1, k_max)]
    *passes, one, more = _least(runs)
    v = [0.0]
    for t in passes:
        v.append(max(t / passes[0], v[-1]))
    return v, max(more - one, 0.0) / (k_max - 1) / passes[0]
