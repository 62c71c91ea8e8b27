"""`smallem data` and `smallem train` check their options, together, and every destination before any model loads:
one `error:` line, exit 2, in a moment, nothing loaded, encoded or written."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from conftest import CORPUS, Family
from typer.testing import CliRunner

from smallem_cli.cli.app import app

LOADS = ("engine.family.load_target", "model.checkpoint.load_model", "train.data.token_file", "train.loop.train_member")


@pytest.fixture
def loaded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What was loaded (or encoded, or trained): each records its name instead."""
    seen: list[str] = []
    for name in LOADS:
        monkeypatch.setattr(f"smallem_cli.{name}", lambda *a, _n=name, **k: seen.append(_n))
    return seen


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """A corpus folder as `smallem data` writes it."""
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "train.txt").write_text(CORPUS * 20, encoding="utf-8")
    (d / "val.txt").write_text(CORPUS, encoding="utf-8")
    return d


def refused(argv: list[str], loaded: list[str], *words: str) -> None:
    t0 = time.monotonic()
    res = CliRunner().invoke(app, argv)
    took = time.monotonic() - t0
    assert res.exit_code == 2, (res.exit_code, res.stderr, res.exception)
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr
    assert all(w in res.stderr.replace("\n", "") for w in words), (words, res.stderr)
    assert loaded == [] and took < 2, (loaded, took)


# --- 13. data: --continuations' options without it, and the other combinations -----------------
SRC = "{source}"  # the corpus folder, in an argument list below


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--continuations", "0", "--chat", "--target", "G.gguf"], ("--chat applies to --continuations N",)),
        (["--target", "G.gguf"], ("--target applies to --continuations N",)),
        (["--seed", "3"], ("--seed applies",)),
        (["--new-tokens", "9"], ("--new-tokens applies",)),
        (["--source", SRC], ("--source applies",)),
        (["--continuations", "-1"], ("--continuations must be >= 0",)),
        (["--continuations", "4", "--chat", "--context-tokens", "8"], ("--context-tokens", "not --chat")),
        (["--continuations", "4", "--source", SRC, "--new-tokens", "0"], ("--new-tokens must be >= 1",)),
        (["--continuations", "4", "--source", SRC, "--sampled-every", "-1"], ("--sampled-every must be >= 0",)),
        (["--continuations", "4", "--source", SRC, "--seed", "-1"], ("--seed must be between 0",)),
        (["--continuations", "5000", "--chat"], ("at most 960 instructions",)),
        (["--continuations", "4", "--source", SRC, "--target", "nowhere.gguf"], ("--target nowhere.gguf",)),
    ],
)
def test_data_options_are_checked_together(
    source: Path, tmp_path: Path, loaded: list[str], args: list[str], words: tuple[str, ...]
) -> None:
    out = tmp_path / "out"
    refused(["data", "--out", str(out), *(str(source) if a == SRC else a for a in args)], loaded, *words)
    assert not out.exists()


# --- 14. destinations, before any model -----------------------------------------------------------
def test_data_destinations_before_the_target_loads(source: Path, tmp_path: Path, loaded: list[str]) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    cont = ["data", "--continuations", "4", "--source", str(source), "--target", str(source / "train.txt")]
    refused([*cont, "--out", str(a_file)], loaded, f"--out {a_file} is a file, not a folder")
    refused([*cont, "--out", str(a_file / "sub")], loaded, f"{a_file} is a file, not a folder")
    full = tmp_path / "full"
    full.mkdir()
    (full / "train.txt").write_text("mine")
    refused([*cont, "--out", str(full)], loaded, str(full / "train.txt"), "--overwrite")
    refused(["data", str(source / "train.txt"), "--out", str(a_file)], loaded, "is a file, not a folder")
    assert a_file.read_text() == "mine" and (full / "train.txt").read_text() == "mine"


def train(family: Family, kind: str, tmp_path: Path, *args: str) -> list[str]:
    out = ["--out", str(tmp_path / "new.safetensors")] if "--out" not in args else []
    return ["train", kind, "--data", str(tmp_path), "--tokenizer", str(family.tokenizer), *out, *args]


def test_train_destinations_before_any_work(family: Family, tmp_path: Path, loaded: list[str]) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    run = ["--run-dir", str(tmp_path / "run")]
    refused(train(family, "mtp", tmp_path, "--out", str(a_file / "m.safetensors"), *run), loaded, "is a file")
    refused(train(family, "mtp", tmp_path, "--run-dir", str(a_file)), loaded, f"--run-dir {a_file} is a file")
    refused(train(family, "draft", tmp_path, "--out", "/dev/null", "--overwrite", *run), loaded, "character device")
    refused(train(family, "mtp", tmp_path, "--out", str(a_file), *run), loaded, "exists", "--overwrite")
    refused(train(family, "target", tmp_path, "--text", str(a_file), "--data", str(a_file), *run), loaded, "--data")
    refused(train(family, "mtp", tmp_path, "--target", str(tmp_path / "nowhere"), *run), loaded, "--target")
    refused(train(family, "mtp", tmp_path, "--init", str(tmp_path / "nowhere"), *run), loaded, "--init")
    refused(train(family, "draft", tmp_path, "--preset", "huge", *run), loaded, "unknown preset 'huge'")
    assert a_file.read_text() == "mine" and not (tmp_path / "run").exists()


# --- 15. train's numbers, each one line, before any model ------------------------------------------
@pytest.mark.parametrize("kind", ["mtp", "draft", "target"])
@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--lr", "0"], "--lr must be a finite number > 0"),
        (["--lr", "nan"], "--lr must be a finite number > 0"),
        (["--budget", "inf"], "--budget must be a finite number"),
        (["--budget", "-1"], "--budget must be a finite number"),
        (["--tokens", "-1"], "--tokens must be >= 0"),
        (["--seed", "-1"], "--seed must be between 0 and 2^63-1"),
        (["--mtp-weight", "nan"], "--mtp-weight must be a finite number >= 0"),
        (["--feature-weight", "-0.5"], "--feature-weight must be a finite number >= 0"),
    ],
)
def test_train_numbers(
    family: Family, tmp_path: Path, loaded: list[str], kind: str, args: list[str], words: str
) -> None:
    refused(train(family, kind, tmp_path, *args), loaded, words)


@pytest.mark.parametrize(
    ("kind", "args", "words"),
    [
        ("draft", ["--feature-weight", "1"], "--feature-weight applies to train mtp"),
        ("target", ["--distill"], "--distill applies to train draft"),
        ("mtp", ["--distill"], "--distill applies to train draft"),
        ("tokenizer", ["--init", "x.safetensors"], "--init applies"),
    ],
)
def test_train_options_of_another_kind(
    family: Family, tmp_path: Path, loaded: list[str], kind: str, args: list[str], words: str
) -> None:
    refused(train(family, kind, tmp_path, *args), loaded, words)


def test_a_training_split_too_short_is_told_before_the_teacher_loads(
    family: Family, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The teacher loads after the corpus is encoded and checked: a split too short for one window is one line."""
    (tmp_path / "train.txt").write_text("In the beginning", encoding="utf-8")
    (tmp_path / "val.txt").write_text(CORPUS, encoding="utf-8")
    seen: list[Any] = []
    monkeypatch.setattr("smallem_cli.model.checkpoint.load_model", lambda *a, **k: seen.append(a))
    argv = train(family, "mtp", tmp_path, "--target", str(family.target), "--run-dir", str(tmp_path / "run"))
    refused(argv, seen, "the training split", "a step needs 259")
