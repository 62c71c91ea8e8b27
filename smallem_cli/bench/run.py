"""Benchmark: the seed's protocol (8 prompts of 32 tokens, 200 new tokens each). Every row is timed in the same run as
the target alone, so speed-ups are ratios of measurements taken side by side on the same (noisy, shared) machine; the
seed's cost model (`predicted_speedup`, from the row's own runs: `run_costs`) says what the loop loses."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from itertools import zip_longest
from pathlib import Path

import torch
from rich.table import Table

from .. import atomic, defaults
from ..backends import engines
from ..backends.engines import Backend
from ..engine.build import build
from ..engine.config import EngineConfig
from ..engine.family import NONE, LoadedProposer
from ..engine.generate import generate
from ..engine.proposers import Draft, NoProposer
from ..engine.request import Request
from ..engine.round import decode_round
from ..engine.sequence import Seq
from ..engine.target import TargetRunner, prefill
from ..kv.pool import pages_for
from ..model.llama import Transformer
from ..model.tokenizer import load_tokenizer
from ..spec.sampling import Sampling
from ..stats import Stats
from ..train.data import read_documents


def write_prompts(val_txt: Path, tokenizer_json: Path, out: Path, count: int = 8, length: int = 32,
                  restate: int = 0) -> None:  # fmt: skip
    """COUNT prompts of LENGTH tokens: the openings of COUNT evenly spaced validation chunks (or of their
    LENGTH-token windows, if fewer), each then restating its first `restate` tokens on a new line."""
    tok = load_tokenizer(tokenizer_json)
    docs = [ids for d in read_documents(val_txt) if len(ids := tok.encode(d).ids) > length]
    if len(docs) < count:  # more prompts than chunks: successive windows of each chunk
        docs = [ids[i : i + length] for ids in docs for i in range(0, len(ids) - length + 1, length)]
    if len(docs) < count:
        raise ValueError(f"only {len(docs)} windows of {length} tokens in the validation text")
    step = len(docs) / count
    picked = [docs[int(i * step)][:length] for i in range(count)]
    if restate:  # on a line of its own
        picked = [ids + tok.encode("\n").ids + ids[:restate] for ids in picked]
    lines = [json.dumps({"tokens": ids, "text": tok.decode(ids)}) for ids in picked]
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic.replace_with(out, lambda tmp: tmp.write_text("\n".join(lines) + "\n", encoding="utf-8"))


@dataclass
class Row:
    proposer: str
    k: int
    mode: str  # "greedy" or "sample"
    tokens_per_s: float
    speedup: float  # over the target alone, same engine: median of run-by-run ratios, same mode, same run
    acceptance_rate: float
    tokens_per_pass: float
    accepted_at: list[float]  # rate at which the i-th draft token was accepted
    alpha_model: float  # α of the cost model: P(a draft token is accepted | the ones before it were)
    cost_c: float  # the proposer's seconds per draft token, in rounds of the target alone (same run)
    cost_v: float  # a round's other seconds (verification, bookkeeping), in rounds of the target alone
    predicted_speedup: float
    measured_over_predicted: float
    identical: str | None  # "8/8" for greedy rows: same tokens as the target alone (`run_bench` says which)
    runs: int
    tokens_per_s_runs: list[float] = field(default_factory=list)
    engine: str = "eager"
    vs_eager: float | None = None  # over the eager target alone (same mode, same run), when it ran


Gen = Callable[[int, list[int], int], tuple[list[int], Stats]]  # (prompt's index, prompt, n) -> (tokens, stats)


def round_robin(gens: dict[str, Gen], prompts: list[list[int]], max_new: int, repeats: int,
                progress: engines.Log | None = None) -> dict[str, list[tuple[Stats, list[list[int]]]]]:  # fmt: skip
    """Every gen warmed up, then on prompt 1, on prompt 2, ..., `repeats` times, so that a slow spell of a shared
    machine falls on all alike -> per gen, per run: (its stats summed over the prompts, its outputs)."""
    for gen in gens.values():
        gen(0, prompts[0][:16], 16)
    runs: dict[str, list[tuple[Stats, list[list[int]]]]] = {label: [] for label in gens}
    for rep in range(repeats):
        for got in runs.values():
            got.append((Stats("", 0), []))
        for i, prompt in enumerate(prompts):
            for label, gen in gens.items():
                if progress:
                    progress(f"{label}, prompt {i + 1}/{len(prompts)}, run {rep + 1}/{repeats}")
                out, st = gen(i, prompt, max_new)
                total, outs = runs[label][-1]
                outs.append(out)
                _add(total, st)
    return runs


def _add(total: Stats, st: Stats) -> None:
    for name in ("new_tokens", "passes", "proposed", "accepted", "elapsed_s", "propose_s", "round_s"):
        setattr(total, name, getattr(total, name) + getattr(st, name))
    for name in ("accepted_at", "rounds_by_drafted"):  # by depth (a fresh total has no depths yet)
        setattr(total, name, [a + b for a, b in zip_longest(getattr(total, name), getattr(st, name), fillvalue=0)])


def _summed(run: list[tuple[Stats, list[list[int]]]]) -> Stats:
    total = Stats("", 0)
    for st, _ in run:
        _add(total, st)
    return total


@dataclass
class Plan:
    proposers: dict[str, dict[str, LoadedProposer]]  # per mode: name -> proposer (heads may differ by mode)
    ks: dict[str, list[int]]  # k values per proposer
    modes: list[str]  # "greedy", "sample"
    max_new: int = defaults.MAX_NEW_TOKENS
    repeats: int = defaults.BENCH_REPEATS
    # without eager, the eager target alone still runs: the reference of identity and of `vs_eager`
    engines: tuple[str, ...] = ("eager",)
    sample: Sampling = field(default_factory=lambda: Sampling(defaults.BENCH_TEMPERATURE))  # the sample mode's draws
    backends: dict[str, Backend] = field(default_factory=dict)  # by engine, made by `prepare_engines`


def prepare_engines(target: Transformer, plan: Plan, log: engines.Log) -> None:
    """A backend for each engine of the plan and eager, its native steps ready before anything is timed."""
    models = [m for ps in plan.proposers.values() for p in ps.values() for m in p.models]
    int8 = [m for ps in plan.proposers.values() for p in ps.values() if p.int8 for m in p.models]
    dev = target.device
    for engine in dict.fromkeys(("eager", *plan.engines)):
        plan.backends.setdefault(engine, Backend(engines.engine_mode(engine, dev))).prepare(target, models, log, int8)


def our_row(rows: Iterable[Row], proposer: str, k: int) -> Row | None:
    """Our greedy row of (proposer, k) set beside a peer: the fastest engine's, a user's default."""
    found = {r.engine: r for r in rows if r.proposer == proposer and r.k == k and r.mode == "greedy"}
    return found[engines.fastest(found)] if found else None


def best_greedy(rows: list[Row], plan: Plan) -> tuple[str, LoadedProposer, int] | None:
    """The fastest greedy speculative row of the fastest engine, for a peer: (name, proposer, k) or None."""
    engine = engines.fastest(plan.engines)
    found = [r for r in rows if r.mode == "greedy" and r.k > 0 and r.engine == engine and "@" not in r.proposer]
    best = max(found, key=lambda r: r.tokens_per_s, default=None)
    return None if best is None else (best.proposer, plan.proposers["greedy"][best.proposer], best.k)


def _configs(plan: Plan, mode: str) -> list[tuple[str, str, LoadedProposer, int]]:  # engine, row name, proposer, k
    alone = [(e, "none", NONE, 0) for e in ["eager", *(e for e in plan.engines if e != "eager")]]
    return alone + [(e, n, f, k) for e in plan.engines for n, f in plan.proposers[mode].items() for k in plan.ks[n]]


def generations(plan: Plan, n_prompts: int) -> int:
    return sum(len(_configs(plan, m)) for m in plan.modes) * plan.repeats * n_prompts


def _gen(target: Transformer, p: LoadedProposer, k: int, draws: Sampling, backend: Backend) -> Gen:
    """Prompt number i drawn with seed + i: every configuration sees the same draws' seeds."""
    return lambda i, prompt, n: generate(target, p, prompt, n, k, replace(draws, seed=draws.seed + i), backend=backend)


