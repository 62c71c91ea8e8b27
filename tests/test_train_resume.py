"""A `smallem train` interrupted by Ctrl-C keeps its steps: the state is saved at the last whole step, a line says
so, and the same command resumes (saying where it stands at once), finishes and writes its checkpoint, equal to
an uninterrupted run's. Interrupted during the final evaluation, the rerun evaluates and writes it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CORPUS, Family
from safetensors import safe_open
from safetensors.torch import load_file
from test_safety_train import SOLO, ok, train

from smallem_cli.config import PRESETS
from smallem_cli.train import loop

STEP = 2 * 256  # tokens a step: `train`'s --batch-size 2 of 256 tokens
STEPS = 4


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    text = tmp_path / "corpus.txt"
    text.write_text((CORPUS + "\n\n") * 300, encoding="utf-8")
    return text


@pytest.fixture(autouse=True)
def solo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(PRESETS, "solo", SOLO)


def position(run: Path) -> dict[str, Any]:
    with safe_open(str(run / "state.safetensors"), framework="pt") as f:
        return json.loads((f.metadata() or {})["position"])


def draft(family: Family, corpus: Path, tmp_path: Path, out: Path, run: Path) -> Any:
    args = ["draft", "--preset", "solo", "--tokens", str(STEPS * STEP), "--out", str(out), "--run-dir", str(run)]
    return train(family, corpus, tmp_path, *args)


def interrupt_when(monkeypatch: pytest.MonkeyPatch, name: str, at: int) -> None:
    """loop.NAME raises KeyboardInterrupt (a Ctrl-C) on its call number `at` (from 1), as a signal would there."""
    real, calls = getattr(loop, name), [0]

    def hook(*args: Any, **kw: Any) -> Any:
        calls[0] += 1
        if calls[0] == at:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(loop, name, hook)


def test_a_ctrl_c_saves_the_steps_and_the_rerun_finishes(
    family: Family, corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = tmp_path / "whole.safetensors"
    ok(draft(family, corpus, tmp_path, whole, tmp_path / "r1"))
    out, run = tmp_path / "d.safetensors", tmp_path / "r2"
    with monkeypatch.context() as m:
        interrupt_when(m, "batch", 3)  # the third step's batch: two whole steps before it
        res = draft(family, corpus, tmp_path, out, run)
    assert res.exit_code == 130 and not out.exists()
    assert res.stderr.splitlines()[-1] == f"solo: interrupted at step 2: the same command resumes the run from {run}"
    assert position(run)["step"] == 2  # saved at once, not 120 s of training later
    res = ok(draft(family, corpus, tmp_path, out, run))
    assert res.stderr.splitlines()[0].startswith(f"solo: resuming {run}: step 2, {2 * STEP:,} tokens")
    assert out.is_file() and position(run)["step"] == STEPS
    a, b = load_file(whole), load_file(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # as if never interrupted


def test_a_ctrl_c_in_an_update_keeps_no_half_updated_state(
    family: Family, corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, run = tmp_path / "d.safetensors", tmp_path / "r"
    with monkeypatch.context() as m:
        real, calls = torch.optim.AdamW.step, [0]

        def step(self: torch.optim.AdamW, *a: Any, **kw: Any) -> Any:
            calls[0] += 1
            if calls[0] == 3:
                raise KeyboardInterrupt
            return real(self, *a, **kw)

        m.setattr(torch.optim.AdamW, "step", step)
        res = draft(family, corpus, tmp_path, out, run)
    assert res.exit_code == 130 and "interrupted in step 3's update" in res.stderr
    assert not (run / "state.safetensors").exists()  # nothing saved since the start: nothing to resume
    ok(draft(family, corpus, tmp_path, out, run))
    assert out.is_file() and position(run)["step"] == STEPS


def test_a_ctrl_c_in_the_final_evaluation_then_a_rerun_writes_the_checkpoint(
    family: Family, corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The case seen: the budget spent and the state saved, the evaluation interrupted; the rerun said nothing
    while it evaluated. It now says where it stands, then that it evaluates, and writes the checkpoint."""
    out, run = tmp_path / "d.safetensors", tmp_path / "r"
    with monkeypatch.context() as m:
        interrupt_when(m, "evaluate", 1)
        res = draft(family, corpus, tmp_path, out, run)
    assert res.exit_code == 130 and not out.exists() and position(run)["step"] == STEPS
    res = ok(draft(family, corpus, tmp_path, out, run))
    lines = res.stderr.splitlines()
    where = re.escape(f"solo: resuming {run}: step {STEPS}, {STEPS * STEP:,} tokens, ")
    assert re.fullmatch(where + r"\d+ s trained; its budget is spent", lines[0]), lines[0]
    assert lines[1].startswith("solo: trained; evaluating on the validation split")
    assert out.is_file() and f"steps={STEPS}" in lines[-1]
