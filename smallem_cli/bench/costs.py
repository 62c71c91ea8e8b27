"""The cost model's readings and the seed's cost model.

c (a proposer's cost per guess) and v (a verify pass over k+1 tokens) are read with a
stopwatch around the forwards, in one-token target passes, and fed with the conditional
acceptance α to the seed's model to predict a speed-up.

c is read on the path the run takes. The eager engine guesses one step at a time, so its c is
one step (`cost_step`). A native engine runs a round's guesses as one call (`spec.chain`: the
catch-up on what the last round confirmed, then the chain of k), with no Python round trip
between guesses, so a step timed alone costs more than a guess inside that call: its c(k) is
the call as `propose` makes it, over k, one reading per k the plan runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..engine.family import ProposerFactory
from ..engine.generate import cache_pages
from ..model.llama import Transformer
from ..spec.chain import chains
from ..spec.proposers import DraftProposer, MTPProposer, Proposer
from ..spec.verify import Warp
from ..stats import Stats

# proposer name -> (the warp its mode draws with, the ks whose native round is timed)
Chained = dict[str, tuple[Warp | None, list[int]]]


@dataclass
class Readings:
    """One reading of `forward_costs`.

    c: name -> one guess in one-token target passes: its step ("mode:proposer"), or a native
    round of k guesses over k ("mode:proposer:k"); v: k -> a pass over k+1 tokens in one-token
    passes; one_s: the seconds of a one-token pass; whole: the names whose every round runs the
    whole chain of k whatever depth it keeps (adaptive depth on a native chain: the doubtful
    guesses are dropped after the call).
    """

    c: dict[str, float]
    v: dict[int, float]
    one_s: float
    whole: list[str] = field(default_factory=list)


@dataclass
class Costs:
    """`readings` round-robin readings of `forward_costs`, per engine.

    c: "engine:mode:proposer" (a step) or "engine:mode:proposer:k" (a native round of k, over k)
    -> readings; v: "engine:T" -> readings of a pass over T tokens in one-token passes of the
    same engine; one_pass_s: engine -> seconds of a one-token pass; whole: the
    "engine:mode:proposer" whose rounds pay the whole chain at every depth (`Readings.whole`).
    """

    c: dict[str, list[float]]
    v: dict[str, list[float]]
    one_pass_s: dict[str, list[float]]
    whole: list[str] = field(default_factory=list)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _interleaved(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds of each fn over reps calls, taken round-robin (after two warm-up rounds).

    Round-robin, so that a shift in the machine's load touches every fn alike and their
    ratios (c and v are ratios) stay true on a shared, noisy machine.
    """
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


def chain_proposer(p: Proposer, warp: Warp | None) -> DraftProposer | MTPProposer | None:
    """The model proposer whose round a native engine may run as one call (`spec.chain`), or None
    where the run goes step by step whatever the engine (a lookup, token trees, sampling at
    adaptive depth). ngram+P: P's, for the rounds the lookup leaves to it."""
    inner = getattr(p, "other", p)
    if not isinstance(inner, DraftProposer | MTPProposer) or getattr(inner, "tree", None) is not None:
        return None
    return inner if chains(warp, inner.p_min) else None


def round_call(
    p: DraftProposer | MTPProposer, k: int, warp: Warp | None, gen: torch.Generator | None
) -> Callable[[], object]:
    """A round's k guesses as the run asks for them (`propose`: on a native engine one call, its
    catch-up included), then the proposer's cache back where it was, so that every call starts
    from the same state and the timing loop can repeat it."""
    cache, seq = p.cache, p.seq

    def run() -> object:
        n = cache.length(seq)
        out = p.propose(k, warp, gen)
        cache.keep(seq, n)
        p.proposed = False  # no round to accept: the pending entries stay pending
        return out

    return run


@torch.inference_mode()
def forward_costs(
    target: Transformer,
    proposers: dict[str, ProposerFactory],
    ks: list[int],
    prompt: list[int],
    context: int = 132,
    reps: int = 60,
    chained: Chained | None = None,
) -> Readings:
    """Stopwatch around the forwards, at a typical context length, with the engine switched on.

    Each proposer's step is timed; those in `chained` (a native engine) also have each of their
    rounds of k timed as `propose` runs it, from a state one round in (two entries to catch up on).
    """
    chained = chained or {}
    deepest = max([*ks, *(k for _, kk in chained.values() for k in kk)])
    dev = target.embed_tokens.weight.device
    ids = torch.tensor((prompt * (context // len(prompt) + 1))[:context], device=dev)
    cache = target.new_cache(cache_pages(context + max(ks) + 2))
    seq = cache.new_sequence()
    _, hidden = target(ids, cache, seq)

    def target_pass(t: int) -> Callable[[], object]:
        def run() -> object:
            out = target(ids[:t], cache, seq)
            cache.keep(seq, context)
            return out

        return run

    fns: dict[str, Callable[[], object]] = {"v1": target_pass(1)}
    fns |= {f"v{k + 1}": target_pass(k + 1) for k in ks if k + 1 != 1}
    per: dict[str, tuple[str, int]] = {}  # fn -> (c's name, the guesses it makes)
    whole: list[str] = []
    started: list[Proposer] = []
    for name, make in proposers.items():
        p = make(context + deepest + 4)
        p.start(ids, ids[-1:], hidden)
        p.propose(1, None, None)  # every cache filled up to the prompt
        p.accept(1, ids[-2:], hidden[-2:])
        fns[f"c:{name}"], per[f"c:{name}"] = p.cost_step, (name, 1)
        started.append(p)
        if name not in chained:
            continue
        warp, kk = chained[name]
        inner = chain_proposer(p, warp)
        if inner is None:
            continue
        gen = torch.Generator(device=dev).manual_seed(0)
        for k in kk:
            fns[f"c:{name}:{k}"], per[f"c:{name}:{k}"] = round_call(inner, k, warp, gen), (f"{name}:{k}", k)
        if inner is p and p.p_min:
            whole.append(name)
    t = _interleaved(fns, reps)
    one = t["v1"]
    v = {k: t[f"v{k + 1}"] / one for k in ks}
    c = {name: t[fn] / n / one for fn, (name, n) in per.items()}
    for p in started:
        p.release()
    cache.release(seq)
    return Readings(c, v, one, whole)


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


def variable_speedup(st: Stats, rounds: int, c: float, v: dict[int, float], whole: float | None = None) -> float:
    """The cost model for rounds of varying depth (an n-gram lookup, adaptive depth): the
    tokens a round yielded, measured, over a round's cost from the depths the rounds had,
    sum over m of (rounds with m guesses) * (m·c + v(m+1)) / rounds, v(1) = 1.

    `whole`: what every round's proposer costs whatever depth it kept (a native chain runs
    all k guesses, then drops the doubtful ones), in place of m·c."""
    if not rounds:
        return 1.0
    guesses = [m * c if whole is None else whole for m in range(len(st.guessed))]
    cost = sum(r * (guesses[m] + (v.get(m + 1, 1.0) if m else 1.0)) for m, r in enumerate(st.guessed)) / rounds
    return (1 + st.accepted / rounds) / cost