def run_bench(target: Transformer, prompts: list[list[int]], plan: Plan,
              progress: engines.Log | None = None) -> list[Row]:  # fmt: skip
    """Every configuration of the plan, the target alone first, timed in the same run (`round_robin`)."""
    backends = {e: plan.backends.get(e) or Backend(e) for e in ("eager", *plan.engines)}
    rows: list[Row] = []
    for mode in plan.modes:
        draws = plan.sample if mode == "sample" else Sampling()
        configs = _configs(plan, mode)
        gens = {f"{mode} {e} {name} k={k}": _gen(target, p, k, draws, backends[e]) for e, name, p, k in configs}
        runs = list(round_robin(gens, prompts, plan.max_new, plan.repeats, progress).values())
        tps = [[st.tokens_per_s for st, _ in r] for r in runs]  # each configuration's, run by run
        base = {e: j for j, (e, n, _, _) in enumerate(configs) if n == "none"}  # 0: the eager one
        prefills = len(prompts) * plan.repeats  # passes that are no round
        for j, (engine, name, _, k) in enumerate(configs):
            st, alone = _summed(runs[j]), _summed(runs[base[engine]])
            rounds = st.passes - prefills
            alpha = conditional_alpha(st.accepted_at, rounds)
            cc, vv = run_costs(st, rounds, alone, alone.passes - prefills) if k else (0.0, 1.0)
            if sum(st.rounds_by_drafted[:k]):  # rounds of fewer draft tokens (a lookup): the tokens they measured
                pred = (1 + st.accepted / max(1, rounds)) / (st.proposed / max(1, rounds) * cc + vv)
            else:
                pred = predicted_speedup(alpha, k, cc, vv)
            # each run over the target alone's run of the same round: a slow spell spans both sides
            speed = statistics.median(a / b for a, b in zip(tps[j], tps[base[engine]], strict=True))
            vs_eager = statistics.median(a / b for a, b in zip(tps[j], tps[0], strict=True))
            # greedy tokens against the target alone's: of the same engine for a proposer's row (what speculation
            # guarantees), of the eager engine for an engine's own (unless it rounds its inputs: a quantized file)
            ref = base["eager"] if name == "none" else base[engine]
            outs, compared = runs[j][0][1], mode == "greedy" and (name != "none" or backends[engine].exact)
            same = sum(a == b for a, b in zip(outs, runs[ref][0][1], strict=True))
            identical = f"{same}/{len(outs)}" if compared else None
            per = [a / max(1, rounds) for a in st.accepted_at]
            rows.append(Row(
                name, k, mode, statistics.median(tps[j]), speed, st.acceptance_rate, st.tokens_per_pass, per,
                alpha, cc, vv, pred, speed / pred, identical, plan.repeats, tps[j], engine, vs_eager,
            ))  # fmt: skip
    return rows


