"""Training the MTP module on its chain: the parallel unrolled states equal the chain it runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TINY, random_model, random_mtp

from smallem_cli.train.chain import chain_states
from smallem_cli.train.loop import TrainSettings, distill, new_mtp


def step_by_step(target, mtp, h: torch.Tensor, x: torch.Tensor, t: int, depth: int) -> list[torch.Tensor]:
    """The chain started at position t as the module runs it (`evaluate._mtp_chain`, with the
    text's tokens for its guesses): the true pairs up to t, then each state fed back."""
    hs, toks = h[:, : t + 1], x[:, 1 : t + 2]
    out = []
    for d in range(1, depth + 1):
        T = hs.shape[1]
        states = mtp(hs, target.embed_tokens(toks), target.cos[:T], target.sin[:T])
        out.append(states[:, -1])
        hs = torch.cat([hs, states[:, -1:]], dim=1)
        toks = torch.cat([toks, x[:, t + d + 1 : t + d + 2]], dim=1)
    return out


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_parallel_chain_equals_the_chain_it_runs(kv_heads: int) -> None:
    from dataclasses import replace

    cfg = replace(TINY, n_kv_heads=kv_heads)
    target, mtp = random_model(cfg, seed=0, scale=1.0), random_mtp(cfg, seed=1, scale=3.0)
    x = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = target.hidden(x)
        outs = chain_states(mtp, target, h, x, depth=4)
        assert [o.shape[1] for o in outs] == [23, 22, 21, 20]
        for t in (0, 5, 19):
            for d, ref in enumerate(step_by_step(target, mtp, h, x, t, 4), 1):
                torch.testing.assert_close(outs[d - 1][:, t], ref, atol=1e-5, rtol=1e-4)


def test_chain_training_lowers_every_step(tmp_path) -> None:
    """A few steps of chain training on a periodic stream lower the KL of every depth."""
    target = random_model(TINY, seed=0, scale=1.0)
    stream = np.tile(np.random.default_rng(0).integers(1, TINY.vocab_size, 40), 60).astype(np.uint16)
    first, last = {}, {}

    def seen(p) -> None:
        (first if not first else last).update(p.extra)

    s = TrainSettings(budget_s=1e9, budget_tokens=40 * 8 * 34, batch_size=8, seq_len=32, lr=3e-3, warmup_steps=2,
                      save_every_s=1e9, eval_every_s=1e9, chain=3)  # fmt: skip
    facts = distill(target, new_mtp(TINY, s.seed), stream, stream[:400], s, tmp_path / "run", on_progress=seen)
    kls = [f"kl@1/{d}" for d in (1, 2, 3)]
    assert facts["chain_depth"] == 3 and set(first) == {*kls, "accept@1/1", "accept@1/2", "accept@1/3"}
    assert all(last[k] < first[k] for k in kls)
