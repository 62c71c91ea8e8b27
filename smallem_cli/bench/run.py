"""Benchmark: the seed's protocol (8 prompts of 32 tokens, 200 new tokens each).

Every row is timed in the same run as the target alone, so speed-ups are ratios of measurements
taken side by side on the same (noisy, shared) machine. The proposer cost c and the verify cost v
are read on the path the run takes (`costs`), in rounds of the target alone, and fed with the
conditional acceptance α to the seed's cost model: measured / predicted tells what the loop loses.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from .. import atomic
from .. import defaults as D
from ..backends import engines
from ..backends.engines import Backend
from ..engine.family import NONE, Proposer
from ..engine.generate import generate
from ..model.llama import Transformer
from ..model.tokenizer import load_tokenizer
from ..spec.sampling import Sampling
from ..stats import Stats
from ..train.data import read_documents
from .costs import Costs, conditional_alpha, forward_costs, predicted_speedup, variable_speedup


def write_prompts(
    val_txt: Path, tokenizer_json: Path, out: Path, count: int = 8, length: int = 32, restate: int = 0
) -> None:
    """COUNT prompts of exactly LENGTH tokens: the openings of COUNT evenly spaced validation chunks (or
    of their LENGTH-token windows, if fewer), each followed, if `restate` > 0, by a newline and its first
    `restate` tokens again (where the n-gram proposer pays). One JSON line each (ids, text), written whole."""
    tok = load_tokenizer(tokenizer_json)
    docs = [ids for d in read_documents(val_txt) if len(ids := tok.encode(d).ids) > length]
    if len(docs) < count:  # more prompts than chunks: successive windows of each chunk
        docs = [ids[i : i + length] for ids in docs for i in range(0, len(ids) - length + 1, length)]
    if len(docs) < count:
        raise ValueError(f"only {len(docs)} windows of {length} tokens in the validation text")
    step = len(docs) / count
    lines = []
    for i in range(count):
        ids = docs[int(i * step)][:length]
        if restate:  # on a line of its own
            ids = ids + tok.encode("\n").ids + ids[:restate]
        lines.append(json.dumps({"tokens": ids, "text": tok.decode(ids)}))
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic.replace_with(out, lambda tmp: tmp.write_text("\n".join(lines) + "\n", encoding="utf-8"))


def read_prompts(path: Path) -> list[list[int]]:
    return [json.loads(line)["tokens"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# --- measurement ---------------------------------------------------------------------------
@dataclass
class Row:
    proposer: str
    k: int
    mode: str  # "greedy" or "sample"
    tokens_per_s: float
    speedup: float  # over the target alone, same engine: median of run-by-run ratios, same mode, same run
    acceptance_rate: float
    tokens_per_pass: float
    accepted_at: list[float]  # rate at which the i-th proposal was kept
    alpha_model: float  # α of the cost model: P(a guess is kept | the guesses before it were)
    cost_c: float  # proposer cost per proposed token, in rounds of the target alone
    cost_v: float  # a round's verify pass over k+1 tokens and its host work, in rounds of the target alone
    predicted_speedup: float
    measured_over_predicted: float
    identical: str | None  # "8/8" for greedy rows: same tokens as the eager target alone
    runs: int
    tokens_per_s_runs: list[float] = field(default_factory=list)
    engine: str = "eager"
    vs_eager: float | None = None  # over the eager target alone (same mode, same run), when it ran


def run_prompt(
    target: Transformer,
    p: Proposer,
    backend: Backend,
    prompt: list[int],
    i: int,
    max_new: int,
    k: int,
    sampling: Sampling,
) -> tuple[list[int], Stats]:
    """Prompt number i once; sampling seeded by (seed + i), so every configuration sees the same draws' seeds."""
    s = replace(sampling, seed=sampling.seed + i)  # every option kept, min-p and the penalty too
    return generate(target, p, prompt, max_new, k, s, backend=backend)


def add_stats(total: Stats, st: Stats) -> None:
    total.new_tokens += st.new_tokens
    total.passes += st.passes
    total.proposed += st.proposed
    total.accepted += st.accepted
    for j, r in enumerate(st.guessed):
        total.guessed[j] += r
    total.elapsed_s += st.elapsed_s
    for j, a in enumerate(st.accepted_at):
        total.accepted_at[j] += a


