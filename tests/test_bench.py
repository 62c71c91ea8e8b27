"""The benchmark's machinery on the tiny on-disk family (timings themselves are never asserted)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import Family
from typer.testing import CliRunner

from smallem_cli import defaults
from smallem_cli.backends import engines
from smallem_cli.bench import run as bench
from smallem_cli.cli.app import app
from smallem_cli.engine import family as fam


def test_cost_model_matches_the_seed() -> None:
    # the seed: draft-2l at k=2, c = 0.31, v = 1.05: 2.17 tokens for ~1.67 passes, about x1.30
    alpha = 0.68
    tokens = (1 - alpha**3) / (1 - alpha)
    assert bench.predicted_speedup(alpha, 2, 0.31, 1.05) == pytest.approx(tokens / (2 * 0.31 + 1.05))
    assert bench.predicted_speedup(1.0, 3, 0.0, 1.0) == pytest.approx(4.0)  # all kept, free proposer
    assert bench.predicted_speedup(0.0, 2, 0.2, 1.0) == pytest.approx(1 / 1.4)  # nothing kept: pure cost
    # 10 rounds of k=2: the first guess kept 6 times, both 3 times -> 16 guesses in play, 9 kept
    assert bench.conditional_alpha([6, 3], 10) == pytest.approx(9 / 16)
    assert bench.conditional_alpha([10, 10], 10) == 1.0


def read_tokens(path: Path) -> list[list[int]]:
    """The token ids of a prompts file (one JSON object a line, as `bench.write_prompts` writes it)."""
    return [json.loads(line)["tokens"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_prompts_file_round_trips(family: Family, tmp_path: Path) -> None:
    val = tmp_path / "val.txt"
    val.write_text("<|endoftext|>".join(["In the beginning was the word and the word was good. " * 4] * 10))
    out = tmp_path / "p.jsonl"
    bench.write_prompts(val, family.tokenizer, out, count=3, length=12)
    prompts = read_tokens(out)
    assert len(prompts) == 3 and all(len(p) == 12 for p in prompts)
    # more prompts than chunks: successive 12-token windows of each chunk, all distinct
    bench.write_prompts(val, family.tokenizer, out, count=30, length=12)
    many = read_tokens(out)
    assert len(many) == 30 and all(len(p) == 12 for p in many) and many[0] == prompts[0]
    with pytest.raises(ValueError):  # more than the windows
        bench.write_prompts(val, family.tokenizer, out, count=1000, length=12)


def test_run_bench_rows_and_identity(family: Family) -> None:
    dev = torch.device("cpu")
    target = fam.load_target(family.target, dev)
    proposers = {n: fam.load_proposer(n, target, dev, 0) for n in ("draft-2l", "mtp")}
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27]]
    modes = ["greedy", "sample"]
    plan = bench.Plan(dict.fromkeys(modes, proposers), {"draft-2l": [1, 3], "mtp": [2]}, modes, max_new=24, repeats=2)
    rows = bench.run_bench(target.model, prompts, plan)
    assert [(r.mode, r.proposer, r.k) for r in rows] == [
        (m, p, k) for m in ("greedy", "sample") for p, k in (("none", 0), ("draft-2l", 1), ("draft-2l", 3), ("mtp", 2))
    ]
    for r in rows:
        assert r.tokens_per_s > 0 and len(r.tokens_per_s_runs) == 2
        assert 0 <= r.acceptance_rate <= 1 and len(r.accepted_at) == r.k
        assert r.identical == ("2/2" if r.mode == "greedy" else None)
        if r.proposer == "none":
            assert r.speedup == 1.0 and r.tokens_per_pass == 1.0
        else:
            assert r.cost_c > 0 and r.cost_v > 0
            assert r.predicted_speedup == pytest.approx(bench.predicted_speedup(r.alpha_model, r.k, r.cost_c, r.cost_v))
            # per-position acceptance cannot rise with the position: a later guess needs the earlier ones
            assert all(a >= b for a, b in zip(r.accepted_at, r.accepted_at[1:], strict=False))


def test_run_bench_engines_side_by_side(family: Family) -> None:
    """Both engines in one run: the eager target alone is every row's reference (identity and
    vs_eager), and each engine's speed-up is over its own target alone. (No step is prepared
    here, so the native rows run eager: tests/test_native.py runs them for real.)"""
    dev = torch.device("cpu")
    target = fam.load_target(family.target, dev)
    proposers = {"mtp": fam.load_proposer("mtp", target, dev, 0)}
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12]]
    plan = bench.Plan({"greedy": proposers}, {"mtp": [2]}, ["greedy"], max_new=16, repeats=2, engines=("native",))
    rows = bench.run_bench(target.model, prompts, plan)
    assert [(r.engine, r.proposer) for r in rows] == [("eager", "none"), ("native", "none"), ("native", "mtp")]
    assert rows[0].vs_eager == 1.0 and rows[1].speedup == 1.0 and rows[0].speedup == 1.0
    assert all(r.identical == "1/1" and r.vs_eager is not None and r.vs_eager > 0 for r in rows)
    both = bench.Plan(
        {"greedy": proposers}, {"mtp": [2]}, ["greedy"], max_new=16, repeats=1, engines=("eager", "native")
    )
    assert bench.generations(both, 3) == 4 * 3  # eager none, native none, mtp on each engine
    assert engines.bench_engines("eager,native", dev) == ("eager", "native")
    assert engines.bench_engines("auto", dev) == ("eager", "native")
    with pytest.raises(ValueError, match="--engines"):
        engines.bench_engines("eager,fast", dev)


def test_bench_command_json(family: Family, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"tokens": list(range(5 + i, 17 + i)), "text": ""}) for i in range(2)))
    args = [
        "bench",
        "--target",
        str(family.target),
        "--proposers",
        "draft-2l,mtp",
        "--prompts",
        str(prompts),
        "-n",
        "16",
        "--repeats",
        "1",
        "--sweep-k",
        "1..2",
        "--modes",
        "greedy",
        "--json",
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    keys = {
        "proposer",
        "k",
        "mode",
        "tokens_per_s",
        "speedup",
        "acceptance_rate",
        "tokens_per_pass",
        "predicted_speedup",
        "identical",
    }
    assert keys <= set(out["rows"][0]) and len(out["rows"]) == 5
    bad = CliRunner().invoke(app, ["bench", "--target", str(family.target), "--sweep-k", "0..3"])
    assert bad.exit_code != 0 and "k values" in bad.stderr


@pytest.mark.parametrize(("extra", "module"), [(["--plot", "k.png"], "matplotlib"), (["--peer", "hf"], "transformers")])
def test_missing_extras_are_refused_before_timing(
    family: Family, monkeypatch: pytest.MonkeyPatch, extra: list[str], module: str
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    timed: list[object] = []
    monkeypatch.setattr(bench, "run_bench", lambda *a, **kw: timed.append(a))
    res = CliRunner().invoke(app, ["bench", "--target", str(family.target), *extra])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1 and f"needs {module}" in res.stderr
    assert timed == []  # refused before any timing


def test_run_bench_ngram_rows(family: Family) -> None:
    """ngram and ngram+mtp in one run: greedy identity, and the cost model over the depths the
    rounds had."""
    dev = torch.device("cpu")
    target = fam.load_target(family.target, dev)
    proposers = {
        "ngram": fam.load_proposer("ngram", target, dev, 0),
        "ngram+mtp": fam.load_proposer("ngram+mtp", target, dev, 0),
    }
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [20, 21, 22, 23, 24, 25, 26, 27]]
    ks = {n: [3] for n in proposers}
    plan = bench.Plan({"greedy": proposers}, ks, ["greedy"], max_new=24, repeats=1)
    rows = bench.run_bench(target.model, prompts, plan)
    assert [r.proposer for r in rows] == ["none", "ngram", "ngram+mtp"]
    assert all(r.identical == "2/2" for r in rows)
    ngram = rows[1]
    # c is read from the run's clock (noisy on a shared machine): only its sanity is asserted here
    assert math.isfinite(ngram.cost_c) and ngram.cost_c >= 0 and ngram.predicted_speedup > 0


def test_variants_guess_as_deep_as_their_proposer() -> None:
    """A bench row's variant of P (P@tree12, P@f16) and ngram+P take P's default k, not the
    default of a proposer given by path."""
    for greedy in (True, False):
        mtp, draft = defaults.default_k("mtp", greedy), defaults.default_k("draft-4l", greedy)
        assert defaults.default_k("mtp@tree12", greedy) == defaults.default_k("mtp@f16", greedy) == mtp
        assert defaults.default_k("ngram+draft-4l@f16", greedy) == draft
    assert defaults.default_k("draft-4l@f16", True) != defaults.K_OTHER  # P's own, not a path's


def test_bench_batch(family: Family, tmp_path: Path) -> None:
    """`bench --batch`: a row per proposer, k and batch size, each with every request identical to
    the target alone's, its figures those of the median of its --repeats runs; bad sizes are one error line."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"tokens": list(range(5 + i, 15 + i)), "text": ""}) + "\n" for i in range(6)))
    args = ["bench", "--target", str(family.target), "--prompts", str(prompts), "-n", "12", "--proposers", "mtp"]
    res = CliRunner().invoke(app, [*args, "--batch", "1,4", "-k", "1,3", "--repeats", "3", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["batch_rows"]
    assert all(len(r["runs_tokens_per_s"]) == 3 and r["tokens_per_s"] == r["runs_tokens_per_s"][1] for r in rows)
    assert [(r["proposer"], r["k"], r["batch"]) for r in rows] == [
        ("none", "auto", 1), ("none", "auto", 4), ("mtp", "1", 1), ("mtp", "1", 4), ("mtp", "3", 1), ("mtp", "3", 4)
    ]  # fmt: skip
    assert all(r["identical"] == "6/6" and r["tokens"] == 72 and r["preemptions"] == 0 for r in rows)
    assert all(r["tokens_per_pass"] > 1 for r in rows if r["proposer"] == "mtp")
    table = CliRunner().invoke(app, [*args, "--batch", "2", "--repeats", "1"])
    assert table.exit_code == 0 and "batch engine" in table.stdout and "one run" in table.stdout
    bad = CliRunner().invoke(app, [*args, "--batch", "0,4"])
    assert bad.exit_code == 2 and bad.stderr.count("\n") == 1 and "batch sizes" in bad.stderr


def test_peer_table_marks_a_row_we_did_not_run() -> None:
    """--peer hf with the MTP module alone: the assisted row has no draft-2l row of ours to
    compare with; the table says so instead of printing nan."""
    from rich.console import Console

    from smallem_cli.bench.peer import peer_table

    rows = [
        {"peer": "plain", "tokens_per_s": 70.0, "ours_tokens_per_s": 700.0, "ours_over_peer": 10.0, "identical": "8/8"},
        {"peer": "assisted", "tokens_per_s": 70.0, "ours_tokens_per_s": math.nan, "ours_over_peer": math.nan,
         "identical": "8/8"},
    ]  # fmt: skip
    con = Console(width=200, record=True)
    con.print(peer_table(rows))
    text = con.export_text()
    assert "nan" not in text and "not run" in text and "×10.00" in text
