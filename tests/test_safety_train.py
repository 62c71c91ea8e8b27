"""Training and export never run code from a file, never replace a file unasked, never lose
their own input, and a run repeats bit for bit.

Each refusal is one `error:` line on stderr and exit 2, before any work is done.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import Result
from conftest import CORPUS, DRAFT_CFG, Family
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from smallem_cli import defaults as D
from smallem_cli.cli.app import app
from smallem_cli.config import PRESETS
from smallem_cli.model.llama import Transformer
from smallem_cli.train import runstate
from smallem_cli.train.loop import new_mtp

ROOT = Path(__file__).resolve().parent.parent
# a target with an MTP module and a draft, both with the family tokenizer's 300 tokens
JOINT = dataclasses.replace(DRAFT_CFG, vocab_size=300, max_seq_len=512, mtp=True)
SOLO = dataclasses.replace(DRAFT_CFG, vocab_size=300, max_seq_len=512)


@pytest.fixture
def presets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(PRESETS, "joint", JOINT)
    monkeypatch.setitem(PRESETS, "solo", SOLO)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    text = tmp_path / "corpus.txt"
    text.write_text((CORPUS + "\n\n") * 300, encoding="utf-8")  # 19 chunks: one is held out
    return text


def train(family: Family, corpus: Path, tmp: Path, *args: str) -> Result:
    """`smallem train` on the tiny corpus: 2 sequences of 256 tokens a step."""
    argv = ["train", *args, "--text", str(corpus), "--data", str(tmp / "data"), "--tokenizer", str(family.tokenizer)]
    return CliRunner().invoke(app, [*argv, "--batch-size", "2"])


def refused(result: Result, *needles: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.stderr, result.exception)
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    flat = result.stderr.replace("\n", "")  # a long path may wrap
    for needle in needles:
        assert needle in flat, (needle, result.stderr)


def ok(result: Result) -> Result:
    assert result.exit_code == 0, (result.exit_code, result.stderr, result.exception)
    return result


# --- 1. the resume state runs no code ---------------------------------------------------------
class _Payload:
    """Unpickling this creates `marker`: the proof that loading ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (str(self.marker), "w")


@pytest.mark.parametrize("name", ["state.pt", "state.safetensors"])
def test_a_pickled_state_runs_no_code(family: Family, corpus: Path, tmp_path: Path, presets: None, name: str) -> None:
    run, marker = tmp_path / "run", tmp_path / "pwned"
    run.mkdir()
    torch.save({"modules": _Payload(marker), "step": 0}, run / name)
    out = tmp_path / "d.safetensors"
    result = train(family, corpus, tmp_path, "draft", "--preset", "solo", "--tokens", "512", "--out", str(out),
                   "--run-dir", str(run))  # fmt: skip
    assert not marker.exists(), "loading the run state ran code"
    refused(result, str(run / name))
    assert not out.exists()


