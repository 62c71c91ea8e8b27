"""`smallem eval`'s agreement at depth 1..4: the proposer's chain against the target's greedy
continuation, computed with whole-sequence passes, must be what the decode loop guesses."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from conftest import MAX_LEN

from smallem_cli.spec.proposers import DraftProposer, MTPProposer
from smallem_cli.train.evaluate import _greedy_chain, _mtp_chain, chain_agreement, contexts


def stream(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).numpy()


def test_the_target_as_its_own_draft_keeps_everything(target) -> None:
    ids = stream(2000, target.cfg.vocab_size)
    kept = chain_agreement(target, ids, {"self": target}, None, count=16, length=24)
    assert kept["self"] == [1.0, 1.0, 1.0, 1.0]


def test_kept_rates_fall_with_depth(target, draft, mtp) -> None:
    ids = stream(3000, target.cfg.vocab_size, 1)
    kept = chain_agreement(target, ids, {"draft": draft}, mtp, count=32, length=24)
    for rates in kept.values():
        assert len(rates) == 4 and all(a >= b for a, b in itertools.pairwise(rates))
    assert kept["draft"][0] < 1.0  # a random draft disagrees somewhere


@torch.inference_mode()
def test_chains_are_the_decode_loops_guesses(target, draft, mtp) -> None:
    """From each context, the proposers' first round of guesses in the decode loop (caches,
    packed weights) equals the whole-sequence chain that eval computes."""
    x = contexts(stream(2000, target.cfg.vocab_size, 2), 6, 20, 4)  # [6, 20]
    mtp_chain = _mtp_chain(target, mtp, x, 4)
    draft_chain = _greedy_chain(lambda t: draft.logits(draft.hidden(t)[:, -1]), x, 4)
    for row, m_eval, d_eval in zip(x, mtp_chain, draft_chain, strict=True):
        cache = target.new_cache(4)
        _, hidden = target(row[:-1], cache, cache.new_sequence())
        m = MTPProposer(target, mtp, MAX_LEN)
        m.start(row[:-1], row[-1:], hidden)  # the context's last token plays `last`
        assert m.propose(4, None, None)[0].tolist() == m_eval.tolist()
        d = DraftProposer(draft, MAX_LEN)
        d.start(row[:-1], row[-1:], hidden)
        assert d.propose(4, None, None)[0].tolist() == d_eval.tolist()
