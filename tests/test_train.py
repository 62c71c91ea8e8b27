"""Training: distilled drafts and MTP modules learn the target's own guesses; the train command."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from conftest import CORPUS, DRAFT_CFG, TINY, Family, Trained, _FakeClock
from typer.testing import CliRunner

from smallem_cli import defaults as D
from smallem_cli.cli.app import app
from smallem_cli.config import PRESETS
from smallem_cli.model import checkpoint
from smallem_cli.model.llama import MTPModule, Transformer
from smallem_cli.train.evaluate import evaluate_family
from smallem_cli.train.loop import Progress, TrainSettings, distill, lr_at, spent, train_model


def _agreement(target: Transformer, draft: Transformer, ids: np.ndarray) -> float:
    reports = evaluate_family(target, ids, len(ids), {"draft": draft}, None, seq_len=64)
    assert reports[1].agreement is not None
    return reports[1].agreement


def test_distilled_draft_learns_the_targets_argmax(
    trained: Trained, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = np.tile(trained.period, 50).astype(np.uint16)
    student = Transformer(DRAFT_CFG)
    student.init_weights(3)
    target_params = [p.clone() for p in trained.model.parameters()]
    before = _agreement(trained.model, student, stream[:400])
    settings = TrainSettings(
        budget_s=1.5, batch_size=8, seq_len=32, lr=1e-2, warmup_steps=10, save_every_s=1e9, eval_every_s=1e9
    )
    monkeypatch.setattr("smallem_cli.train.loop.time", SimpleNamespace(perf_counter=_FakeClock().perf_counter))
    facts = distill(trained.model, student, stream, stream[:400], settings, tmp_path)
    after = _agreement(trained.model, student, stream[:400])
    assert facts["steps"] == 150 and "val_loss" in facts
    assert before < 0.3, before
    assert after > 0.9, (before, after)
    # the teacher stays frozen
    assert all(torch.equal(a, b) for a, b in zip(target_params, trained.model.parameters(), strict=True))


def test_distilling_across_vocabularies_is_refused(trained: Trained, tmp_path: Path) -> None:
    other = Transformer(dataclasses.replace(DRAFT_CFG, vocab_size=DRAFT_CFG.vocab_size + 1))
    with pytest.raises(ValueError, match="vocabulary"):
        distill(trained.model, other, np.zeros(100, np.uint16), np.zeros(100, np.uint16), TrainSettings(), tmp_path)


def test_train_draft_distill_command(family: Family, tmp_path: Path) -> None:
    """`smallem train draft --init F --distill`: a new file, its facts chained to the old one's."""
    text = tmp_path / "corpus.txt"
    text.write_text((CORPUS + "\n\n") * 300, encoding="utf-8")  # 19 chunks of 4 KB: one is held out
    out = tmp_path / "draft.safetensors"
    common = ["--data", str(tmp_path / "data"), "--tokenizer", str(family.tokenizer), "--target", str(family.target)]
    argv = ["train", "draft", "--text", str(text), *common, "--init", str(family.draft), "--distill"]
    argv += ["--budget", "1", "--batch-size", "2", "--out", str(out), "--run-dir", str(tmp_path / "run")]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, (result.stderr, result.exception)
    facts = checkpoint.facts(checkpoint.read_meta(out))
    assert (
        facts["steps"] > 0
        and facts["trained"] == f"distilled from target.safetensors, starting from {family.draft.name}"
    )
    assert facts["before"] == checkpoint.facts(checkpoint.read_meta(family.draft))
    assert checkpoint.load_model(out)[0].cfg == checkpoint.load_model(family.draft)[0].cfg

    # --init alone would silently mean distillation: it must be asked for
    argv = ["train", "draft", *common, "--init", str(family.draft), "--out", str(out)]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2 and result.stderr.startswith("error: ") and "--distill" in result.stderr

    # --compile without a C++ compiler for torch.compile: one line, before any training
    argv = ["train", "draft", *common, "--init", str(family.draft), "--distill", "--compile"]
    argv += ["--out", str(tmp_path / "other.safetensors")]
    import torch._inductor.config as inductor

    with inductor.patch({"cpp.cxx": ("no-such-compiler",)}):  # what $CXX sets when torch loads
        result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "needs a C++ compiler" in result.stderr
    assert not (tmp_path / "other.safetensors").exists()


