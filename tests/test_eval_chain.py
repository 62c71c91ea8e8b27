"""`smallem eval`'s agreement at depth 1..4: the proposer's chain against the target's greedy
continuation, computed with whole-sequence passes, must be what the decode loop guesses."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from smallem_cli.backends.engines import Backend
from smallem_cli.engine.forward import slab_for
from smallem_cli.engine.proposers import DraftProposer, MTPProposer
from smallem_cli.engine.request import Request
from smallem_cli.engine.sequence import Seq
from smallem_cli.engine.target import TargetRunner
from smallem_cli.kv.pool import PagePool, pages_for
from smallem_cli.spec.head import Head
from smallem_cli.stats import Stats
from smallem_cli.train.evaluate import _greedy_chain, _mtp_chain, chain_agreement, contexts

PAGE = 16


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


def seq(uid: int, row: torch.Tensor, k: int) -> Seq:
    """A greedy sequence whose context is `row`: the last token not yet in the cache (`last`)."""
    st = Stats("eval", k)
    tokens = row.tolist()
    s = Seq(Request(uid, uid, tuple(tokens), k), uid, torch.Generator(), None, st, k, tokens)
    s.last = row[-1:]
    return s


@torch.inference_mode()
@pytest.mark.parametrize("together", [True, False])
def test_chains_are_the_decode_loops_guesses(target, draft, mtp, together: bool) -> None:
    """From each context, the batched proposers' first round of guesses in the engine (their
    slabs over the page pool, packed weights) equals the whole-sequence chain that eval computes:
    the six contexts in one batch, and each alone (its pages in order)."""
    k = 4
    x = contexts(stream(2000, target.cfg.vocab_size, 2), 6, 20, k)  # [6, 20]
    mtp_chain = _mtp_chain(target, mtp, x, k)
    draft_chain = _greedy_chain(draft, x, k)
    groups = [list(range(6))] if together else [[i] for i in range(6)]
    for group in groups:
        pool = PagePool(len(group) * pages_for(x.shape[1] + k + 2, PAGE), PAGE)
        runner = TargetRunner(target, slab_for(target, pool.n_pages * PAGE, torch.device("cpu")), pool)
        seqs = [seq(i + 1, x[i], k) for i in group]
        for s in seqs:
            pool.add(s.uid)
            pool.reserve(s.uid, x.shape[1] + k + 2)
        fed = [x[i, :-1] for i in group]  # the context but its last token: the target's cache
        counts = [f.shape[0] for f in fed]
        _, hidden, _ = runner.verify_pass(seqs, torch.cat(fed), counts)  # the target's states
        for s in seqs:
            s.cached = counts[0]
        proposers = (
            (MTPProposer(target, mtp, pool, Head(target), Backend()), mtp_chain),
            (DraftProposer(draft, pool, Head(draft), "draft", Backend()), draft_chain),
        )
        for p, want in proposers:
            p.start(seqs, fed, list(hidden.split(counts)))  # the context's last token plays `last`
            got = p.propose(seqs, [k] * len(seqs))
            for i, (tokens, q) in zip(group, got, strict=True):
                assert q is None and tokens.tolist() == want[i].tolist(), (p.name, i)
