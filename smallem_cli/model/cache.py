"""Paged KV cache: one slab of pages per layer, a plain-Python page allocator.

A sequence owns a page table (a list of page indices) and a length. Appending takes
pages from the shared free list as needed; `keep(n)` shortens the sequence to n tokens
and gives the emptied pages back. Rolling back a rejected speculation is therefore a
list truncation: no tensor is touched, stale K/V past the length are simply never read.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..defaults import PAGE_SIZE


def pages_for(n_tokens: int, page_size: int) -> int:
    """The pages n_tokens positions fill: ceil(n_tokens / page_size)."""
    return -(-n_tokens // page_size)


class CacheFullError(RuntimeError):
    """The pool has no free page left for an append."""


@dataclass
class Step:
    """Where one forward pass of T new tokens reads and writes, shared by every layer."""

    start: int  # position of the first new token
    length: int  # start + T: keys visible after the write
    # the flat slot (page * page_size + offset) of every position the sequence's table covers
    # (or covered: a prefix of it is the table), and those pages in order [>= ceil(length / page_size)]
    position_slots: torch.Tensor
    table: torch.Tensor
    page_size: int
    # Consecutive pages: every layer's visible K/V as one view of the slab,
    # [layer, K or V, kv head, length, head dim], so a layer's read is one index.
    view: torch.Tensor | None = None
    dtype: torch.dtype = torch.float32  # the cache's, for the mask

    @cached_property
    def slots(self) -> torch.Tensor:
        """[T] long: the flat slot of each new token (built on first use: native and compiled
        steps write through `view`)."""
        return self.position_slots[self.start : self.length]

    @cached_property
    def pages(self) -> torch.Tensor:
        """[ceil(length / page_size)] long: the sequence's pages, in order (for a gather)."""
        return self.table[: pages_for(self.length, self.page_size)]

    @cached_property
    def bias(self) -> torch.Tensor | None:
        """[T, length] causal mask as 0 / -inf, None when T == 1 (all visible). Built on first
        use: the native and compiled steps never ask for it (three tensor calls per pass)."""
        n = self.length - self.start
        if n <= 1:
            return None
        dev = self.position_slots.device
        pos = torch.arange(self.length, device=dev)
        bias = torch.zeros(n, self.length, dtype=self.dtype, device=dev)
        return bias.masked_fill_(pos[None, :] > pos[self.start :, None], float("-inf"))

    def past(self) -> torch.Tensor:
        """The K/V of the positions before the new tokens: [layer, K or V, kv head, start, head dim]."""
        assert self.view is not None, "only for consecutive pages"
        return self.view[:, :, :, : self.start]


class PagedKVCache:
    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        n_pages: int,
        page_size: int = PAGE_SIZE,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if n_pages < 1 or page_size < 1:
            raise ValueError("a cache needs at least one page of at least one slot")
        self.page_size = page_size
        self.n_pages = n_pages
        self.device = torch.device(device)
        # One slab: [layer, K or V, kv head, page * page_size + slot, head dim]. Page p holds
        # positions p*page_size .. (p+1)*page_size - 1 of the last axis but one. Per head, the
        # keys of a run of consecutive pages are the rows of one [length, head dim] matrix,
        # which attention multiplies as they lie; one index_copy_ writes K and V of all heads.
        shape = (n_layers, 2, n_kv_heads, n_pages * page_size, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=self.device)
        self.free: list[int] = list(range(n_pages - 1, -1, -1))  # a stack: pop() is O(1)
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self._next_id = 0
        # Per sequence, rebuilt only when its table grows past what they were built for (a
        # rollback keeps a prefix of the table, and the free stack hands the same pages back):
        # the table they were built for, on the device, the first page if those pages are
        # consecutive, and the flat slot of every position they cover (a step's slots are a
        # slice, not a tensor built from a list).
        self._table_tensors: dict[int, tuple[list[int], torch.Tensor, int | None, torch.Tensor]] = {}

    # --- allocator -------------------------------------------------------------------
    def new_sequence(self) -> int:
        seq = self._next_id
        self._next_id += 1
        self.tables[seq] = []
        self.lengths[seq] = 0
        return seq

    def release(self, seq: int) -> None:
        """Forget a sequence and return all its pages."""
        self.keep(seq, 0)
        del self.tables[seq], self.lengths[seq]
        self._table_tensors.pop(seq, None)

    def length(self, seq: int) -> int:
        return self.lengths[seq]

    def append(self, seq: int, n: int) -> Step:
        """Grow `seq` by n tokens, taking pages as needed; say where they go."""
        table, start = self.tables[seq], self.lengths[seq]
        length = start + n
        need = pages_for(length, self.page_size) - len(table)
        if need > len(self.free):
            # Checked before taking anything, so a failed append changes nothing.
            raise CacheFullError(f"KV cache is full: {need} more pages needed, {len(self.free)} free of {self.n_pages}")
        if need > 0:
            table.extend(self.free.pop() for _ in range(need))
        self.lengths[seq] = length
        cached = self._table_tensors.get(seq)
        ps = self.page_size
        if cached is None or len(table) > len(cached[0]) or cached[0][: len(table)] != table:
            consecutive = bool(table) and table[-1] - table[0] == len(table) - 1 and table == sorted(table)
            pages = torch.tensor(table, dtype=torch.long, device=self.device)
            offsets = torch.arange(ps, device=self.device)
            cached = list(table), pages, table[0] if consecutive else None, (pages[:, None] * ps + offsets).flatten()
            self._table_tensors[seq] = cached
        _, pages, first, position_slots = cached
        view = None if first is None else self.kv[:, :, :, first * ps : first * ps + length]
        return Step(start, length, position_slots, pages, ps, view, self.kv.dtype)

    def keep(self, seq: int, n: int) -> None:
        """Roll `seq` back to its first n tokens; emptied pages return to the pool."""
        table = self.tables[seq]
        if not 0 <= n <= self.lengths[seq]:
            raise ValueError(f"cannot keep {n} tokens of a sequence of {self.lengths[seq]}")
        self.lengths[seq] = n
        n_pages = pages_for(n, self.page_size)
        if n_pages < len(table):  # its table tensors stay: they serve a prefix (`append`)
            self.free.extend(reversed(table[n_pages:]))
            del table[n_pages:]

    # --- tensors ---------------------------------------------------------------------
    def write(self, layer: int, step: Step, kv: torch.Tensor) -> None:
        """Store K/V of the new tokens. kv: [T, K or V, kv heads, head dim]."""
        self.kv[layer].index_copy_(2, step.slots, kv.permute(1, 2, 0, 3))

    def read(self, layer: int, step: Step) -> torch.Tensor:
        """K/V of every visible position, in order: [K or V, kv heads, length, head dim].

        A view of the slab when the sequence's pages are consecutive (the usual case for a
        sequence alone in its pool: the free list hands pages out in order); else a gather.
        """
        if step.view is not None:
            return step.view[layer]
        ps = self.page_size
        pages = self.kv[layer].unflatten(2, (-1, ps)).index_select(2, step.pages)  # [2, Hkv, n, ps, D]
        return pages.flatten(2, 3)[:, :, : step.length]
