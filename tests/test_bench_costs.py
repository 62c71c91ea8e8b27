"""The cost model's readings on the path the run takes, its arithmetic, and which of our rows a
peer is set against (timings themselves are never asserted: the clock here is a fake one that
charges for the work each timed call did, or the readings' sanity alone)."""

from __future__ import annotations

import itertools
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Family

from smallem_cli.backends import native
from smallem_cli.backends.engines import Backend
from smallem_cli.bench import costs
from smallem_cli.bench import run as bench
from smallem_cli.engine import family as fam
from smallem_cli.engine import proposers as P
from smallem_cli.engine.family import NONE
from smallem_cli.engine.generate import generate
from smallem_cli.engine.runner import TargetRunner
from smallem_cli.spec.sampling import Sampling
from smallem_cli.stats import Stats

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
DEV = torch.device("cpu")
no_native = shutil.which("g++") is None or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512")
ENGINES = ["eager", pytest.param("native", marks=pytest.mark.skipif(no_native, reason="needs g++ and an AVX2 CPU"))]


def _loaded(family: Family, names: list[str], engine: str) -> tuple[fam.Target, dict[str, fam.Proposer], Backend]:
    """The family's target, these proposers, and a backend `engine` prepared for them all."""
    target = fam.load_target(family.target, DEV)
    ps = {n: fam.load_proposer(n, target, DEV, 0) for n in names}
    b = Backend(engine)
    log: list[str] = []
    label = b.prepare(target.model, [m for p in ps.values() for m in p.models], log.append)
    assert label == engine, log  # every model runs on the engine named: the readings are its own
    return target, ps, b


# --- forward_costs: what is timed ------------------------------------------------------------------
# A fake clock: a verify pass over T tokens takes 10 ms + 1 ms a token, a proposer model's pass
# (eager) 2 ms, a native chain of k guesses in one call 1 ms + 1 ms a guess.
def _charge(work: list[tuple[str, int]]) -> float:
    kinds = {w for w, _ in work}
    if kinds == {"verify"}:
        assert len(work) == 1, work  # one verify pass per reading of v
        return 0.010 + 0.001 * work[0][1]
    if kinds == {"chain"}:
        assert len(work) == 1, work  # a native round: one call for its k guesses
        return 0.001 + 0.001 * work[0][1]
    assert kinds <= {"pass"}, work
    return 0.002 * len(work)


