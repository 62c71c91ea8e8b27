"""An engine for a loaded target and a named proposer, its cache grown as the requests need it
(`grower`) up to max_batch sequences at the full context, max_batch lowered to what the memory holds."""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from pathlib import Path

import torch

from .. import defaults as D
from .. import options as O
from ..backends import native
from ..backends.engines import Backend, Log
from ..model.llama import MTPModule, Transformer
from . import family
from .forward import slab_for
from .pool import PagePool, pages_for
from .proposers import BatchProposer, DraftGuess, FallbackGuess, MTPGuess, NgramGuess, NoGuess
from .runner import TargetRunner
from .scheduler import Engine, round_ahead


def batch_proposer(p: family.Proposer, target: Transformer, pool: PagePool, backend: Backend) -> BatchProposer:
    model: DraftGuess | MTPGuess | None = None
    if isinstance(p.model, MTPModule):
        assert p.head is not None
        model = MTPGuess(target, p.model, pool, p.head, backend)
    elif p.model is not None:
        assert p.head is not None
        model = DraftGuess(p.model, pool, p.head, p.name.removeprefix(D.NGRAM + "+"), backend)
    if not p.ngram:
        return model or NoGuess()
    lookup = NgramGuess(target.cfg.vocab_size, D.NGRAM_MIN, D.NGRAM_MAX, D.NGRAM_GUESS_COST)
    return lookup if model is None else FallbackGuess(lookup, model)


def pool_pages(max_batch: int, context: int, page_size: int, tree: tuple[int, int] | None = None) -> int:
    """Pages for max_batch sequences at the full context (a request that fits the context fits alone)."""
    return max_batch * pages_for(context + round_ahead(D.MAX_K, tree), page_size)


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except (OSError, ValueError):
        return None


def _kib_field(path: str, name: str) -> int | None:
    """`Name:  123 kB` of /proc/meminfo or /proc/self/status, in bytes."""
    for line in (_read(path) or "").splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1]) * 1024
    return None


def _cgroup_room() -> int | None:
    """What a container's memory limit (cgroup v2, else v1) has left: /proc/meminfo tells the host's."""
    v2, v1 = "/sys/fs/cgroup/memory.", "/sys/fs/cgroup/memory/memory."
    for files in ((v2 + "max", v2 + "current"), (v1 + "limit_in_bytes", v1 + "usage_in_bytes")):
        limit, usage = ((_read(f) or "").strip() for f in files)
        if limit.isdigit() and usage.isdigit():
            return max(0, int(limit) - int(usage))
    return None


def _address_space_room() -> int | None:
    """The address space left under RLIMIT_AS (`ulimit -v`), where one is set."""
    try:
        import resource  # POSIX only
    except ImportError:
        return None
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    used = _kib_field("/proc/self/status", "VmSize")
    return None if soft == resource.RLIM_INFINITY or used is None else max(0, soft - used)


def free_memory(device: torch.device) -> int:
    """Bytes free for new tensors on `device` (the CPU: the least of MemAvailable, the cgroup's and RLIMIT_AS's)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    rooms = (_kib_field("/proc/meminfo", "MemAvailable"), _cgroup_room(), _address_space_room())
    if known := [room for room in rooms if room is not None]:
        return min(known)
    try:  # no /proc (macOS): the physical memory, all of it
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return 1 << 32  # nothing to go by: 4 GiB


def cache_budget(device: torch.device) -> int:
    return int(D.CACHE_MEMORY_SHARE * free_memory(device))


def sequence_bytes(
    models: list[Transformer | MTPModule], context: int, page_size: int, tree: tuple[int, int] | None = None
) -> int:
    per_slot = native.KV_DTYPE.itemsize * sum(
        (1 if isinstance(m, MTPModule) else m.cfg.n_layers) * 2 * m.cfg.n_kv_heads * m.cfg.head_dim for m in models
    )
    return pool_pages(1, context, page_size, tree) * page_size * per_slot


def _size(n: float) -> str:
    for unit in ("bytes", "kB", "MB", "GB", "TB", "PB", "EB", "ZB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} YB"


def fit_batch(max_batch: int, per_sequence: int, budget: int, strict: bool = False) -> int:
    """max_batch, or as many sequences as `budget` holds if fewer; UsageError if none fits, or (strict) not all."""
    fits = budget // per_sequence
    if fits < 1:
        raise O.UsageError(
            f"not enough memory for the batch engine: one sequence's cache takes {_size(per_sequence)}, "
            f"{_size(budget)} is free for it"
        )
    if strict and max_batch > fits:
        raise O.UsageError(
            f"batch size {max_batch}: its cache would take {_size(max_batch * per_sequence)}, "
            f"{_size(budget)} is free for it: at most {fits} sequences fit"
        )
    return min(max_batch, fits)


def _widened(slab: torch.Tensor, slots: int) -> torch.Tensor:
    """`slab` with `slots` slots, zeros after its own (attention reads a masked slot too: it must be finite)."""
    wide = slab.new_zeros(*slab.shape[:3], slots, slab.shape[4])
    wide[:, :, :, : slab.shape[3]].copy_(slab)
    return wide


def grower(target: TargetRunner, bp: BatchProposer) -> Callable[[int], bool]:
    """The scheduler's `grow`: the pool and its slabs widened to n pages; False, unchanged, where memory is short."""
    other = bp.other if isinstance(bp, FallbackGuess) else bp
    holders = [other] if isinstance(other, DraftGuess | MTPGuess) else []

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