def test_a_truncated_state_is_one_error_line(family: Family, corpus: Path, tmp_path: Path, presets: None) -> None:
    run, out = tmp_path / "run", tmp_path / "d.safetensors"
    common = ["draft", "--preset", "solo", "--out", str(out), "--run-dir", str(run)]
    ok(train(family, corpus, tmp_path, *common, "--tokens", "512"))
    state = run / "state.safetensors"
    data = state.read_bytes()
    state.write_bytes(data[: len(data) // 2])
    refused(train(family, corpus, tmp_path, *common, "--tokens", "1024", "--overwrite"), str(state))
    state.write_bytes(b"")
    refused(train(family, corpus, tmp_path, *common, "--tokens", "1024", "--overwrite"), str(state))


def test_a_resumed_run_equals_an_uninterrupted_one(family: Family, corpus: Path, tmp_path: Path, presets: None) -> None:
    """2 steps in one go, or 1 step, then a rerun that resumes for the second: the same weights
    (warm-up is by step, so the learning rates agree)."""
    whole, halves = tmp_path / "whole.safetensors", tmp_path / "halves.safetensors"
    ok(train(family, corpus, tmp_path, "draft", "--preset", "solo", "--tokens", "1024", "--out", str(whole),
             "--run-dir", str(tmp_path / "r1")))  # fmt: skip
    common = ["draft", "--preset", "solo", "--out", str(halves), "--run-dir", str(tmp_path / "r2")]
    ok(train(family, corpus, tmp_path, *common, "--tokens", "512"))
    assert not list((tmp_path / "r2").glob("*.tmp")) and [p.name for p in (tmp_path / "r2").iterdir()] == [
        "state.safetensors"
    ]
    ok(train(family, corpus, tmp_path, *common, "--tokens", "1024", "--overwrite"))
    a, b = load_file(whole), load_file(halves)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _state(tmp_path: Path) -> tuple[Path, dict[str, torch.nn.Module], torch.optim.Optimizer]:
    model = Transformer(DRAFT_CFG)
    opt = torch.optim.AdamW(model.parameters())
    loss = model.logits(model.hidden(torch.tensor([[1, 2, 3]]))).sum()
    loss.backward()
    opt.step()
    run = tmp_path / "run"
    runstate.save(run, {"model": model}, opt, runstate.Position(1, 3, 0.5), {"seed": 1})
    return run, {"model": model}, opt


def _rewrite(path: Path, change: dict[str, str] | None = None, drop: str | None = None) -> None:
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
    tensors = load_file(path)
    if drop:
        del tensors[drop]
    save_file(tensors, str(path), metadata=meta | (change or {}))


@pytest.mark.parametrize(
    ("change", "drop", "message"),
    [
        ({"format": "smallem"}, None, "not a smallem run state"),  # a foreign safetensors file
        ({"position": '{"step": -1, "tokens": 0, "elapsed": 0}'}, None, "bad step"),
        ({"position": "[1, 2"}, None, "cannot read"),
        ({"modules": '["mtp"]'}, None, "not ['model']"),
        (None, "rng.torch", "RNG"),
        (None, "module.model.norm.weight", "missing ['norm.weight']"),
        (None, "opt.0.exp_avg", "does not fit"),
    ],
)
def test_a_tampered_state_is_refused_whole(
    tmp_path: Path, change: dict[str, str] | None, drop: str | None, message: str
) -> None:
    run, modules, opt = _state(tmp_path)
    pos = runstate.load(run, modules, opt)
    assert pos == runstate.Position(1, 3, 0.5)
    _rewrite(run / "state.safetensors", change, drop)
    fresh = Transformer(DRAFT_CFG)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(runstate.RunStateError, match=re.escape(message)) as e:
        runstate.load(run, {"model": fresh}, torch.optim.AdamW(fresh.parameters()))
    assert str(run / "state.safetensors") in str(e.value) and "\n" not in str(e.value)
    assert all(  # checked before anything is loaded
        torch.equal(before[k], v) for k, v in fresh.state_dict().items()
    )


def test_an_interrupted_save_keeps_the_old_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run, modules, opt = _state(tmp_path)
    before = (run / "state.safetensors").read_bytes()

    def crash(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("smallem_cli.atomic.os.replace", crash)
    with pytest.raises(KeyboardInterrupt):
        runstate.save(run, modules, opt, runstate.Position(9, 9, 9.0), {})
    assert [p.name for p in run.iterdir()] == ["state.safetensors"]
    assert (run / "state.safetensors").read_bytes() == before


# --- 2. training replaces nothing unasked -------------------------------------------------------
def test_training_replaces_no_file_unasked(family: Family, corpus: Path, tmp_path: Path, presets: None) -> None:
    out, mtp = tmp_path / "ckpt" / "t.safetensors", tmp_path / "ckpt" / "mtp.safetensors"
    mtp.parent.mkdir()
    mtp.write_bytes(b"the user's module")
    common = ["target", "--preset", "joint", "--tokens", "512", "--out", str(out)]
    # the MTP module beside --out exists: refused before the corpus is even written
    refused(train(family, corpus, tmp_path, *common, "--run-dir", str(tmp_path / "r")), str(mtp), "--overwrite")
    assert mtp.read_bytes() == b"the user's module" and not (tmp_path / "data").exists()
    assert not (tmp_path / "r").exists() and not out.exists()
    # --mtp-out sends it elsewhere, and the end line says where
    other = tmp_path / "m2.safetensors"
    result = ok(train(family, corpus, tmp_path, *common, "--mtp-out", str(other), "--run-dir", str(tmp_path / "r")))
    assert out.is_file() and other.is_file() and mtp.read_bytes() == b"the user's module"
    assert str(other) in result.stderr.replace("\n", "")
    # the target itself now exists
    before = out.read_bytes()
    again = [*common, "--mtp-out", str(tmp_path / "m3.safetensors"), "--run-dir", str(tmp_path / "r")]
    refused(train(family, corpus, tmp_path, *again), str(out), "--overwrite")
    assert out.read_bytes() == before and not (tmp_path / "m3.safetensors").exists()
    # --overwrite: replaced
    ok(train(family, corpus, tmp_path, *common, "--overwrite", "--run-dir", str(tmp_path / "r4")))
    assert mtp.read_bytes() != b"the user's module"


def test_bad_destinations_are_refused(family: Family, corpus: Path, tmp_path: Path, presets: None) -> None:
    out = tmp_path / "t.safetensors"
    base = ["--tokens", "512", "--run-dir", str(tmp_path / "r")]
    both = ["target", "--preset", "joint", "--out", str(out), "--mtp-out", str(out), *base]
    refused(train(family, corpus, tmp_path, *both), "--mtp-out")
    draft = ["draft", "--preset", "solo", "--mtp-out", str(tmp_path / "m.safetensors"), "--out", str(out), *base]
    refused(train(family, corpus, tmp_path, *draft), "--mtp-out")
    mtp = ["mtp", "--target", str(family.target), "--out", str(family.target), "--overwrite", *base]
    refused(train(family, corpus, tmp_path, *mtp), str(family.target))
    (tmp_path / "folder").mkdir()
    refused(train(family, corpus, tmp_path, "draft", "--preset", "solo", "--out", str(tmp_path / "folder"), *base))
    assert not (tmp_path / "r").exists()


def test_the_installs_own_files_are_not_replaced_unasked(
    family: Family, corpus: Path, tmp_path: Path, presets: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no --out, the default destinations are the install's checkpoints/: the shipped
    tokenizer and MTP module stay unless --overwrite (training itself is stubbed out here, so
    that a failure cannot damage the install)."""
    if not (D.TOKENIZER.is_file() and D.MTP.is_file()):
        pytest.skip("no shipped checkpoints")
    calls: list[object] = []
    monkeypatch.setattr("smallem_cli.train.data.train_tokenizer", lambda *a, **k: calls.append(a))
    monkeypatch.setattr("smallem_cli.train.loop.train_member", lambda *a, **k: calls.append(a) or {})
    argv = ["train", "tokenizer", "--text", str(corpus), "--data", str(tmp_path / "data")]
    refused(CliRunner().invoke(app, argv), str(D.TOKENIZER), "--overwrite")
    result = train(family, corpus, tmp_path, "target", "--preset", "joint", "--run-dir", str(tmp_path / "r"))
    refused(result, str(D.MTP), "--overwrite")
    assert calls == []


def test_a_corpus_is_not_replaced_unasked(family: Family, corpus: Path, tmp_path: Path, presets: None) -> None:
    """`smallem data` and `train --text` write the split into a folder: the same corpus again is
    fine (nothing changes), another one needs --overwrite."""
    data = tmp_path / "data"
    ok(CliRunner().invoke(app, ["data", str(corpus), "--out", str(data)]))
    ok(CliRunner().invoke(app, ["data", str(corpus), "--out", str(data)]))
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    other = tmp_path / "other.txt"
    other.write_text((CORPUS.upper() + "\n\n") * 300, encoding="utf-8")
    refused(CliRunner().invoke(app, ["data", str(other), "--out", str(data)]), str(data / "train.txt"), "--overwrite")
    out, run = tmp_path / "d.safetensors", tmp_path / "r"
    result = train(family, other, tmp_path, "draft", "--preset", "solo", "--out", str(out), "--run-dir", str(run))
    refused(result, str(data / "train.txt"), "--overwrite")
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before and not out.exists() and not run.exists()
    ok(CliRunner().invoke(app, ["data", str(other), "--out", str(data), "--overwrite"]))
    assert (data / "train.txt").read_bytes() != before["train.txt"]


# --- 3. export keeps its input ------------------------------------------------------------------
def test_export_into_its_own_folder_is_refused(family: Family, tmp_path: Path) -> None:
    import shutil

    d = tmp_path / "fam"
    shutil.copytree(family.dir, d)
    before = sorted(p.name for p in d.iterdir())
    refused(CliRunner().invoke(app, ["export", str(d / "target.safetensors"), str(d), "--overwrite"]), str(d))
    assert sorted(p.name for p in d.iterdir()) == before
    # the tokenizer inside the folder, the checkpoint elsewhere
    ckpt = tmp_path / "t.safetensors"
    shutil.copyfile(family.target, ckpt)
    argv = ["export", str(ckpt), str(d), "--tokenizer", str(d / "tokenizer.json"), "--overwrite"]
    refused(CliRunner().invoke(app, argv), "tokenizer.json")
    assert sorted(p.name for p in d.iterdir()) == before
    # a folder above the input's
    refused(CliRunner().invoke(app, ["export", str(d / "target.safetensors"), str(tmp_path), "--overwrite"]))
    assert sorted(p.name for p in d.iterdir()) == before
    # and the message for a non-empty folder names the option
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    refused(CliRunner().invoke(app, ["export", str(ckpt), str(tmp_path / "full")]), "--overwrite")


_SIGTERM_EXPORT = """
import os, signal, sys, time
from smallem_cli.interop import hf
real = hf.checkpoint.write_safetensors
def killed(*args):
    real(*args)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
hf.checkpoint.write_safetensors = killed
hf.export_hf(sys.argv[1], sys.argv[2], sys.argv[3])
"""


def test_sigterm_during_export_leaves_no_temp_folder(family: Family, tmp_path: Path) -> None:
    out = tmp_path / "exports" / "hf"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-c", _SIGTERM_EXPORT, str(family.target), str(out), str(family.tokenizer)]
    proc = subprocess.run(argv, env=env, capture_output=True, timeout=120)
    assert proc.returncode in (128 + signal.SIGTERM, -signal.SIGTERM), proc.stderr
    assert list((tmp_path / "exports").iterdir()) == [], "an interrupted export left a folder"


def test_export_clears_what_dead_exports_left(family: Family, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    dead = 999_999_999  # above any pid_max: no such process
    (tmp_path / f".hf.{dead}.tmp").mkdir()
    (tmp_path / f".hf.{dead}.tmp" / "model.safetensors").write_text("half")
    (tmp_path / f".hf.{dead}.old").mkdir()  # a swap that died half way: the user's folder
    (tmp_path / f".hf.{dead}.old" / "mine").write_text("mine")
    (tmp_path / ".hf.1.tmp").mkdir()  # pid 1 lives: not ours to touch
    result = CliRunner().invoke(app, ["export", str(family.target), str(out)])
    refused(result, "--overwrite")  # the old folder is back, and not replaced unasked
    assert (out / "mine").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hf.1.tmp", "hf"]


# --- 6. a run repeats bit for bit ---------------------------------------------------------------
def test_joint_training_is_reproducible(family: Family, corpus: Path, tmp_path: Path, presets: None) -> None:
    """The same seed twice gives the same target and MTP module, whatever the global RNG
    (a fresh process seeds it at random)."""
    files = []
    for i, global_seed in enumerate((1, 2)):
        torch.manual_seed(global_seed)
        out, mtp = tmp_path / f"t{i}.safetensors", tmp_path / f"m{i}.safetensors"
        ok(train(family, corpus, tmp_path, "target", "--preset", "joint", "--tokens", "1024", "--out", str(out),
                 "--mtp-out", str(mtp), "--run-dir", str(tmp_path / f"r{i}")))  # fmt: skip
        files.append((load_file(out), load_file(mtp)))
    for a, b in zip(*files, strict=True):
        assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []


def test_a_fresh_mtp_module_follows_the_seed_alone() -> None:
    torch.manual_seed(1)
    a = new_mtp(JOINT, 7).state_dict()
    after = torch.rand(1)
    torch.manual_seed(2)
    b = new_mtp(JOINT, 7).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    torch.manual_seed(1)
    assert torch.equal(torch.rand(1), after)  # the global RNG is left as it was
    assert not torch.equal(new_mtp(JOINT, 8).eh_proj.weight, a["eh_proj.weight"])
