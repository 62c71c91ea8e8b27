"""The cost model's readings on the path the run takes, its arithmetic, and which of our rows a
peer is set against (timings themselves are never asserted: the clock here is a fake one that
charges for the work each timed call did, or the readings' sanity alone)."""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Family

from smallem_cli.backends.engines import Backend
from smallem_cli.bench import run as bench
from smallem_cli.bench import run as costs
from smallem_cli.engine import family as fam
from smallem_cli.engine.family import NONE
from smallem_cli.engine.generate import generate
from smallem_cli.engine.target import TargetRunner
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


# --- pass_costs: what is timed ---------------------------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
def test_v_is_read_on_the_target_round(family: Family, monkeypatch: pytest.MonkeyPatch, engine: str) -> None:
    """v(T): the target's side of a round verifying T tokens (one verify pass over T), in rounds of
    one token; the unit's seconds. A fake clock: a verify pass over T tokens takes 10 ms + 1 ms a token."""
    target, _, b = _loaded(family, [], engine)
    work: list[int] = []
    verify = TargetRunner.verify_pass

    def spy_verify(self: TargetRunner, seqs: list, ids: torch.Tensor, counts: list[int]) -> Any:
        work.append(int(ids.shape[0]))
        return verify(self, seqs, ids, counts)

    def interleaved(fns: dict[int, Callable[[], object]], reps: int) -> dict[int, float]:
        out = {}
        for name, fn in fns.items():
            work.clear()
            fn()
            assert len(work) == 1, work  # one verify pass a reading
            out[name] = 0.010 + 0.001 * work[0]
        return out

    monkeypatch.setattr(TargetRunner, "verify_pass", spy_verify)
    monkeypatch.setattr(costs, "interleaved", interleaved)
    unit, v = costs.pass_costs(target.model, [1, 2, 3, 5], PROMPT, b)
    assert unit == pytest.approx(0.011)
    assert v == pytest.approx({T: (0.010 + 0.001 * T) / 0.011 for T in (1, 2, 3, 5)})


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
    outs: dict[int, list] = {}

    def interleaved(fns: dict[int, Callable[[], object]], reps: int) -> dict[int, float]:
        outs.update({name: [fn(), fn(), fn()] for name, fn in fns.items()})
        return dict.fromkeys(fns, 1.0)

    monkeypatch.setattr(costs, "interleaved", interleaved)
    costs.pass_costs(target.model, [2, 4], PROMPT, b, context=40)
    assert set(outs) == {1, 2, 4} and set(before) == {0, 1, 3}
    for k, states in before.items():
        # the unit (k = 0) is read before and after the rest: twice as many calls
        assert len(states) == (6 if k == 0 else 3) and all(x == states[0] for x in states), k
    for T, (a, *rest) in outs.items():
        m, n, emitted = a[0]
        assert all(r == a for r in rest) and m == T - 1 and len(emitted) == n + 1


@pytest.mark.parametrize("engine", ENGINES)
def test_readings_are_positive_and_finite(family: Family, engine: str) -> None:
    """A real stopwatch (values never compared): every reading named, positive and finite."""
    target, _, b = _loaded(family, [], engine)
    unit, v = costs.pass_costs(target.model, [1, 2, 3], PROMPT, b, context=40, reps=3)
    assert set(v) == {1, 2, 3} and v[1] == 1.0
    for x in [*v.values(), unit]:
        assert math.isfinite(x) and x > 0


# --- the bench's rows -------------------------------------------------------------------------------
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
    from smallem_cli.bench.peer import vllm_peer
    from smallem_cli.defaults import default_k
    from smallem_cli.interop import vllm_peer as V

    target = fam.load_target(family.target, DEV)
    prompts = [PROMPT, [20, 21, 22, 23, 24, 25, 26, 27]]
    ref = [generate(target.model, NONE, p, 10, 0)[0] for p in prompts]

    def run_offline(python: Path, job: dict[str, Any], env: dict[str, str], log: Path | None = None) -> dict:
        part = {"tokens": ref, "spec": {}}
        return {"version": "0", "load_s": 1.0, "batch": {**part, "seconds": 0.5}, "single": {**part, "seconds": 2.0}}

    monkeypatch.setattr(V, "run_offline", run_offline)
    monkeypatch.setattr(V, "find_python", lambda: Path("python"))
    k = default_k("draft-2l", greedy=True)
    rows = [_row("eager", "none", 0, 417.0), _row("native", "none", 0, 1414.5)]
    rows += [_row("eager", "draft-2l", k, 300.0), _row("native", "draft-2l", k, 1800.0)]
    engines: list[str] = []

    def at_batch(engine: str) -> tuple[float, list[list[int]]]:
        engines.append(engine)
        return 2500.0, ref

    out = vllm_peer(target, family.dir, prompts, 10, rows, 1, at_batch=at_batch)
    alone, batch, draft, draft_batch = out
    assert engines == ["native"]
    assert alone["ours_tokens_per_s"] == 1414.5 and alone["ours_engine"] == "native" and alone["ours_batch"] == 1
    assert batch["ours_tokens_per_s"] == 2500.0 and batch["ours_batch"] == 2 and batch["ours_engine"] == "native"
    assert batch["ours_over_peer"] == pytest.approx(2500.0 / (20 / 0.5)) and batch["ours_identical"] == "2/2"
    assert draft["ours_tokens_per_s"] == 1800.0 and draft_batch["ours_tokens_per_s"] == 1800.0
