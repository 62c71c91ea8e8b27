"""The cost model's readings and the seed's cost model.

c (a proposer's cost per guess) and v (a verify pass over k+1 tokens) are read with a
stopwatch on the path a generation takes: one sequence on the engine (`engine_for_one`'s
layout), its verify pass as `TargetRunner.verify_pass` runs it, with the round's host sync,
and its proposer's round of k guesses as `BatchProposer.propose` makes it (on a native
backend one call for the k: `proposers._ModelGuess._chain`), so c is read per k.

A run's round also pays host work that neither reading holds: verification's bookkeeping,
the scheduler's, the stats'. The bench measures it on the target alone, in the same run: its
round is one token's time, of which the verify pass over one token is `one_s`; the rest, `o`,
is added to every round's v (`round_costs`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .. import defaults as D
from ..backends.engines import Backend
from ..engine.build import assemble, batch_proposer
from ..engine.family import NONE, Proposer
from ..engine.pool import PagePool, pages_for
from ..engine.proposers import BatchProposer, FallbackGuess, NoGuess, _ModelGuess
from ..engine.request import Request
from ..engine.runner import prefill
from ..engine.sequence import Seq
from ..model.llama import Transformer
from ..spec.sampling import Sampling
from ..stats import Stats


@dataclass
class Readings:
    """One reading of `forward_costs`. c: "proposer:k" -> one guess of a round of k, in verify
    passes over one token; v: k -> a verify pass over k+1 tokens, in the same unit; one_s: the
    seconds of that unit."""

    c: dict[str, float]
    v: dict[int, float]
    one_s: float


@dataclass
class Costs:
    """`readings` round-robin readings of `forward_costs`, per engine. c: "engine:mode:proposer:k"
    -> readings; v: "engine:T" -> readings of a pass over T tokens; one_pass_s: engine -> seconds
    of a verify pass over one token."""

    c: dict[str, list[float]]
    v: dict[str, list[float]]
    one_pass_s: dict[str, list[float]]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _interleaved(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds of each fn over reps calls, taken round-robin (after two warm-up rounds), so
    that a shift in the machine's load touches every fn alike and their ratios stay true."""
    for _ in range(2):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


class _StartAll:
    """Every proposer being timed, started on the one prefill (`runner.prefill`)."""

    name = "none"

    def __init__(self, each: list[BatchProposer]) -> None:
        self.each = each

    def start(self, seqs: list[Seq], fed: list[torch.Tensor], hidden: list[torch.Tensor]) -> None:
        for p in self.each:
            p.start(seqs, fed, hidden)


def _round_call(bp: BatchProposer, s: Seq, k: int) -> Callable[[], object]:
    """A round's k guesses as the run asks for them, synced as the round syncs them, then the
    proposer's state put back, so that every call starts from the same state. ngram+P: P's
    round, what the rounds the lookup leaves to P cost (a lookup's own is next to nothing)."""
    model = bp.other if isinstance(bp, FallbackGuess) else bp

    def run() -> object:
        saved = replace(model.state[s.uid]) if isinstance(model, _ModelGuess) else None
        tokens, _ = model.propose([s], [k])[0]
        out = tokens.tolist()
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
) -> Readings:
    """Stopwatch around one sequence's passes at a typical context length: the target's verify
    pass over k+1 tokens for each k of `ks`, and each proposer's round of each of its ks
    (name -> (proposer, what its sequence draws with, its ks)), from a state one round in."""
    deepest = max([*ks, *(k for _, _, kk in proposers.values() for k in kk), 1])
    span = context + 2 * deepest + 4  # a sequence's positions, its proposer's chain included
    pool = PagePool((len(proposers) + 1) * pages_for(span, D.PAGE_SIZE), D.PAGE_SIZE)  # each one's pages in order
    engine = assemble(target, NONE, backend, pool, deepest, auto_k=False, max_batch=len(proposers) + 1, eot=None)
    t, dev = engine.t, engine.t.slab.device
    ids = (prompt * (context // len(prompt) + 1))[:context]
    started = {name: (batch_proposer(p, target, pool, backend), kk) for name, (p, _, kk) in proposers.items()}
    runs = []
    for name, (_, sampling, _) in proposers.items():  # a sequence per proposer: its own draws
        s = engine._seq(Request(len(runs), 0, tuple(ids), 1 << 20, sampling))
        pool.add(s.uid)
        pool.reserve(s.uid, span)
        runs.append((name, s))
    base = engine._seq(Request(len(runs), 0, tuple(ids), 1 << 20))
    pool.add(base.uid)
    pool.reserve(base.uid, span)
    for name, s in runs:
        bp, _ = started[name]
        prefill(t, _StartAll([bp]), [s])  # type: ignore[arg-type]
        bp.propose([s], [1])  # one round in: two entries to catch up on
        bp.accept(s, 1, torch.tensor(ids[-2:], device=dev), torch.zeros(2, target.cfg.dim, device=dev))
    prefill(t, NoGuess(), [base])
    feed = torch.tensor(ids[: deepest + 1], device=dev)

    def verify(T: int) -> Callable[[], object]:
        return lambda: t.verify_pass([base], feed[:T], [T])[0][-1:].argmax(-1).tolist()

    fns: dict[str, Callable[[], object]] = {f"v{k + 1}": verify(k + 1) for k in sorted({0, *ks})}
    for name, s in runs:
        bp, kk = started[name]
        fns |= {f"c:{name}:{k}": _round_call(bp, s, k) for k in kk}
    times = _interleaved(fns, reps)
    one = times["v1"]
    for name, s in [*runs, ("", base)]:
        if name:
            started[name][0].drop(s)
        pool.release(s.uid)
    c = {fn[2:]: x / int(fn.rsplit(":", 1)[1]) / one for fn, x in times.items() if fn.startswith("c:")}
    return Readings(c, {k: times[f"v{k + 1}"] / one for k in ks}, one)


def conditional_alpha(accepted_at: list[int], rounds: int) -> float:
    """The cost model's α: each guess kept with probability α once the ones before it were.

    accepted / proposed understates it for k > 1, since guesses after a rejection count as
    proposed but were never in play; here only the guesses that were reached count (the
    first of every round, the i-th when the i-1 before it were kept).
    """
    reached = rounds + sum(accepted_at[:-1])
    return sum(accepted_at) / reached if reached else 0.0


def predicted_speedup(alpha: float, k: int, c: float, v: float) -> float:
    """The seed's cost model: a round yields (1-α^(k+1))/(1-α) tokens for k·c + v passes."""
    tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + v)


def round_costs(c: float, v: float, one_s: float, round_s: float) -> tuple[float, float]:
    """c and v read in verify passes over one token (`one_s` seconds) -> in rounds of the target
    alone (`round_s` seconds, measured in the same run), v with the round's host work beside the
    pass (round_s - one_s) added: the cost model's units, where the target alone's round is 1."""
    scale = one_s / round_s
    return c * scale, 1 + (v - 1) * scale


def variable_speedup(st: Stats, rounds: int, c: dict[int, float], v: dict[int, float]) -> float:
    """The cost model for rounds of varying depth (an n-gram lookup): the tokens a round yielded,
    measured, over a round's cost from the depths the rounds had, sum over m of (rounds with m
    guesses) * (m·c(m) + v(m+1)) / rounds (v(1): a round without guesses)."""
    if not rounds:
        return 1.0
    cost = sum(r * (m * c.get(m, 0.0) + v.get(m + 1, 1.0)) for m, r in enumerate(st.guessed)) / rounds
    return (1 + st.accepted / rounds) / cost