def test_train_without_validation_text_is_refused(family: Family, tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text(CORPUS, encoding="utf-8")  # one chunk: nothing to hold out
    argv = ["train", "draft", "--text", str(text), "--data", str(tmp_path / "data")]
    argv += ["--tokenizer", str(family.tokenizer), "--out", str(tmp_path / "d.safetensors")]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: the validation split") and not (tmp_path / "d.safetensors").exists()


def test_mtp_feature_loss_pulls_its_state_to_the_targets(
    trained: Trained, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--feature-weight: the module's output state moves towards the target's next state."""
    stream = np.tile(trained.period, 50).astype(np.uint16)
    start = MTPModule(trained.model.cfg)  # a fresh module: far from the target's states
    settings = TrainSettings(
        budget_s=0.8, batch_size=8, seq_len=32, lr=1e-2, warmup_steps=10, save_every_s=1e9, eval_every_s=1e9
    )
    settings = dataclasses.replace(settings, feature_weight=1.0)
    seen: list[dict[str, float]] = []
    monkeypatch.setattr("smallem_cli.train.loop.time", SimpleNamespace(perf_counter=_FakeClock().perf_counter))
    distill(trained.model, start, stream, stream[:400], settings, tmp_path, on_steps(lambda p: seen.append(p.extra)))
    assert len(seen) == 80 and {"kl@1", "feature"} <= set(seen[0])
    assert seen[-1]["feature"] < 0.5 * seen[0]["feature"], (seen[0], seen[-1])


def test_the_joint_weight_is_what_the_trunk_learns_from(tmp_path: Path) -> None:
    """`mtp_weight` scales the MTP module's loss in the target's gradient: at 0 the target learns
    exactly as a target trained alone (the same batches, bit for bit); at the default it does not."""
    rng = np.random.default_rng(3)
    stream = rng.integers(1, TINY.vocab_size, size=4000).astype(np.uint16)
    settings = TrainSettings(budget_tokens=6 * 4 * 32, batch_size=4, seq_len=32, save_every_s=1e9, eval_every_s=1e9)
    alone, _, _ = train_model(dataclasses.replace(TINY, mtp=False), stream, stream[:200], settings, tmp_path / "a")
    runs = {}
    for weight in (0.0, D.TRAIN_MTP_WEIGHT):
        s = dataclasses.replace(settings, mtp_weight=weight)
        model, mtp, facts = train_model(TINY, stream, stream[:200], s, tmp_path / f"w{weight}")
        assert mtp is not None and facts["joint_weight"] == weight
        runs[weight] = model.state_dict()
    for name, w in alone.state_dict().items():
        assert torch.equal(w, runs[0.0][name]), name
    assert not all(torch.equal(w, runs[D.TRAIN_MTP_WEIGHT][n]) for n, w in alone.state_dict().items())


def test_train_target_then_mtp_commands(family: Family, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`smallem train target` writes the target and its jointly trained MTP module; `train mtp
    --init` continues that module on the frozen target, its facts chained to the joint run's."""
    cfg = dataclasses.replace(DRAFT_CFG, vocab_size=300, max_seq_len=512, mtp=True)
    monkeypatch.setitem(PRESETS, "probe", cfg)
    text = tmp_path / "corpus.txt"
    text.write_text((CORPUS + "\n\n") * 300, encoding="utf-8")
    base = ["--data", str(tmp_path / "data"), "--tokenizer", str(family.tokenizer), "--budget", "1"]
    base += ["--batch-size", "2"]
    out = tmp_path / "ckpt" / "probe.safetensors"
    argv = ["train", "target", "--text", str(text), *base, "--preset", "probe", "--out", str(out)]
    result = CliRunner().invoke(app, [*argv, "--run-dir", str(tmp_path / "r1")])
    assert result.exit_code == 0, (result.stderr, result.exception)
    joint = out.with_name("mtp.safetensors")
    facts, mtp_facts = (checkpoint.facts(checkpoint.read_meta(p)) for p in (out, joint))
    assert facts["steps"] > 0 and "val_loss" in facts and not any(k.startswith("mtp_") for k in facts)
    assert mtp_facts["trained"] == "jointly with probe.safetensors" and "mtp_val_loss" in mtp_facts
    assert checkpoint.load_model(out)[0].cfg == cfg
    assert facts["joint_weight"] == mtp_facts["joint_weight"] == D.TRAIN_MTP_WEIGHT

    again = tmp_path / "mtp-2.safetensors"
    argv = ["train", "mtp", *base, "--target", str(out), "--init", str(joint), "--out", str(again), "--tokens", "1024"]
    result = CliRunner().invoke(app, [*argv, "--run-dir", str(tmp_path / "r2")])
    assert result.exit_code == 0, (result.stderr, result.exception)
    facts2 = checkpoint.facts(checkpoint.read_meta(again))
    assert facts2["trained"] == "distilled from the frozen target, starting from mtp.safetensors"
    assert facts2["before"] == mtp_facts and facts2["steps"] == 2 and facts2["tokens_seen"] == 1024  # 2 x 256 a step

    # the experiments' options left the CLI (docs/decisions.md, 2026-12-05): refused as unknown, before any work
    for gone in (["--chain", "2"], ["--fit-temperatures", "1,0.7"], ["--fit-tv", "1"], ["--fit-vocab", "100"]):
        argv = ["train", "mtp", *base, "--target", str(out), "--out", str(tmp_path / "no"), *gone]
        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 2 and "No such option" in result.stderr and gone[0] in result.stderr, result.stderr
    assert not (tmp_path / "no").exists() and "fit" not in facts2 and "chain_depth" not in facts2

    # --mtp-weight: the target's joint loss; refused where no MTP module trains with it, or below 0
    lone = ["train", "target", "--preset", "draft-2l", "--mtp-weight", "1"]  # a target without its module
    for bad in (["train", "mtp", "--mtp-weight", "1"], ["train", "target", "--mtp-weight", "-1"], lone):
        result = CliRunner().invoke(app, [*bad, *base, "--target", str(out), "--out", str(tmp_path / "no")])
        assert result.exit_code == 2 and result.stderr.startswith("error: --mtp-weight"), result.stderr
    assert not (tmp_path / "no").exists()

    # a target starts from scratch: --init is refused before any training
    result = CliRunner().invoke(app, ["train", "target", *base, "--preset", "probe", "--init", str(out)])
    assert result.exit_code == 2 and result.stderr.startswith("error: ") and "--init" in result.stderr


def test_eval_command_reports_every_member(family: Family, tmp_path: Path) -> None:
    """`smallem eval --json`: the target, the draft and the MTP module found beside it; the
    noisy-copy draft agrees with the target far more often than the random MTP module."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "val.txt").write_text("<|endoftext|>".join([CORPUS] * 3), encoding="utf-8")
    result = CliRunner().invoke(app, ["eval", "--target", str(family.target), "--data", str(data), "--json"])
    assert result.exit_code == 0, (result.stderr, result.exception)
    out = json.loads(result.stdout)
    rows = {r["name"]: r for r in out["models"]}
    assert list(rows) == ["target", "draft-2l", "mtp"] and out["val_bytes"] == 3 * len(CORPUS.encode())
    assert rows["target"]["agreement"] is None and all(r["nats_per_byte"] > 0 for r in rows.values())
    assert rows["draft-2l"]["agreement"] > 0.5 > 0.1 > rows["mtp"]["agreement"], rows
    assert rows["target"]["sampled"] is None and len(rows["mtp"]["sampled"]) == len(D.EVAL_TEMPERATURES)
    assert all(1 >= a > b >= 0 for a, b in zip(rows["draft-2l"]["sampled"], rows["mtp"]["sampled"], strict=True)), rows
    assert rows["draft-2l"]["training"] == checkpoint.facts(checkpoint.read_meta(family.draft))

    # --mtp: another module in the MTP row (here the draft's file, which is no MTP module: refused)
    other = CliRunner().invoke(
        app, ["eval", "--target", str(family.target), "--data", str(data), "--mtp", str(family.mtp), "--json"]
    )
    assert other.exit_code == 0 and json.loads(other.stdout)["models"] == out["models"]
    bad = CliRunner().invoke(
        app, ["eval", "--target", str(family.target), "--data", str(data), "--mtp", str(family.draft)]
    )
    missing = CliRunner().invoke(
        app, ["eval", "--target", str(family.target), "--data", str(data), "--mtp", "nope.safetensors"]
    )
    assert (
        bad.exit_code == missing.exit_code == 2
        and bad.stderr.startswith("error:")
        and missing.stderr.startswith("error:")
    )

    result = CliRunner().invoke(app, ["eval", "--target", str(family.target), "--data", str(tmp_path / "none")])
    assert result.exit_code == 2 and result.stderr.startswith("error: no validation text")


def test_a_token_budget_ignores_the_clock(trained: Trained, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--tokens: the run stops on tokens seen, however fast the (fake) clock runs, and the
    learning rate's schedule follows the tokens."""
    stream = np.tile(trained.period, 50).astype(np.uint16)
    settings = TrainSettings(
        budget_s=0.1, budget_tokens=8 * 32 * 25, batch_size=8, seq_len=32, warmup_steps=5, save_every_s=1e9
    )
    seen: list[float] = []
    monkeypatch.setattr("smallem_cli.train.loop.time", SimpleNamespace(perf_counter=_FakeClock().perf_counter))
    student = Transformer(DRAFT_CFG)
    student.init_weights(3)
    facts = distill(
        trained.model, student, stream, stream[:400], settings, tmp_path, on_steps(lambda p: seen.append(p.done))
    )
    assert facts["steps"] == 25 and facts["tokens_seen"] == 8 * 32 * 25  # the clock alone would stop at 10
    assert seen[-1] == 1.0 and seen == sorted(seen)
    # halfway through the tokens, whatever the clock says, the cosine is halfway down
    assert spent(settings, 8 * 32 * 12, 99.0) == pytest.approx(0.48)
    mid = settings.lr * (settings.min_lr_frac + (1 - settings.min_lr_frac) / 2)
    assert lr_at(settings, 12, 0.5) == pytest.approx(mid)


def on_steps(on_step: Callable[[Progress], None]) -> Callable[[Progress | str], None]:
    """A progress callback that hears the steps alone (not the lines a run tells)."""
    return lambda p: None if isinstance(p, str) else on_step(p)


def _distil(
    trained: Trained,
    steps: int,
    run: Path,
    on_progress: Callable[[Progress | str], None] | None = None,
    **settings: Any,
) -> tuple[Transformer, dict[str, Any]]:
    """A fresh draft (seed 3) distilled from the trained target for `steps` steps of 8 x 32 tokens."""
    stream = np.tile(trained.period, 50).astype(np.uint16)
    student = Transformer(DRAFT_CFG)
    student.init_weights(3)
    kw = {"lr": 1e-2, "warmup_steps": 2, "save_every_s": 1e9, "eval_every_s": 1e9} | settings
    config = TrainSettings(budget_tokens=steps * 8 * 32, batch_size=8, seq_len=32, **kw)
    return student, distill(trained.model, student, stream, stream[:400], config, run, on_progress)


def test_compiled_loss_trains_as_the_eager_one(trained: Trained, tmp_path: Path) -> None:
    """`train --compile`: the loss through torch.compile. Five steps of distillation move the
    draft's weights as the eager loss's five do, to float32 rounding (the fused kernels sum in
    another order), and both runs count the same steps and tokens."""
    runs = {}
    torch._dynamo.utils.counters.clear()
    for compiled in (False, True):
        seen: list[Progress] = []
        model, facts = _distil(trained, 5, tmp_path / f"{compiled}", on_steps(seen.append), compile=compiled)
        runs[compiled] = (model.state_dict(), facts)
        read = seen[-1].extra  # what the loss read, as numbers on the host
        assert len(seen) == 5 and "kl@1" in read and all(isinstance(v, float) for v in read.values())
    # one graph: the loss's reads come back as tensors, so no `.item()` breaks it
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    (eager, f0), (fused, f1) = runs[False], runs[True]
    assert f0["steps"] == f1["steps"] == 5 and f0["tokens_seen"] == f1["tokens_seen"]
    start = Transformer(DRAFT_CFG)
    start.init_weights(3)
    moved = max(float((eager[k] - v).abs().max()) for k, v in start.state_dict().items())
    assert moved > 1e-3  # the steps did move the weights
    for k, v in eager.items():
        assert torch.allclose(v, fused[k], rtol=1e-3, atol=1e-5), (k, float((v - fused[k]).abs().max()))


def test_bf16_products_learn_as_float32_does(trained: Trained, tmp_path: Path) -> None:
    """`train --precision bf16`: the loss's products run in bfloat16 (the weights come out
    otherwise than float32's), the weights stay float32, and the draft learns the target's
    argmax as the float32 run does."""
    stream = np.tile(trained.period, 50).astype(np.uint16)
    runs = {p: _distil(trained, 150, tmp_path / p, warmup_steps=10, precision=p) for p in ("fp32", "bf16")}
    (m32, f32), (m16, f16) = runs["fp32"], runs["bf16"]
    assert f32["precision"] == "fp32" and f16["precision"] == "bf16" and f16["steps"] == 150
    assert all(p.dtype == torch.float32 for p in m16.parameters())
    differ = max(float((a - b).detach().abs().max()) for a, b in zip(m32.parameters(), m16.parameters(), strict=True))
    assert differ > 1e-4, differ  # bfloat16 products round otherwise: the run did use them
    assert _agreement(trained.model, m32, stream[:400]) > 0.9
    assert _agreement(trained.model, m16, stream[:400]) > 0.9


def test_train_refuses_an_unknown_precision(family: Family, tmp_path: Path) -> None:
    argv = ["train", "draft", "--precision", "fp16", "--tokenizer", str(family.tokenizer), "--out", str(tmp_path / "d")]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2 and result.stderr.startswith("error: --precision takes fp32 or bf16")
    assert not (tmp_path / "d").exists()
