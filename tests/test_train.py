"""Training: a draft distilled from a frozen target learns the target's own guesses."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import DRAFT_CFG, Trained, _FakeClock

from smallem_cli.evaluate import evaluate_family
from smallem_cli.model import Transformer
from smallem_cli.train import TrainSettings, train_draft_distill


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
    monkeypatch.setattr("smallem_cli.train.time", SimpleNamespace(perf_counter=_FakeClock().perf_counter))
    model, facts = train_draft_distill(trained.model, student, stream, stream[:400], settings, tmp_path)
    after = _agreement(trained.model, model, stream[:400])
    assert facts["steps"] == 150 and "val_loss" in facts
    assert before < 0.3, before
    assert after > 0.9, (before, after)
    # the teacher stays frozen
    assert all(torch.equal(a, b) for a, b in zip(target_params, trained.model.parameters(), strict=True))


def test_distilling_across_vocabularies_is_refused(trained: Trained, tmp_path: Path) -> None:
    from dataclasses import replace

    other = Transformer(replace(DRAFT_CFG, vocab_size=DRAFT_CFG.vocab_size + 1))
    with pytest.raises(ValueError, match="vocabulary"):
        train_draft_distill(
            trained.model, other, np.zeros(100, np.uint16), np.zeros(100, np.uint16), TrainSettings(), tmp_path
        )