@dataclass
class Plan:
    proposers: dict[str, dict[str, Proposer]]  # per mode: name -> proposer (heads may differ by mode)
    ks: dict[str, list[int]]  # k values per proposer
    modes: list[str]  # "greedy", "sample"
    max_new: int = D.MAX_NEW_TOKENS
    repeats: int = D.BENCH_REPEATS
    temperature: float = D.BENCH_TEMPERATURE
    seed: int = 0
    # "eager", "native-avx2" and/or "native" (steps loaded beforehand, `prepare_engines`). Without eager,
    # the eager target alone still runs, as the reference of identity and of `vs_eager`.
    engines: tuple[str, ...] = ("eager",)
    # the sample mode's filters beside its temperature (None: off)
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    backends: dict[str, Backend] = field(default_factory=dict)  # by engine, made by `prepare_engines`


def plan_sampling(plan: Plan, mode: str) -> Sampling:
    """What the plan's `mode` ("greedy" or "sample") draws with."""
    if mode == "greedy":
        return Sampling(seed=plan.seed)
    return Sampling(plan.temperature, plan.top_k, plan.top_p, plan.seed, plan.min_p)


def cost_readings(
    target: Transformer, plan: Plan, prompt: list[int], readings: int, passes: list[int] | None = None
) -> Costs:
    """c and v alone (`bench --costs`): seconds of work, where the full bench takes minutes.
    `passes`: the token counts T whose v is read (default: 1 .. the plan's largest k + 1)."""
    top = max((k for ks in plan.ks.values() for k in ks), default=1)
    ks = sorted({T - 1 for T in passes} - {0}) if passes else list(range(1, top + 1))
    out = Costs({}, {}, {f"{e}:{m}": [] for e in plan.engines for m in plan.modes})
    for _ in range(readings):
        for engine in plan.engines:
            for m in plan.modes:  # each mode in rounds of its own target alone
                draws = plan_sampling(plan, m)
                each = {f"{m}:{n}": (p, draws, [k for k in plan.ks[n] if k]) for n, p in plan.proposers[m].items()}
                each = {name: x for name, x in each.items() if x[0] is not NONE}
                backend = plan.backends.get(engine) or Backend(engine)
                got = forward_costs(target, each, ks or [1], prompt, backend, sampling=draws)
                for name, x in got.c.items():
                    out.c.setdefault(f"{engine}:{name}", []).append(x)
                for k, x in got.v.items():
                    out.v.setdefault(f"{engine}:{m}:{k + 1}", []).append(x)
                out.round_s[f"{engine}:{m}"].append(got.round_s)
    return out


def prepare_engines(target: Transformer, plan: Plan, log: engines.Log) -> None:
    """A backend for each engine of the plan (and eager, the reference), its native steps built
    (or loaded) for the target and every proposer before anything is timed."""
    models = [m for ps in plan.proposers.values() for p in ps.values() for m in p.models]
    int8 = [m for ps in plan.proposers.values() for p in ps.values() if p.int8 for m in p.models]
    dev = target.embed_tokens.weight.device
    for engine in dict.fromkeys(("eager", *plan.engines)):
        plan.backends.setdefault(engine, Backend(engines.engine_mode(engine, dev))).prepare(target, models, log, int8)


def our_row(rows: Iterable[Row], proposer: str, k: int, mode: str = "greedy") -> Row | None:
    """Our row of (proposer, k, mode) that a peer's table sets beside the peer: the one of the
    fastest engine the run has (`engines.fastest`), the one a user gets by default; None: no such row."""
    found = {r.engine: r for r in rows if r.proposer == proposer and r.k == k and r.mode == mode}
    return found[engines.fastest(found)] if found else None


def best_greedy(rows: list[Row], plan: Plan) -> tuple[str, Proposer, int] | None:
    """The fastest greedy speculative row of a run, of its fastest engine: (name, proposer, k),
    for a peer to be timed against (None if the run had none)."""
    engine = engines.fastest(plan.engines)
    found = [r for r in rows if r.mode == "greedy" and r.k > 0 and r.engine == engine and "@" not in r.proposer]
    if not found or "greedy" not in plan.proposers:
        return None
    best = max(found, key=lambda r: r.tokens_per_s)
    make = plan.proposers["greedy"].get(best.proposer)
    return (best.proposer, make, best.k) if make is not None else None


Config = tuple[str, str, Proposer, int]  # engine, row name, proposer, k


def _configs(plan: Plan, mode: str) -> list[Config]:
    alone: list[Config] = [(e, "none", NONE, 0) for e in ["eager", *(e for e in plan.engines if e != "eager")]]
    return alone + [(e, n, f, k) for e in plan.engines for n, f in plan.proposers[mode].items() for k in plan.ks[n]]


