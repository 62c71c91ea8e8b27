"""The seed's cost model and its readings: c (a proposer's cost per guess) and v (a round's target
side over k+1 tokens), in rounds of the target alone. A bench row reads them from its own runs
(`run_costs`); `forward_costs` times them alone, round-robin, for `bench --costs` and the peers."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .. import defaults as D
from ..backends.engines import Backend
from ..engine.build import assemble, batch_proposer
from ..engine.family import NONE, Proposer
from ..engine.pool import PagePool, pages_for
from ..engine.proposers import BatchProposer, FallbackGuess, NoGuess, _ModelGuess
from ..engine.request import Request
from ..engine.runner import TargetRunner, decode_round, prefill
from ..engine.sequence import Seq
from ..model.llama import Transformer
from ..spec.sampling import Sampling
from ..stats import Stats


@dataclass
class Readings:
    """One reading of `forward_costs`, in rounds of the target alone (`round_s` seconds each). c:
    "proposer:k" -> one guess of a round of k; v: k -> the target's side of a round of k guesses."""

    c: dict[str, float]
    v: dict[int, float]
    round_s: float


@dataclass
class Costs:
    """Round-robin readings of `forward_costs`: c by "engine:mode:proposer:k", v by "engine:mode:T"
    (T = k+1 tokens verified), round_s by "engine:mode" (seconds of a round of the target alone)."""

    c: dict[str, list[float]]
    v: dict[str, list[float]]
    round_s: dict[str, list[float]]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _interleaved(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds of each fn over reps calls, taken round-robin (after two warm-up rounds), so
    that a shift in the machine's load touches every fn alike and their ratios stay true."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(reps + 2):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync()
            if r >= 2:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


class _Offer(NoGuess):
    """Offers the same guesses every round: the target's side of a round, whatever the proposer
    (a sampled round's guesses as point masses, as the n-gram lookup's are)."""

    def __init__(self, guesses: torch.Tensor, vocab_size: int, sampled: bool) -> None:
        self.guesses = guesses
        self.q = F.one_hot(guesses, vocab_size).float() if sampled else None

    def propose(self, seqs: list[Seq], ks: list[int]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        return [(self.guesses, self.q) for _ in seqs]


def _target_round(t: TargetRunner, s: Seq, guesses: torch.Tensor, span: int) -> Callable[[], object]:
    """The target's side of a round offering `guesses`, then `s` put back: its length, its last
    token, its pages (given back in order, taken again in the same order)."""
    offer = _Offer(guesses, t.model.cfg.vocab_size, s.warp is not None)

    def run() -> object:
        cached, last = s.cached, s.last
        got = decode_round(t, offer, [s])
        s.cached, s.last = cached, last
        t.pool.reserve(s.uid, span)
        return got

    return run


def _round_call(bp: BatchProposer, s: Seq, k: int) -> Callable[[], object]:
    """A round's k guesses as the run asks for them, synced as the round syncs them, then the state put
    back for the next call. ngram+P: P's round (a lookup's own costs next to nothing)."""
    model = bp.other if isinstance(bp, FallbackGuess) else bp

    def run() -> object:
        saved = replace(model.state[s.uid]) if isinstance(model, _ModelGuess) else None
        out = model.propose([s], [k])[0][0].tolist()
        if saved is not None:
            model.state[s.uid] = saved
        return out

    return run


@torch.inference_mode()
def forward_costs(
    target: Transformer,
    proposers: dict[str, tuple[Proposer, Sampling, list[int]]],
    ks: list[int],
    prompt: list[int],
    backend: Backend,
    context: int = 132,
    reps: int = 60,
    sampling: Sampling = Sampling(),
) -> Readings:
    """Stopwatch around one sequence's rounds at a typical context length, from a state one round in:
    the target's side of a round of k guesses for each k of `ks`, drawing with `sampling`, and each
    proposer's round of each of its ks (name -> (proposer, what its sequence draws with, its ks))."""
    deepest = max([*ks, *(k for _, _, kk in proposers.values() for k in kk), 1])
    span = context + 2 * deepest + 4  # a sequence's positions, its proposer's chain included
    pool = PagePool((len(proposers) + 1) * pages_for(span, D.PAGE_SIZE), D.PAGE_SIZE)  # each one's pages in order
    engine = assemble(target, NONE, backend, pool, deepest, auto_k=False, max_batch=len(proposers) + 1)
    t, dev = engine.t, engine.t.slab.device
    ids = (prompt * (context // len(prompt) + 1))[:context]
    runs: list[tuple[str, BatchProposer, Seq, list[int]]] = []  # the target alone's last
    for name, (p, draws, kk) in [*proposers.items(), ("", (NONE, sampling, []))]:
        s = engine._seq(Request(len(runs), 0, tuple(ids), 1 << 20, draws))
        pool.add(s.uid)
        pool.reserve(s.uid, span)
        runs.append((name, batch_proposer(p, target, pool, backend) if name else NoGuess(), s, kk))
    for name, bp, s, _ in runs:
        prefill(t, bp, [s])
        if name:
            bp.propose([s], [1])  # one round in: two entries to catch up on
            bp.accept(s, 1, torch.tensor(ids[-2:], device=dev), torch.zeros(2, target.cfg.dim, device=dev))
    feed = torch.tensor(ids[1 : deepest + 1], device=dev)  # guesses that tend to be rejected
    fns = {f"v{k + 1}": _target_round(t, runs[-1][2], feed[:k], span) for k in sorted(set(ks) - {0})}
    fns |= {f"c:{name}:{k}": _round_call(bp, s, k) for name, bp, s, kk in runs for k in kk}
    # The unit is timed as the target alone runs: its rounds back to back, its weights kept in the
    # CPU's cache (interleaved with the proposers', its one-token round read up to 1.5x slower),
    # before and after the rest (a shift of the machine's load in between touches both).
    alone = {"v1": _target_round(t, runs[-1][2], feed[:0], span)}
    before = _interleaved(alone, reps)["v1"]
    times = _interleaved(fns, reps)
    unit = (before + _interleaved(alone, reps)["v1"]) / 2
    for _, bp, s, _ in runs:
        bp.drop(s)
        pool.release(s.uid)
    c = {fn[2:]: x / int(fn.rsplit(":", 1)[1]) / unit for fn, x in times.items() if fn.startswith("c:")}
    return Readings(c, {k: times[f"v{k + 1}"] / unit for k in ks}, unit)


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