def _spy_work(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every target verify pass (its tokens), proposer model pass and native chain (its k) made."""
    work: list[tuple[str, int]] = []
    verify, t_pass, m_pass, chain = TargetRunner.verify_pass, P.transformer_pass, P.mtp_pass, native.NativeSteps.chain

    def spy_verify(self: TargetRunner, seqs: list, ids: torch.Tensor, counts: list[int]) -> Any:
        work.append(("verify", int(ids.shape[0])))
        return verify(self, seqs, ids, counts)

    def spy_pass(real: Callable[..., Any]) -> Callable[..., Any]:
        def spied(*a: Any, **kw: Any) -> Any:
            work.append(("pass", 1))
            return real(*a, **kw)

        return spied

    def spy_chain(self: native.NativeSteps, ids: Any, k: int, *a: Any, **kw: Any) -> Any:
        work.append(("chain", k))
        return chain(self, ids, k, *a, **kw)

    monkeypatch.setattr(TargetRunner, "verify_pass", spy_verify)
    monkeypatch.setattr(P, "transformer_pass", spy_pass(t_pass))
    monkeypatch.setattr(P, "mtp_pass", spy_pass(m_pass))
    monkeypatch.setattr(native.NativeSteps, "chain", spy_chain)
    return work


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("proposer", ["draft-2l", "mtp", "ngram+mtp"])
def test_c_is_read_per_k_on_the_round_and_v_on_the_target_round(
    family: Family, monkeypatch: pytest.MonkeyPatch, engine: str, proposer: str
) -> None:
    """c(k): one round of k guesses as the run asks for it (eager: a pass per guess; native: one
    call for the k; ngram+P: P's round), over k, in rounds of the target alone; v(k): the target's
    side of a round of k guesses (one verify pass over k+1 tokens) in the same unit; round_s: that
    unit's seconds."""
    target, ps, b = _loaded(family, [proposer], engine)
    work = _spy_work(monkeypatch)

    def interleaved(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
        out = {}
        for name, fn in fns.items():
            work.clear()
            fn()
            out[name] = _charge(work)
        return out

    monkeypatch.setattr(costs, "_interleaved", interleaved)
    ks = [1, 2, 4]
    got = costs.forward_costs(target.model, {"greedy:p": (ps[proposer], Sampling(), ks)}, [1, 2, 3], PROMPT, b)
    one = 0.010 + 0.001
    assert got.round_s == pytest.approx(one)
    assert got.v == pytest.approx({k: (0.010 + 0.001 * (k + 1)) / one for k in (1, 2, 3)})
    round_s = {k: 0.002 * k if engine == "eager" else 0.001 + 0.001 * k for k in ks}
    assert got.c == pytest.approx({f"greedy:p:{k}": round_s[k] / k / one for k in ks})
    rounds = [k * got.c[f"greedy:p:{k}"] for k in ks]
    assert all(a < b for a, b in itertools.pairwise(rounds))  # a round of more guesses costs more


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("proposer", ["draft-2l", "mtp"])
@pytest.mark.parametrize("sampled", [False, True])
def test_a_timed_round_leaves_the_proposer_as_it_was(
    family: Family, monkeypatch: pytest.MonkeyPatch, engine: str, proposer: str, sampled: bool
) -> None:
    """The timed round is repeatable: every call starts from the same state (the proposer's
    cache length and what it has to catch up on put back), so greedy, the same guesses."""
    target, ps, b = _loaded(family, [proposer], engine)
    made: list[Any] = []
    real = costs.batch_proposer
    monkeypatch.setattr(costs, "batch_proposer", lambda *a: made.append(real(*a)) or made[-1])
    seen: dict[str, tuple[list, list]] = {}

    def state() -> list[tuple]:
        sts = [st for bp in made for st in bp.state.values()]
        assert sts  # the sequence being timed has a state, one round in
        return [(st.length, st.true_len, st.pending.tolist(), st.pending_h.tolist()) for st in sts]

    def interleaved(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
        for name, fn in fns.items():
            if name.startswith("c:"):
                before = state()
                outs = [fn(), fn(), fn()]
                assert state() == before, name
                seen[name] = (outs, before)
        return dict.fromkeys(fns, 1.0)

    monkeypatch.setattr(costs, "_interleaved", interleaved)
    draws = Sampling(1.0, seed=3) if sampled else Sampling()
    costs.forward_costs(target.model, {"m:p": (ps[proposer], draws, [1, 3])}, [1], PROMPT, b)
    assert set(seen) == {"c:m:p:1", "c:m:p:3"}
    for name, (outs, _) in seen.items():
        k = int(name.rsplit(":", 1)[1])
        assert all(len(o) == k for o in outs)  # type: ignore[arg-type]
        if not sampled:
            assert outs[0] == outs[1] == outs[2], name


@pytest.mark.parametrize("engine", ENGINES)
def test_a_timed_target_round_leaves_its_sequence_as_it_was(
    family: Family, monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """v's round is repeatable: every call starts from the same length, last token and pages (in
    the same order), so its verdicts are the same each time, and it verifies the guesses offered."""
    target, _, b = _loaded(family, [], engine)
    before: dict[int, list[tuple]] = {}
    real = costs.decode_round

    def spied(t: TargetRunner, proposer: Any, seqs: list) -> Any:
        s = seqs[0]
        before.setdefault(len(proposer.propose(seqs, [0])[0][0]), []).append(
            (s.cached, s.last.tolist(), list(t.pool.tables[s.uid]))
        )
        return real(t, proposer, seqs)

    monkeypatch.setattr(costs, "decode_round", spied)
    outs: dict[str, list] = {}

    def interleaved(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
        outs.update({name: [fn(), fn(), fn()] for name, fn in fns.items()})
        return dict.fromkeys(fns, 1.0)

    monkeypatch.setattr(costs, "_interleaved", interleaved)
    costs.forward_costs(target.model, {}, [1, 3], PROMPT, b, context=40)
    assert set(outs) == {"v1", "v2", "v4"} and set(before) == {0, 1, 3}
    for k, states in before.items():
        # the unit (k = 0) is read before and after the rest: twice as many calls
        assert len(states) == (6 if k == 0 else 3) and all(x == states[0] for x in states), k
    for name, (a, *rest) in outs.items():
        m, n, emitted = a[0]
        assert all(r == a for r in rest) and m == int(name[1:]) - 1 and len(emitted) == n + 1


@pytest.mark.parametrize("engine", ENGINES)
def test_readings_are_positive_and_finite(family: Family, monkeypatch: pytest.MonkeyPatch, engine: str) -> None:
    """A real stopwatch (values never compared): every reading named, positive and finite, the
    target's rounds greedy or sampled (its offered guesses verified as point masses)."""
    names = ["draft-2l", "mtp", "ngram+mtp"]
    target, ps, b = _loaded(family, names, engine)
    for m, s in (("greedy", Sampling()), ("sample", Sampling(1.0))):
        each = {f"{m}:{n}": (ps[n], s, [1, 3]) for n in names}
        got = costs.forward_costs(target.model, each, [1, 2, 3], PROMPT, b, context=40, reps=3, sampling=s)
        assert set(got.c) == {f"{name}:{k}" for name in each for k in (1, 3)}
        assert set(got.v) == {1, 2, 3}
        for x in [*got.c.values(), *got.v.values(), got.round_s]:
            assert math.isfinite(x) and x > 0


# --- the bench's readings and rows --------------------------------------------------------------
def test_cost_readings_read_each_engine_on_its_own_backend(family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    """`cost_readings`: per reading, engine and mode, one `forward_costs` on that engine's backend,
    for the mode's proposers (the target alone left out) at their ks (0 left out), its target
    drawing as the mode does; named engine:mode:proposer:k, v by engine:mode:T (T = k + 1),
    round_s by engine:mode."""
    target = fam.load_target(family.target, DEV)
    mtp = fam.load_proposer("mtp", target, DEV, 0)
    modes = ["greedy", "sample"]
    native_b = Backend("native")  # never prepared: only its identity matters here
    plan = bench.Plan(
        {m: {"none": NONE, "mtp": mtp} for m in modes}, {"none": [0], "mtp": [0, 2, 3]}, modes,
        engines=("eager", "native"), backends={"native": native_b},
    )  # fmt: skip
    calls: list[tuple[dict, list[int], Backend, Sampling]] = []

    def fake(
        target: Any, proposers: dict, ks: list[int], prompt: list[int], backend: Backend, sampling: Sampling
    ) -> costs.Readings:
        calls.append((proposers, ks, backend, sampling))
        c = {f"{n}:{k}": k / 4 + (backend.name == "native") for n, (_, _, kk) in proposers.items() for k in kk}
        sampled = not sampling.greedy
        v = {k: 1.0 + k / 8 + sampled for k in ks}
        return costs.Readings(c, v, (0.001 if backend.name == "eager" else 0.002) * (1 + sampled))

    monkeypatch.setattr(bench, "forward_costs", fake)
    got = bench.cost_readings(target.model, plan, PROMPT, 2)
    assert [(b.name, s.greedy) for _, _, b, s in calls] == [
        ("eager", True),
        ("eager", False),
        ("native", True),
        ("native", False),
    ] * 2
    assert calls[2][2] is native_b
    for p, ks, _, s in calls:
        m = "greedy" if s.greedy else "sample"
        assert s == bench.plan_sampling(plan, m) and ks == [1, 2, 3]
        assert p == {f"{m}:mtp": (mtp, bench.plan_sampling(plan, m), [2, 3])}
    assert bench.plan_sampling(plan, "sample") == plan.sample and plan.sample.temperature > 0
    assert got.c["native:sample:mtp:3"] == [1.75, 1.75] and got.c["eager:greedy:mtp:2"] == [0.5, 0.5]
    assert set(got.c) == {f"{e}:{m}:mtp:{k}" for e in ("eager", "native") for m in modes for k in (2, 3)}
    engines = ("eager", "native")
    want_v = {
        f"{e}:{m}:{T}": [1 + (T - 1) / 8 + (m == "sample")] * 2 for e in engines for m in modes for T in (2, 3, 4)
    }
    assert got.v == want_v
    assert got.round_s == {
        "eager:greedy": [0.001] * 2,
        "eager:sample": [0.002] * 2,
        "native:greedy": [0.002] * 2,
        "native:sample": [0.004] * 2,
    }
    calls.clear()
    bench.cost_readings(target.model, plan, PROMPT, 1, passes=[1, 2, 5])
    assert [ks for _, ks, _, _ in calls] == [[1, 4]] * 4  # T - 1, the unit T = 1 left out


def test_rows_cost_in_rounds_of_the_target_alone(family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row's c and v: the seconds its own runs spent guessing and in the rest of their rounds, in
    rounds of its engine's target alone in the same run (a fake clock here: the target alone's round
    4 ms eager, 2 ms native; a guess 1 ms; a speculative round's rest 3 ms)."""
    target = fam.load_target(family.target, DEV)
    plan = bench.Plan(
        {"greedy": {"mtp": fam.load_proposer("mtp", target, DEV, 0)}}, {"mtp": [2]}, ["greedy"], max_new=12,
        repeats=2, engines=("eager", "native"),
    )  # fmt: skip
    real_run = bench.generate

    def clocked(*a: Any, backend: Backend) -> tuple[list[int], Stats]:
        out, st = real_run(*a, backend=backend)
        rounds = st.passes - 1
        st.propose_s = st.proposed * 0.001
        alone = 0.004 if backend.name == "eager" else 0.002
        st.round_s = st.propose_s + rounds * (0.003 if st.proposed else alone)
        return out, st

    monkeypatch.setattr(bench, "generate", clocked)
    models: list[tuple[float, ...]] = []
    real_pred = bench.predicted_speedup
    monkeypatch.setattr(
        bench, "predicted_speedup", lambda a, k, c, v: models.append((k, c, v)) or real_pred(a, k, c, v)
    )
    rows = {(r.engine, r.proposer): r for r in bench.run_bench(target.model, [PROMPT], plan)}
    native_r, eager_r = rows[("native", "mtp")], rows[("eager", "mtp")]
    assert eager_r.cost_c == pytest.approx(0.25) and eager_r.cost_v == pytest.approx(0.75)
    assert native_r.cost_c == pytest.approx(0.5) and native_r.cost_v == pytest.approx(1.5)
    fed = [(2, pytest.approx(0.25), pytest.approx(0.75)), (2, pytest.approx(0.5), pytest.approx(1.5))]
    assert [m for m in models if m[0]] == fed  # the model is fed them: eager's row, then native's
    for r in rows.values():
        assert r.predicted_speedup > 0 and r.measured_over_predicted == pytest.approx(r.speedup / r.predicted_speedup)
    alone = rows[("native", "none")]
    assert alone.cost_c == 0 and alone.cost_v == 1.0 and alone.predicted_speedup == 1.0


def test_a_round_clocks_its_guesses_and_the_rest(family: Family) -> None:
    """`Stats.propose_s` and `round_s`: every decode round adds to both, the guesses' share within it."""
    target = fam.load_target(family.target, DEV)
    _, st = generate(target.model, fam.load_proposer("mtp", target, DEV, 0), PROMPT, 20, 3)
    assert st.passes > 1 and 0 < st.propose_s < st.round_s < st.elapsed_s


# --- the cost model's arithmetic ---------------------------------------------------------------
def test_predicted_speedup_and_alpha_by_hand() -> None:
    """(1-a^(k+1))/(1-a) tokens a round for k·c + v passes, against values worked out by hand."""
    # a = 0.5, k = 3: 1 + .5 + .25 + .125 = 1.875 tokens; 3 * 0.2 + 1.1 = 1.7 passes
    assert costs.predicted_speedup(0.5, 3, 0.2, 1.1) == pytest.approx(1.875 / 1.7)
    # a = 0.8, k = 2: 1 + .8 + .64 = 2.44 tokens; 2 * 0.1 + 1.05 = 1.25 passes
    assert costs.predicted_speedup(0.8, 2, 0.1, 1.05) == pytest.approx(1.952)
    assert costs.predicted_speedup(1.0, 4, 0.25, 1.0) == pytest.approx(5 / 2)  # all kept: k + 1 tokens
    assert costs.predicted_speedup(0.0, 4, 0.0, 1.0) == pytest.approx(1.0)  # nothing kept, free proposer
    # 20 rounds of k = 3: 1st kept 12 times, 2nd 8, 3rd 2 -> reached 20 + 12 + 8 = 40, kept 22
    assert costs.conditional_alpha([12, 8, 2], 20) == pytest.approx(22 / 40)
    assert costs.conditional_alpha([0, 0], 0) == 0.0


def test_run_costs_by_hand() -> None:
    """c: seconds a guess; v: the rest of a round; both over the target alone's seconds a round."""
    run = Stats("mtp", 4, passes=11, proposed=40, propose_s=0.02, round_s=0.07)  # 10 rounds, 40 guesses
    alone = Stats("none", 0, passes=21, round_s=0.04)  # 20 rounds of 2 ms
    assert costs.run_costs(run, 10, alone, 20) == pytest.approx((0.0005 / 0.002, 0.005 / 0.002))
    assert costs.run_costs(Stats("none", 0, round_s=0.04), 20, alone, 20) == pytest.approx((0.0, 1.0))


# --- our rows beside a peer's ----------------------------------------------------------------------
def _row(engine: str, proposer: str, k: int, tps: float, mode: str = "greedy") -> bench.Row:
    return bench.Row(proposer, k, mode, tps, 1.0, 0.5, 2.0, [0.5] * k, 0.5, 0.1, 1.1, 1.5, 1.0, "2/2", 1, [tps], engine)


def test_our_row_is_the_fastest_engines() -> None:
    rows = [_row("eager", "none", 0, 417.0), _row("native", "none", 0, 1414.5), _row("native-avx2", "none", 0, 999.0)]
    rows += [_row("native", "none", 0, 5.0, "sample")]
    assert bench.our_row(rows, "none", 0) is rows[1]
    assert bench.our_row(rows[:1], "none", 0) is rows[0]  # eager alone: eager's
    assert bench.our_row(rows, "mtp", 2) is None


def test_vllm_rows_set_beside_our_fastest_engine_and_our_batch_engine(
    family: Family, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """vLLM (a stand-in: vLLM is not installed here): one request at a time against our fastest
    engine's row (native's, not eager's), its batch of the target alone against our batch engine
    at the same batch size, on that engine."""
    from smallem_cli.defaults import default_k
    from smallem_cli.interop import vllm_peer as V

    target = fam.load_target(family.target, DEV)
    prompts = [PROMPT, [20, 21, 22, 23, 24, 25, 26, 27]]
    ref = [generate(target.model, NONE, p, 10, 0)[0] for p in prompts]

    def run_offline(python: Path, job: dict[str, Any], env: dict[str, str], log: Path | None = None) -> dict:
        part = {"tokens": ref, "spec": {}}
        return {"version": "0", "load_s": 1.0, "batch": {**part, "seconds": 0.5}, "single": {**part, "seconds": 2.0}}

    monkeypatch.setattr(V, "run_offline", run_offline)
    k = default_k("draft-2l", greedy=True)
    rows = [_row("eager", "none", 0, 417.0), _row("native", "none", 0, 1414.5)]
    rows += [_row("eager", "draft-2l", k, 300.0), _row("native", "draft-2l", k, 1800.0)]
    engines: list[str] = []

    def at_batch(engine: str) -> tuple[float, list[list[int]]]:
        engines.append(engine)
        return 2500.0, ref

    out = V.bench_peer(target, family.dir, prompts, 10, rows, 1, python=Path("python"), at_batch=at_batch)
    alone, batch, draft, draft_batch = out
    assert engines == ["native"]
    assert alone["ours_tokens_per_s"] == 1414.5 and alone["ours_engine"] == "native" and alone["ours_batch"] == 1
    assert batch["ours_tokens_per_s"] == 2500.0 and batch["ours_batch"] == 2 and batch["ours_engine"] == "native"
    assert batch["ours_over_peer"] == pytest.approx(2500.0 / (20 / 0.5)) and batch["ours_identical"] == "2/2"
    assert draft["ours_tokens_per_s"] == 1800.0 and draft_batch["ours_tokens_per_s"] == 1800.0
