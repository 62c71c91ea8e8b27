"""The cost model's readings on the path the run takes, and which of our rows a peer is set
against (timings themselves are never asserted: the clock here is a fake one)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Family

from smallem_cli.bench import costs
from smallem_cli.bench import run as bench
from smallem_cli.engine import family as fam
from smallem_cli.engine.generate import generate
from smallem_cli.spec.proposers import NoProposer
from smallem_cli.spec.verify import Warper
from smallem_cli.stats import Stats

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def _spied(make: fam.ProposerFactory, calls: list[tuple[str, int]]) -> fam.ProposerFactory:
    """The factory's proposers, each `propose` and `cost_step` call written into `calls`."""

    def spied(n: int) -> Any:
        p = make(n)
        propose, step = p.propose, p.cost_step

        def spy_propose(k: int, *a: Any, **kw: Any) -> Any:
            calls.append(("propose", k))
            return propose(k, *a, **kw)

        def spy_step() -> object:
            calls.append(("step", 1))
            return step()

        p.propose, p.cost_step = spy_propose, spy_step  # type: ignore[method-assign]
        return p

    return spied


def _fake_clock(calls: list[tuple[str, int]]) -> Callable[[dict[str, Callable[[], object]], int], dict[str, float]]:
    """`_interleaved` on a fake clock: each fn runs once; a target pass takes 10 ms, a proposer's
    step 6 ms, a round of k guesses in one call 1 ms + 1 ms a guess (cheaper a guess than a step)."""

    def interleaved(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
        out = {}
        for name, fn in fns.items():
            calls.clear()
            fn()
            if not calls:
                out[name] = 0.010
            else:
                assert len(calls) == 1, calls
                what, k = calls[0]
                out[name] = 0.006 if what == "step" else 0.001 + 0.001 * k
        return out

    return interleaved


@pytest.mark.parametrize("proposer", ["mtp", "draft-2l"])
def test_native_c_is_read_on_the_round_call(family: Family, monkeypatch: pytest.MonkeyPatch, proposer: str) -> None:
    """A native engine's c(k): the round's `propose(k)` (one call of k guesses) over k, one reading
    per k, not the step timed alone; the step is still read, for the eager engine."""
    target = fam.load_target(family.target, torch.device("cpu"))
    calls: list[tuple[str, int]] = []
    make = _spied(fam.load_proposer(proposer, target, torch.device("cpu"), 0), calls)
    monkeypatch.setattr(costs, "_interleaved", _fake_clock(calls))
    got = costs.forward_costs(target.model, {"greedy:p": make}, [1, 2, 3], PROMPT, chained={"greedy:p": (None, [1, 3])})
    assert got.one_s == pytest.approx(0.010) and got.v == {1: 1.0, 2: 1.0, 3: 1.0}
    assert got.c == pytest.approx({"greedy:p": 0.6, "greedy:p:1": 0.2, "greedy:p:3": 0.4 / 3})
    assert got.whole == []
    eager = costs.forward_costs(target.model, {"greedy:p": make}, [1, 2, 3], PROMPT)
    assert eager.c == pytest.approx({"greedy:p": 0.6})  # no chain: the step is the path the run takes


@pytest.mark.parametrize("proposer", ["mtp", "draft-2l"])
@pytest.mark.parametrize("sampled", [False, True])
def test_a_timed_round_leaves_the_proposer_as_it_was(family: Family, proposer: str, sampled: bool) -> None:
    """The timed round is repeatable: the same guesses from the same state, the cache rolled back."""
    dev = torch.device("cpu")
    target = fam.load_target(family.target, dev)
    p = fam.load_proposer(proposer, target, dev, 0)(200)
    ids = torch.tensor(PROMPT * 4)
    with torch.inference_mode():
        cache = target.model.new_cache(8)
        _, hidden = target.model(ids, cache, cache.new_sequence())
        p.start(ids, ids[-1:], hidden)
        p.propose(1, None, None)
        p.accept(1, ids[-2:], hidden[-2:])
        warp = Warper(1.0) if sampled else None
        inner = costs.chain_proposer(p, warp)
        assert inner is p
        n = p.cache.length(p.seq)  # type: ignore[attr-defined]
        first = costs.round_call(inner, 3, warp, torch.Generator().manual_seed(0))()
        assert p.cache.length(p.seq) == n  # type: ignore[attr-defined]
        again = costs.round_call(inner, 3, warp, torch.Generator().manual_seed(0))()
    assert torch.equal(first[0], again[0]) and len(first[0]) == 3  # type: ignore[index]


def test_no_round_call_where_the_run_steps(family: Family) -> None:
    """Sampled at adaptive depth, a lookup, token trees: the run goes step by step, c stays a step;
    adaptive depth, greedy: the whole chain runs every round."""
    dev = torch.device("cpu")
    target = fam.load_target(family.target, dev)
    adaptive = fam.load_proposer("mtp", target, dev, 0, 0.5)(64)
    assert costs.chain_proposer(adaptive, Warper(1.0)) is None and costs.chain_proposer(adaptive, None) is adaptive
    assert costs.chain_proposer(fam.load_proposer("ngram", target, dev, 0)(64), None) is None
    tree = fam.load_proposer("mtp", target, dev, 0, tree=(4, 2))(64)
    assert costs.chain_proposer(tree, None) is None
    both = fam.load_proposer("ngram+mtp", target, dev, 0)(64)
    assert costs.chain_proposer(both, None) is both.other  # type: ignore[attr-defined]


def test_cost_readings_time_the_chain_on_native_engines_only(family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    dev = torch.device("cpu")
    target = fam.load_target(family.target, dev)
    factories = {"mtp": fam.load_proposer("mtp", target, dev, 0)}
    modes = ["greedy", "sample"]
    plan = bench.Plan(dict.fromkeys(modes, factories), {"mtp": [2, 3]}, modes, engines=("eager", "native"))
    seen: list[costs.Chained | None] = []

    def fake(target: Any, proposers: Any, ks: list[int], prompt: list[int], **kw: Any) -> costs.Readings:
        chained = kw.get("chained")
        seen.append(chained)
        c = {n: 0.5 for n in proposers} | {f"{n}:{k}": 0.2 for n, (_, kk) in (chained or {}).items() for k in kk}
        return costs.Readings(c, dict.fromkeys(ks, 1.1), 0.001)

    monkeypatch.setattr(bench, "forward_costs", fake)
    got = bench.cost_readings(target.model, plan, PROMPT, 1)
    assert seen[0] is None  # eager: the step
    assert seen[1] == {"greedy:mtp": (None, [2, 3]), "sample:mtp": (Warper(1.0), [2, 3])}
    assert got.c["native:greedy:mtp:3"] == [0.2] and got.c["eager:greedy:mtp"] == [0.5]
    assert "eager:greedy:mtp:3" not in got.c


def test_rows_predict_from_the_round_call(family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    """A native row's c and prediction come from its round's call of k; an eager row's from the step."""
    dev = torch.device("cpu")
    target = fam.load_target(family.target, dev)
    plan = bench.Plan(
        {"greedy": {"mtp": fam.load_proposer("mtp", target, dev, 0)}}, {"mtp": [2]}, ["greedy"], max_new=12,
        repeats=1, engines=("eager", "native"),
    )  # fmt: skip
    readings = costs.Costs(
        {"eager:greedy:mtp": [0.9], "native:greedy:mtp": [0.9], "native:greedy:mtp:2": [0.3]},
        {"eager:3": [1.2], "native:3": [1.1]},
        {"eager": [0.01], "native": [0.005]},
    )
    monkeypatch.setattr(bench, "cost_readings", lambda *a, **kw: readings)
    rows = {(r.engine, r.proposer): r for r in bench.run_bench(target.model, [PROMPT], plan)}
    native, eager = rows[("native", "mtp")], rows[("eager", "mtp")]
    assert native.cost_c == 0.3 and native.cost_v == 1.1 and eager.cost_c == 0.9
    assert native.predicted_speedup == pytest.approx(bench.predicted_speedup(native.alpha_model, 2, 0.3, 1.1))


def test_whole_chain_rounds_cost_the_chain_at_every_depth() -> None:
    st = Stats("mtp@p0.5", 4, accepted=9, guessed=[2, 0, 4, 0, 4])
    v = {2: 1.1, 3: 1.2, 4: 1.3, 5: 1.5}
    cost = (2 * (0.8 + 1.0) + 4 * (0.8 + 1.2) + 4 * (0.8 + 1.5)) / 10
    assert bench.variable_speedup(st, 10, 0.2, v, whole=0.8) == pytest.approx((1 + 9 / 10) / cost)


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

    target = fam.load_target(family.target, torch.device("cpu"))
    prompts = [PROMPT, [20, 21, 22, 23, 24, 25, 26, 27]]
    ref = [generate(target.model, NoProposer(), p, 10, 0)[0] for p in prompts]

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