def generations(plan: Plan, n_prompts: int) -> int:
    """Timed generations of a run (for a progress bar)."""
    return sum(len(_configs(plan, m)) for m in plan.modes) * plan.repeats * n_prompts


def run_bench(
    target: Transformer, prompts: list[list[int]], plan: Plan, progress: Callable[[str], None] | None = None
) -> list[Row]:
    """Every configuration of the plan, the target alone first, timed in the same run, round-robin
    prompt by prompt (every configuration on prompt 1, then on prompt 2, ...), so that a slow spell of
    a shared machine (seconds long) falls on all configurations alike rather than on one."""
    costs = cost_readings(target, plan, prompts[0], 1)
    c = {name: xs[0] for name, xs in costs.c.items()}
    v = {name: xs[0] for name, xs in costs.v.items()}
    backends = {e: plan.backends.get(e) or Backend(e) for e in ("eager", *plan.engines)}
    rows: list[Row] = []
    for mode in plan.modes:
        draws = plan_sampling(plan, mode)
        configs = _configs(plan, mode)
        for engine, _, p, k in configs:
            generate(target, p, prompts[0][:16], 16, k, draws, backend=backends[engine])  # warm-up
        # all_runs[j][r]: configuration j's tokens/s, stats and outputs over all prompts, in timed run r
        all_runs: list[list[tuple[float, Stats, list[list[int]]]]] = [[] for _ in configs]
        for rep in range(plan.repeats):
            totals = [Stats(name, k, accepted_at=[0] * k, guessed=[0] * (k + 1)) for _, name, _, k in configs]
            texts: list[list[list[int]]] = [[] for _ in configs]
            for i, prompt in enumerate(prompts):
                for j, (engine, name, p, k) in enumerate(configs):
                    if progress:
                        label = f"{mode} {engine} {name} k={k}, prompt {i + 1}/{len(prompts)}, run {rep + 1}"
                        progress(f"{label}/{plan.repeats}")
                    out, st = run_prompt(target, p, backends[engine], prompt, i, plan.max_new, k, draws)
                    texts[j].append(out)
                    add_stats(totals[j], st)
            for j, total in enumerate(totals):
                all_runs[j].append((total.new_tokens / total.elapsed_s, total, texts[j]))
        eager_runs, eager_outs = [r[0] for r in all_runs[0]], all_runs[0][0][2]  # the eager target alone
        base = {e: [r[0] for r in all_runs[j]] for j, (e, n, _, _) in enumerate(configs) if n == "none"}
        for (engine, name, _, k), runs in zip(configs, all_runs, strict=True):
            tps_runs = [r[0] for r in runs]
            _, st, outs = runs[0]
            rounds = st.passes - len(prompts)  # prefill passes excluded
            alpha = conditional_alpha(st.accepted_at, rounds)
            # in rounds of this engine's target alone (`costs.forward_costs`); a row of the target
            # alone costs one round, read or not (eager's reference has none outside the plan)
            cc = c.get(f"{engine}:{mode}:{name}:{k}", 0.0)
            vv = v.get(f"{engine}:{mode}:{k + 1}", 1.0) if k else 1.0
            if sum(st.guessed[:k]):  # rounds of fewer guesses: the model over the rounds as they came
                vs = {T: v.get(f"{engine}:{mode}:{T}", 1.0) for T in range(2, k + 2)}
                pred = variable_speedup(st, rounds, dict.fromkeys(range(1, k + 1), cc), vs)
            else:
                pred = predicted_speedup(alpha, k, cc, vv)
            # Each timed run against the target alone's run of the same round, then the
            # median: a slow spell of the machine spans both sides of a ratio.
            speed = statistics.median(a / b for a, b in zip(tps_runs, base[engine], strict=True))
            vs_eager = statistics.median(a / b for a, b in zip(tps_runs, eager_runs, strict=True))
            identical = None
            if mode == "greedy":
                same = sum(a == b for a, b in zip(outs, eager_outs, strict=True))
                identical = f"{same}/{len(outs)}"
            per = [a / max(1, rounds) for a in st.accepted_at]
            rows.append(Row(
                name, k, mode, statistics.median(tps_runs), speed, st.acceptance_rate, st.tokens_per_pass, per,
                alpha, cc, vv, pred, speed / pred, identical, plan.repeats, tps_runs, engine, vs_eager,
            ))  # fmt: skip
    return rows
