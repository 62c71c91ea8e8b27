"""The seed's cost model and its readings: c (a proposer's cost per guess) and v (a round's target
side over k+1 tokens), in rounds of the target alone. A bench row reads them from its own runs
(`run_costs`); `pass_costs` times the target's side alone, set beside a peer's passes."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from .. import defaults as D
from ..backends.engines import Backend
from ..engine.build import assemble
from ..engine.family import NONE
from ..engine.pool import PagePool, pages_for
from ..engine.proposers import NoGuess
from ..engine.request import Request
from ..engine.runner import TargetRunner, decode_round, prefill
from ..engine.sequence import Seq
from ..model.llama import Transformer
from ..spec.sampling import Sampling
from ..stats import Stats


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _interleaved(fns: dict[int, Callable[[], object]], reps: int) -> dict[int, float]:
    """Median seconds of each fn over reps calls, taken round-robin (after two warm-up rounds), so
    that a shift in the machine's load touches every fn alike and their ratios stay true."""
    times: dict[int, list[float]] = {name: [] for name in fns}
    for r in range(reps + 2):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync()
            if r >= 2:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


class _Offer(NoGuess):
    """Offers the same guesses every round: the target's side of a round, whatever the proposer."""

    def __init__(self, guesses: torch.Tensor) -> None:
        self.guesses = guesses

    def propose(self, seqs: list[Seq], ks: list[int]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        return [(self.guesses, None) for _ in seqs]


def _target_round(t: TargetRunner, s: Seq, guesses: torch.Tensor, span: int) -> Callable[[], object]:
    """The target's side of a round offering `guesses`, then `s` put back as it was (length, last token, pages)."""
    offer = _Offer(guesses)

    def run() -> object:
        cached, last = s.cached, s.last
        got = decode_round(t, offer, [s])
        s.cached, s.last = cached, last
        t.pool.reserve(s.uid, span)
        return got

    return run


@torch.inference_mode()
def pass_costs(
    target: Transformer, ts: list[int], prompt: list[int], backend: Backend, context: int = 132, reps: int = 60
) -> tuple[float, dict[int, float]]:
    """The seconds of the target's round of one token (the unit) at `context`, and of one over each T of `ts` in it."""
    span = context + max(ts) + 4
    pool = PagePool(pages_for(span, D.PAGE_SIZE), D.PAGE_SIZE)
    engine = assemble(target, NONE, backend, pool, max(ts), auto_k=False, max_batch=1)
    t, dev = engine.t, engine.t.slab.device
    ids = (prompt * (context // len(prompt) + 1))[:context]
    s = engine._seq(Request(0, 0, tuple(ids), 1 << 20, Sampling()))
    pool.add(s.uid)
    pool.reserve(s.uid, span)
    prefill(t, NoGuess(), [s])
    feed = torch.tensor(ids[1 : max(ts)], device=dev)  # guesses that tend to be rejected
    fns = {T: _target_round(t, s, feed[: T - 1], span) for T in sorted(set(ts) - {1})}
    # The unit is timed as the target alone runs: its rounds back to back, its weights kept in the
    # CPU's cache, before and after the rest (a shift of the machine's load in between touches both).
    alone = {1: _target_round(t, s, feed[:0], span)}
    before = _interleaved(alone, reps)[1]
    times = _interleaved(fns, reps)
    unit = (before + _interleaved(alone, reps)[1]) / 2
    pool.release(s.uid)
    return unit, {T: times.get(T, unit) / unit for T in ts}


def conditional_alpha(accepted_at: list[int], rounds: int) -> float:
    """The cost model's α: each guess kept with probability α once the ones before it were. Only the
    guesses reached count (the first of every round, the i-th when the i-1 before it were kept):
    accepted / proposed would understate it for k > 1, counting guesses never in play."""
    reached = rounds + sum(accepted_at[:-1])
    return sum(accepted_at) / reached if reached else 0.0


def predicted_speedup(alpha: float, k: int, c: float, v: float) -> float:
    """The seed's cost model: a round yields (1-α^(k+1))/(1-α) tokens for k·c + v passes."""
    tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + v)


def run_costs(st: Stats, rounds: int, alone: Stats, alone_rounds: int) -> tuple[float, float]:
    """c and v as a run spent them (`Stats.propose_s`, `round_s`), in rounds of the target alone's run
    beside it: c, the proposer's seconds per guess; v, the rest of a round (its verification)."""
    unit = alone.round_s / max(1, alone_rounds)
    c = st.propose_s / st.proposed / unit if st.proposed else 0.0
    return c, (st.round_s - st.propose_s) / max(1, rounds) / unit