def interleaved(fns: dict[int, Callable[[], object]], reps: int) -> dict[int, float]:
    """Median seconds of each fn over reps calls, taken round-robin (after two warm-up rounds), so
    that a shift in the machine's load touches every fn alike and their ratios stay true."""
    times: dict[int, list[float]] = {name: [] for name in fns}
    for r in range(reps + 2):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if r >= 2:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


class _Offer(NoProposer):
    """Offers the same draft tokens every round: the target's side of a round, whatever the proposer."""

    def __init__(self, drafts: torch.Tensor) -> None:
        self.drafts = drafts

    def propose(self, seqs: list[Seq], ks: list[int]) -> list[Draft]:
        return [(self.drafts, None) for _ in seqs]


def _target_round(t: TargetRunner, s: Seq, drafts: torch.Tensor, span: int) -> Callable[[], object]:
    """The target's side of a round offering `drafts`, then `s` put back as it was (length, last token, pages)."""
    offer = _Offer(drafts)

    def run() -> object:
        cached, last = s.cached, s.last
        got = decode_round(t, offer, [s])
        s.cached, s.last = cached, last
        t.pool.reserve(s.uid, span)
        return got

    return run


@torch.inference_mode()
def pass_costs(target: Transformer, ts: list[int], prompt: list[int], backend: Backend, context: int = 132,
               reps: int = 60) -> tuple[float, dict[int, float]]:  # fmt: skip
    """The seconds of the target's round of one token (the unit) at `context`, and of one over each T of `ts` in it."""
    span = context + max(ts) + 4
    engine = build(EngineConfig(target, NONE, backend, k=max(ts), pages=pages_for(span, defaults.PAGE_SIZE)))
    t, pool, dev = engine.t, engine.pool, engine.t.slab.device
    ids = (prompt * (context // len(prompt) + 1))[:context]
    s = engine.sequence(Request(0, 0, tuple(ids), 1 << 20, Sampling()))
    pool.add(s.uid)
    pool.reserve(s.uid, span)
    prefill(t, NoProposer(), [s])
    feed = torch.tensor(ids[1 : max(ts)], device=dev)  # draft tokens that tend to be rejected
    fns = {T: _target_round(t, s, feed[: T - 1], span) for T in sorted(set(ts) - {1})}
    # The unit is timed as the target alone runs: its rounds back to back, its weights kept in the
    # CPU's cache, before and after the rest (a shift of the machine's load in between touches both).
    alone = {1: _target_round(t, s, feed[:0], span)}
    before = interleaved(alone, reps)[1]
    times = interleaved(fns, reps)
    unit = (before + interleaved(alone, reps)[1]) / 2
    pool.release(s.uid)
    return unit, {T: times.get(T, unit) / unit for T in ts}


def conditional_alpha(accepted_at: list[int], rounds: int) -> float:
    """The cost model's α: each draft token accepted with probability α once the ones before it were. Only those
    reached count (the first of every round, the i-th when the i-1 before it were accepted), unlike accepted /
    proposed."""
    reached = rounds + sum(accepted_at[:-1])
    return sum(accepted_at) / reached if reached else 0.0


def predicted_speedup(alpha: float, k: int, c: float, v: float) -> float:
    """The seed's cost model: a round yields (1-α^(k+1))/(1-α) tokens for k·c + v passes."""
    tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + v)


def run_costs(st: Stats, rounds: int, alone: Stats, alone_rounds: int) -> tuple[float, float]:
    """c and v as a run spent them (`Stats.propose_s`, `round_s`), in rounds of the target alone's run
    beside it: c, the proposer's seconds per draft token; v, the rest of a round (its verification)."""
    unit = alone.round_s / max(1, alone_rounds)
    c = st.propose_s / st.proposed / unit if st.proposed else 0.0
    return c, (st.round_s - st.propose_s) / max(1, rounds) / unit


def right_table(title: str, cols: Iterable[str], left: str = "") -> Table:
    t = Table(title=title)
    for col in cols:
        t.add_column(col, justify="left" if col == left else "right")
    return t


def save_plot(lines: dict[str, list[tuple[float, float]]], path: Path, xlabel: str, ylabel: str, log2: bool) -> None:
    """A PNG of a line per label (matplotlib: the `plot` extra); x on a log2 scale, or a grey line at y = 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, pts in lines.items():
        ax.plot(*zip(*pts, strict=True), marker="o", label=label)
    if log2:
        ax.set_xscale("log", base=2)
    else:
        ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot(rows: list[Row], path: Path) -> None:
    lines: dict[str, list[tuple[float, float]]] = {}  # a line per proposer, mode and engine
    for r in sorted(rows, key=lambda r: (r.mode, r.engine, r.proposer, r.k)):
        if r.proposer != "none":
            lines.setdefault(f"{r.proposer} ({r.mode}, {r.engine})", []).append((r.k, r.speedup))
    save_plot(lines, path, "k (proposals per round)", "speed-up over the target alone", False)


def table(rows: list[Row], n_prompts: int, max_new: int, repeats: int, device: str, threads: int) -> Table:
    title = f"{n_prompts} prompts x {max_new} new tokens, median of {repeats} runs, {device}, {threads} threads"
    cols = ("mode", "engine", "proposer", "k", "tok/s", "speed-up", "vs eager", "α", "α model", "tok/pass")
    t = right_table(title, (*cols, "per position", "c", "v", "predicted", "meas/pred", "identical"))
    for r in rows:
        t.add_row(
            r.mode, r.engine, r.proposer, str(r.k), f"{r.tokens_per_s:.1f}", f"×{r.speedup:.2f}",
            "" if r.vs_eager is None else f"×{r.vs_eager:.2f}", f"{r.acceptance_rate:.3f}", f"{r.alpha_model:.3f}",
            f"{r.tokens_per_pass:.2f}", " ".join(f"{a:.2f}" for a in r.accepted_at), f"{r.cost_c:.3f}",
            f"{r.cost_v:.2f}", f"×{r.predicted_speedup:.2f}", f"{r.measured_over_predicted:.2f}", r.identical or "",
        )  # fmt: skip
    return t


def sweep_table(rows: list[Row]) -> Table:
    ks = sorted({r.k for r in rows if r.k})
    head = "mode / engine / proposer"
    t = right_table("k sweep: speed-up (acceptance)", [head, *(f"k={k}" for k in ks)], head)
    for mode, engine in dict.fromkeys((r.mode, r.engine) for r in rows):
        for name in dict.fromkeys(r.proposer for r in rows if r.proposer != "none"):
            mine = [r for r in rows if (r.mode, r.engine, r.proposer) == (mode, engine, name)]
            if cells := {r.k: f"×{r.speedup:.2f} ({r.acceptance_rate:.2f})" for r in mine}:
                t.add_row(f"{mode} {engine} {name}", *[cells.get(k, "") for k in ks])
    return t
