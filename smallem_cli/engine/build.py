"""An engine for a loaded target and a named proposer (the names `smallem generate` takes)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import aot, family
from .. import defaults as D
from ..ngram import Fallback, NgramProposer
from ..proposers import DraftProposer, MTPProposer, NoProposer, Proposer
from .forward import slab_for
from .pool import PagePool
from .proposers import BatchProposer, DraftGuess, FallbackGuess, MTPGuess, NgramGuess, NoGuess
from .runner import Target
from .scheduler import Engine, round_ahead


def batch_proposer(one: Proposer, pool: PagePool) -> BatchProposer:
    """The batched form of a loaded proposer (`family.load_proposer` checked and loaded it)."""
    if isinstance(one, NoProposer):
        return NoGuess()
    if isinstance(one, NgramProposer):
        return NgramGuess(one.vocab_size, one.index.min_n, one.index.max_n, one.guess_cost)
    if isinstance(one, Fallback):
        first, other = batch_proposer(one.first, pool), batch_proposer(one.other, pool)
        assert isinstance(first, NgramGuess) and isinstance(other, DraftGuess | MTPGuess)
        return FallbackGuess(first, other)
    if isinstance(one, DraftProposer):
        return DraftGuess(one.model, pool, one.head, one.name)
    if isinstance(one, MTPProposer):
        return MTPGuess(one.target, one.mtp, pool, one.head)
    raise ValueError(f"proposer {one.name!r} has no batched form")


def pool_pages(max_batch: int, context: int, page_size: int, tree: tuple[int, int] | None = None) -> int:
    """Enough for max_batch sequences at the full context: a request that fits the context
    always fits the pool alone, and preemption is for smaller pools (`n_pages`)."""
    return max_batch * (-(-(context + round_ahead(D.MAX_K, tree)) // page_size))


def build_engine(
    tgt: family.Target,
    proposer: str,
    device: torch.device,
    *,
    k: int | None,
    max_batch: int,
    proposer_vocab: int | None,
    eot: int | None,
    decode: Callable[[list[int]], str],
    n_pages: int | None = None,
    page_size: int = D.PAGE_SIZE,
    tree: tuple[int, int] | None = None,
    native: str | None = None,
    native_log: Callable[[str], None] | None = None,
    weights: str = D.PROPOSER_WEIGHTS,
) -> Engine:
    """k None: the proposer's default per mode, capped under load for greedy requests (`D.LOAD_K`).
    tree: (guesses per tree, candidates per node) for token trees (`tree_guess`), MTP only.
    native: give the target and the proposer's models this native engine's steps ("native" or
    "native-avx2", `native.ENGINES`: every pass of the batch one C call), None: none; native_log
    says why a model cannot have them (None: nothing said).
    weights: how the native engine stores the proposer's matrices (`family.load_proposer`)."""
    model = tgt.model
    pool = PagePool(n_pages or pool_pages(max_batch, model.cfg.max_seq_len, page_size, tree), page_size)
    slab = slab_for(model, pool.n_pages * page_size, device)
    # The greedy and the sampled proposer heads differ (`D.PROPOSER_VOCAB`); a batch mixes modes,
    # so the head is chosen by what the batch serves by default: greedy's.
    vocab = D.proposer_vocab(True, proposer_vocab)
    one = family.load_proposer(proposer, tgt, device, vocab, tree=tree, weights=weights)(1)
    bp = batch_proposer(one, pool)
    if proposer == "none":
        kg = ks = 0
    else:
        kg = k if k is not None else D.default_k(proposer, True)
        ks = k if k is not None else D.default_k(proposer, False)
    if native is not None:
        aot.prepare_engine(native, model, one, [max(kg, ks, 1)], native_log)
    one.release()
    return Engine(
        Target(model, slab, pool),
        bp,
        kg,
        auto_k=k is None,
        max_batch=max_batch,
        eot=eot,
        decode=decode,
        k_sample=ks,
        tree=tree,
    )
