"""The one way to build an engine: `build(EngineConfig)`, its pool sized by `config.plan_pool` and grown while the
requests need it (`grower`), its proposer made from the loaded one (`proposer_for`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import defaults
from ..backends.engines import Backend
from ..kv.pool import PagePool, pages_for
from ..model.llama import MTPModule, Transformer
from ..spec.suffix import SuffixCache
from . import cost
from .config import EngineConfig, cache_budget, plan_pool
from .family import LoadedProposer
from .forward import slab_for
from .proposers import DraftProposer, FallbackProposer, MTPProposer, NgramProposer, NoProposer, Proposer
from .scheduler import Engine
from .target import TargetRunner
from .tree_proposer import TreeProposer


def build(config: EngineConfig, proposer: Proposer | None = None) -> Engine:
    """An engine for `config`, backend prepared, pool allocated; UsageError where no sequence fits (strict: not all).
    `proposer`, if given, is the engine's instead of the loaded one's (a model-free one: `eagle_data.Recorder`)."""
    target, p, backend = config.target, config.proposer, config.backend
    backend.prepare(target, p.models, None, p.models if p.int8 else ())
    device = target.device
    plan = plan_pool(config, 0 if config.pages else cache_budget(device))  # measured with the models loaded
    pool = PagePool(plan.pages, defaults.PAGE_SIZE)
    cache = SuffixCache(config.suffix_tokens) if p.lookup == defaults.SUFFIX else None
    proposer = proposer or proposer_for(p, target, pool, backend, cache, config.suffix_shared)
    slab = slab_for(target, pool.n_pages * pool.page_size, device)
    runner = TargetRunner(target, slab, pool, backend.steps(target), proposer.taps)
    trees = None
    if p.tree is not None:
        if not isinstance(proposer, MTPProposer):
            raise ValueError(f"token trees need the MTP module as proposer, not {proposer.name!r}")
        trees = TreeProposer(proposer, *p.tree)
    grow = grower(runner, proposer) if plan.max_pages > plan.pages else None
    engine = Engine(config, plan, runner, proposer, trees, grow)
    if config.k is None and (k := measured_k(p, runner, proposer)) is not None:
        engine.k = engine.k_sample = k
    return engine


def measured_k(p: LoadedProposer, runner: TargetRunner, proposer: Proposer) -> int | None:
    """An EAGLE head's default k on the native engine: the best by the cost model on this machine's costs (measured
    once a loaded head) and its acceptance (`engine.cost`); None for the others, whose defaults are `defaults.K`."""
    head = proposer.other if isinstance(proposer, FallbackProposer) else proposer
    if not p.acceptance or not isinstance(head, MTPProposer) or head.steps is None or runner.steps is None:
        return None
    if p.measured_k is None:
        if (costs := cost.measure(runner, head, defaults.MAX_EAGLE_K)) is None:
            return None
        p.measured_k = cost.best_k(p.acceptance, costs[1], costs[0])
    if isinstance(proposer, FallbackProposer):  # a lookup's long copies keep their own k
        return max(p.measured_k, defaults.default_k(proposer.first.name, True))
    return p.measured_k


def auto_k(target: Transformer, p: LoadedProposer, backend: Backend) -> int | None:
    """`measured_k` for `p` on `backend` (prepared), on an engine of its own."""
    engine = build(EngineConfig(target, p, backend, k=None, pages=pages_for(1024, defaults.PAGE_SIZE)))
    return measured_k(p, engine.t, engine.proposer)


def proposer_for(
    p: LoadedProposer, target: Transformer, pool: PagePool, backend: Backend, cache: SuffixCache | None = None,
    share: bool = True,
) -> Proposer:  # fmt: skip
    """The engine's proposer for a loaded one, its slab (a model's) over `pool`; the suffix lookup's texts in
    `cache`, added to it where `share`."""
    model: DraftProposer | MTPProposer | None = None
    if isinstance(p.model, MTPModule):
        assert p.head is not None
        model = MTPProposer(target, p.model, pool, p.head, backend)
    elif p.model is not None:
        assert p.head is not None
        model = DraftProposer(p.model, pool, p.head, p.name.removeprefix(f"{p.lookup}+"), backend)
    if not p.lookup:
        return model or NoProposer()
    args = target.cfg.vocab_size, defaults.NGRAM_MIN, defaults.NGRAM_MAX, defaults.NGRAM_DRAFT_COST
    lookup = NgramProposer(*args, cache, share)
    return lookup if model is None else FallbackProposer(lookup, model)


def _widened(slab: torch.Tensor, slots: int) -> torch.Tensor:
    """`slab` with `slots` slots, zeros after its own (attention reads a masked slot too: it must be finite)."""
    wide = slab.new_zeros(*slab.shape[:3], slots, slab.shape[4])
    wide[:, :, :, : slab.shape[3]].copy_(slab)
    return wide


def grower(target: TargetRunner, proposer: Proposer) -> Callable[[int], bool]:
    """The engine's `grow`: the pool and its slabs widened to n pages; False, unchanged, where memory is short."""
    other = proposer.other if isinstance(proposer, FallbackProposer) else proposer
    holders = [other] if isinstance(other, DraftProposer | MTPProposer) else []

    def grow(n_pages: int) -> bool:
        slots = n_pages * target.pool.page_size
        try:  # every slab allocated before any is replaced: a failure leaves them all as they were
            wide = [_widened(target.slab, slots), *(_widened(h.slab, slots) for h in holders)]
        except RuntimeError as e:  # torch's OutOfMemoryError on a GPU, a plain RuntimeError on the CPU
            if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
                raise
            return False
        target.slab = wide[0]
        for h, slab in zip(holders, wide[1:], strict=True):
            h.slab = slab
        target.pool.grow(n_pages)
        return True

    return grow
