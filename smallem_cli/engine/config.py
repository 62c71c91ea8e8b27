"""The one engine config (`EngineConfig`, built by `build.build`) and the one rule that sizes its page pool
(`plan_pool`): the pool starts with the pages of min(max_batch, MAX_BATCH) sequences of min(context, FIRST_POSITIONS)
positions and grows as the requests need it, up to max_batch sequences at the full context. max_batch is lowered to
what the memory holds (strict: refused); a sequence alone (max_batch 1) gets a shorter context instead."""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import defaults
from ..backends import native
from ..backends.engines import Backend
from ..errors import UsageError
from ..kv.pool import pages_for
from ..model.llama import MTPModule, Transformer
from .family import NONE, LoadedProposer

FIRST_POSITIONS = 1024  # a sequence's cache at first: the pool doubles while the requests outgrow it


@dataclass
class EngineConfig:
    """What an engine is built from: the target, the loaded proposer and the backend (prepared by `build`)."""

    target: Transformer
    proposer: LoadedProposer = field(default_factory=lambda: NONE)
    backend: Backend = field(default_factory=Backend)
    k: int | None = None  # draft tokens a round; None: the proposer's default per mode, capped under load when greedy
    max_batch: int = 1  # sequences decoded together, at most
    end_ids: Collection[int] = ()  # the tokens that end a text (not emitted)
    decode: Callable[[list[int]], str] | None = None  # an answer's text; stop strings need it
    strict: bool = False  # a max_batch the memory cannot hold is refused (bench), not lowered
    pages: int | None = None  # a pool of this many pages, never grown; None: `plan_pool`'s
    suffix_tokens: int = defaults.SUFFIX_TOKENS  # the suffix lookup's texts, at most
    suffix_shared: bool = True  # each text the engine writes goes to the suffix lookup of the texts after it

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")

    def k_for(self, greedy: bool) -> int:
        return self.proposer.default_k(greedy) if self.k is None else self.k


@dataclass(frozen=True)
class PoolPlan:
    pages: int  # at first
    max_pages: int  # grown up to
    max_batch: int  # sequences at once, as the memory allows
    context: int  # positions a sequence may reach, as the memory allows


def round_ahead(k: int, tree: tuple[int, int] | None) -> int:
    """Positions a round may write past a sequence's cache: [last, k draft tokens or a tree's entries], and one more."""
    return k + 2 if tree is None else max(k, tree[0], (k - 1) * tree[1]) + 2


def plan_pool(config: EngineConfig, budget: int) -> PoolPlan:
    """The pool of `config` with `budget` bytes for its caches (`cache_budget`); UsageError where none fits."""
    context, max_batch, tree = config.target.cfg.max_seq_len, config.max_batch, config.proposer.tree

    def pages(n: int, positions: int) -> int:  # a request that fits the context fits alone
        return n * pages_for(positions + round_ahead(defaults.MAX_K, tree), defaults.PAGE_SIZE)

    if config.pages is not None:
        return PoolPlan(config.pages, config.pages, max_batch, context)
    per_page = defaults.PAGE_SIZE * slot_bytes([config.target, *config.proposer.models])
    if max_batch == 1 and pages(1, context) * per_page > budget:  # a conversation, shorter
        context = min(context, context * budget // (pages(1, context) * per_page))
    else:
        max_batch = fit_batch(max_batch, pages(1, context) * per_page, budget, config.strict)
    first = pages(min(max_batch, defaults.MAX_BATCH), min(context, FIRST_POSITIONS))
    return PoolPlan(first, pages(max_batch, context), max_batch, context)


def slot_bytes(models: list[Transformer | MTPModule]) -> int:
    """The bytes of one position's K/V over every model's slab."""
    return native.KV_DTYPE.itemsize * sum(
        (1 if isinstance(m, MTPModule) else m.cfg.n_layers) * 2 * m.cfg.n_kv_heads * m.cfg.head_dim for m in models
    )


def fit_batch(max_batch: int, per_sequence: int, budget: int, strict: bool = False) -> int:
    """max_batch, or as many sequences as `budget` holds if fewer; UsageError if none fits, or (strict) not all."""
    fits = budget // per_sequence
    if fits < 1:
        raise UsageError(
            f"not enough memory for the batch engine: one sequence's cache takes {_size(per_sequence)}, "
            f"{_size(budget)} is free for it"
        )
    if strict and max_batch > fits:
        raise UsageError(
            f"batch size {max_batch}: its cache would take {_size(max_batch * per_sequence)}, "
            f"{_size(budget)} is free for it: at most {fits} sequences fit"
        )
    return min(max_batch, fits)


def _size(n: float) -> str:
    for unit in ("bytes", "kB", "MB", "GB", "TB", "PB", "EB", "ZB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} YB"


def cache_budget(device: torch.device) -> int:
    return int(defaults.CACHE_MEMORY_SHARE * free_memory(device))


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


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, ValueError):
        return ""


def _kib_field(path: str, name: str) -> int | None:
    """`Name:  123 kB` of /proc/meminfo or /proc/self/status, in bytes."""
    line = next((x for x in _read(path).splitlines() if x.startswith(name + ":")), None)
    return None if line is None else int(line.split()[1]) * 1024


def _cgroup_room() -> int | None:
    """What a container's memory limit (cgroup v2, else v1) has left: /proc/meminfo tells the host's."""
    v2, v1 = "/sys/fs/cgroup/memory.", "/sys/fs/cgroup/memory/memory."
    for files in ((v2 + "max", v2 + "current"), (v1 + "limit_in_bytes", v1 + "usage_in_bytes")):
        limit, usage = (_read(f).strip() for f in files)
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
