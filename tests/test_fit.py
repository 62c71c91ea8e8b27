"""The distillation objective (`fit.py`) and `smallem eval`'s sampled acceptance."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, random_model

from smallem_cli.train.evaluate import evaluate_family, windows
from smallem_cli.train.fit import acceptance, fit_loss

V = 64


def _logits(seed: int, *shape: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(*shape, V, generator=torch.Generator().manual_seed(seed)) * scale


def test_the_fit_is_distillation() -> None:
    """KL(p || q) at T = 1 over the whole vocabulary, and the kept probability read beside it."""
    t, s = _logits(0, 3, 5), _logits(1, 3, 5)
    lp = F.log_softmax(t, -1)
    loss, extra = fit_loss(lp, s)
    ref = F.kl_div(F.log_softmax(s, -1).flatten(0, 1), lp.flatten(0, 1), log_target=True, reduction="batchmean")
    torch.testing.assert_close(loss, ref)
    assert set(extra) == {"kl@1", "accept@1"}
    torch.testing.assert_close(extra["accept@1"], acceptance(t, s, None, 1.0).mean())


@pytest.mark.parametrize("T", [1.0, 0.7])
def test_acceptance_is_the_kept_probability(T: float) -> None:
    """sum over the cut of min(p_T, q_T), p over the whole vocabulary, q over the cut's tokens."""
    t = _logits(2, 4)
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:40]
    s = _logits(3, 4)[:, :40]
    p, q = torch.softmax(t / T, -1)[:, ids], torch.softmax(s / T, -1)
    torch.testing.assert_close(acceptance(t, s, ids, T), torch.minimum(p, q).sum(-1))


def test_eval_reads_sampled_acceptance() -> None:
    """A draft that is the target keeps every sampled guess over the whole vocabulary, and over a
    cut exactly p's mass on the cut; another model keeps fewer."""
    target, other = random_model(TINY, seed=0, scale=1.0), random_model(TINY, seed=1, scale=1.0)
    ids = np.random.default_rng(0).integers(0, TINY.vocab_size, 300).astype(np.uint16)
    cut = torch.arange(32)
    same = {"same": target, "cut": target, "other": other}
    with torch.no_grad():
        reports = {r.name: r for r in evaluate_family(target, ids, 300, same, None, seq_len=64, cuts={"cut": cut})}
        logits = torch.cat([target.logits(target.hidden(w[:, :-1]))[0] for w in windows(ids, 64)])  # every position
        mass = [torch.softmax(logits / T, -1)[:, :32].sum(-1).mean().item() for T in (1.0, 0.7)]
    assert reports["same"].sampled == pytest.approx([1.0, 1.0], abs=1e-5)
    assert reports["cut"].sampled == pytest.approx(mass, rel=1e-4)
    assert all(a < 0.95 for a in reports["other"].sampled or [1.0])