def assemble(
    model: Transformer,
    p: family.Proposer,
    backend: Backend,
    pool: PagePool,
    k: int,
    *,
    auto_k: bool,
    max_batch: int,
    end_ids: Collection[int] = (),
    decode: Callable[[list[int]], str] | None = None,
    k_sample: int | None = None,
    max_pages: int = 0,
) -> Engine:
    """An engine over `pool`, its passes on `backend` (prepared); the pool grows up to max_pages."""
    slab = slab_for(model, pool.n_pages * pool.page_size, model.embed_tokens.weight.device)
    target = TargetRunner(model, slab, pool, backend.steps(model))
    bp = batch_proposer(p, model, pool, backend)
    grow = grower(target, bp) if max_pages > pool.n_pages else None
    return Engine(
        target,
        bp,
        k,
        auto_k=auto_k,
        max_batch=max_batch,
        end_ids=end_ids,
        decode=decode,
        k_sample=k_sample,
        tree=p.tree,
        grow=grow,
        max_pages=max_pages,
        backend=backend.label,
    )


def build_engine(
    tgt: family.Target,
    proposer: str,
    device: torch.device,
    *,
    k: int | None,
    max_batch: int,
    proposer_vocab: int | None,
    end_ids: Collection[int] = (),
    decode: Callable[[list[int]], str],
    n_pages: int | None = None,
    tree: tuple[int, int] | None = None,
    backend: Backend | None = None,
    log: Log | None = None,
    weights: str = D.PROPOSER_WEIGHTS,
    strict: bool = False,
) -> Engine:
    """An engine for many requests. k None: the proposer's default per mode, capped under load. n_pages: the
    pool's size, fixed; else max_batch is lowered to what fits the memory (strict: UsageError instead)."""
    model, page_size = tgt.model, D.PAGE_SIZE
    # a batch mixes modes: the proposer's head is the greedy one (`D.PROPOSER_VOCAB`), its default
    vocab = D.proposer_vocab(True, proposer_vocab)
    p = family.load_proposer(proposer, tgt, device, vocab, tree=tree, weights=weights)
    backend = backend or Backend()
    backend.prepare(model, p.models, log, p.models if p.int8 else ())
    max_pages = 0  # a pool of n_pages does not grow
    if n_pages is None:  # measured with the models loaded, before any slab is allocated
        per_sequence = sequence_bytes([model, *p.models], model.cfg.max_seq_len, page_size, tree)
        max_batch = fit_batch(max_batch, per_sequence, cache_budget(device), strict)
        max_pages = pool_pages(max_batch, model.cfg.max_seq_len, page_size, tree)
        n_pages = pool_pages(min(max_batch, D.MAX_BATCH), model.cfg.max_seq_len, page_size, tree)
    return assemble(
        model,
        p,
        backend,
        PagePool(n_pages, page_size),
        D.default_k(proposer, True, k),
        auto_k=k is None,
        max_batch=max_batch,
        end_ids=end_ids,
        decode=decode,
        k_sample=D.default_k(proposer, False, k),
        max_pages=max_pages,
    )
