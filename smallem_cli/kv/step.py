"""One pass over a batch of sequences, flattened (nano-vllm's layout): sequence b's n_b >= 1 new
tokens are rows of one flat list of N = sum(n_b), so every weight matmul reads its matrix once;
each row attends to its own sequence's positions up to its own, through the pool's page tables."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch

from .pool import pages_for

Masks = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (q_rows, bias, out_rows)


@dataclass
class BatchStep:
    """A pass's inputs. The eager pass's padded layout (q_rows, bias, out_rows; Tm = max n_b) is made
    when first read: the native pass does without it, reading its keys as slots (`visible`)."""

    positions: torch.Tensor  # [N] each row's position (the rotary angle)
    slots: torch.Tensor  # [N] where each row's K/V are written in a slab
    kv_slots: torch.Tensor  # [B, S] each sequence's slots of positions 0 .. S-1 (padding: slot 0)
    seq: torch.Tensor  # [N] each row's sequence
    last: torch.Tensor  # [B] the flat row of each sequence's last new token
    counts: list[int]  # n_b per sequence
    masks: Callable[[], Masks]
    base: int | None = None  # one sequence whose pages lie in order: the slot of its position 0 (no gather)
    prefix: bool = True  # row i sees its sequence's positions 0 .. positions[i] (a tree's rows do not)
    windows: dict[int, torch.Tensor] = field(default_factory=dict)  # `window_bias` by window

    @cached_property
    def _masks(self) -> Masks:
        return self.masks()

    @property
    def q_rows(self) -> torch.Tensor:  # [B, Tm] the flat row of each sequence's t-th new token (padding: row 0)
        return self._masks[0]

    @property
    def bias(self) -> torch.Tensor:  # [B, Tm, S] 0 where a key is visible to a query, -inf elsewhere
        return self._masks[1]

    @property
    def out_rows(self) -> torch.Tensor:  # [N] where each flat row sits in the padded [B * Tm] layout
        return self._masks[2]

    def window_bias(self, window: int) -> torch.Tensor:
        """`bias` of a local layer: the keys of entries `window` or more before a row's position masked too. A tree's
        entries past its prefix are its nodes, nearer than any window (a window wider than the tree is deep)."""
        if window not in self.windows:
            B, Tm, S = self.bias.shape
            pos = torch.full((B * Tm,), S - 1, dtype=torch.long, device=self.bias.device)  # padding: the last keys
            pos[self.out_rows] = self.positions
            old = torch.arange(S, device=pos.device) <= pos.view(B, Tm, 1) - window
            self.windows[window] = self.bias.masked_fill(old, float("-inf"))
        return self.windows[window]


def visible(b: BatchStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each flat row's keys as slots (vis, start [N], count [N]), in position order: the native pass reads them."""
    if b.prefix:
        return b.kv_slots.reshape(-1), b.seq * b.kv_slots.shape[1], b.positions + 1
    Tm = b.bias.shape[1]
    seq, t = b.out_rows // Tm, b.out_rows % Tm  # [N]: each row's sequence and place in it
    seen = b.bias[seq, t] == 0  # [N, S]
    count = seen.sum(1)
    return b.kv_slots[seq][seen], torch.cumsum(count, 0) - count, count


def in_order(table: list[int], n_pages: int) -> int | None:
    """The first page of `table` if its first n_pages pages are consecutive (its slots one range), else None."""
    first = table[0]
    return first if table[:n_pages] == list(range(first, first + n_pages)) else None


def _slots(tables: list[list[int]], S: int, page_size: int) -> torch.Tensor:
    """kv_slots [B, S]: the slot of each sequence's positions 0 .. S-1 (past a table's end: slot 0)."""
    max_pages = pages_for(S, page_size)
    table = torch.tensor([t[:max_pages] + [0] * (max_pages - len(t[:max_pages])) for t in tables], dtype=torch.long)
    return (table[:, :, None] * page_size + torch.arange(page_size)).view(len(tables), -1)[:, :S]


def _padded(counts: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(valid [B, Tm], q_rows [B, Tm] (padding: row 0), out_rows [N]: each flat row's place in [B * Tm])."""
    Tm = max(counts)
    n = torch.tensor(counts)
    seq = torch.repeat_interleave(torch.arange(len(counts)), n)  # [N]
    first = torch.tensor([0, *counts[:-1]]).cumsum(0)  # [B] flat row of each sequence's first token
    t = torch.arange(Tm)
    valid = t[None, :] < n[:, None]  # [B, Tm]
    q_rows = torch.where(valid, first[:, None] + t[None, :], 0)  # [B, Tm]
    out_rows = seq * Tm + (torch.arange(int(seq.shape[0])) - first[seq])  # [N]
    return valid, q_rows, out_rows


def build(
    tables: list[list[int]], starts: list[int], counts: list[int], page_size: int, device: torch.device
) -> BatchStep:
    """The step for `counts[b]` new tokens from position `starts[b]` of each sequence, its pages reserved."""
    B = len(tables)
    assert B and len(starts) == len(counts) == B and min(counts) >= 1
    lengths = [s + n for s, n in zip(starts, counts, strict=True)]
    S = max(lengths)
    if B == 1 and (page := in_order(tables[0], pages_for(S, page_size))) is not None:
        return _one_in_order(page * page_size, starts[0], counts[0], device)
    for t, n in zip(tables, lengths, strict=True):
        assert len(t) * page_size >= n, "reserve pages before building a step"
    d, ps = device, page_size
    kv_slots = _slots(tables, S, page_size)
    # the rows' few numbers in lists, then one tensor for all four: a round builds this for every batch
    seq = [b for b, n in enumerate(counts) for _ in range(n)]  # [N]
    pos = [p for s, n in zip(starts, counts, strict=True) for p in range(s, s + n)]  # [N]
    slots = [tables[b][p // ps] * ps + p % ps for b, p in zip(seq, pos, strict=True)]
    last = [i - 1 for i in itertools.accumulate(counts)]  # [B] the flat row of each sequence's last token

    def masks() -> Masks:
        valid, q_rows, out_rows = _padded(counts)
        Tm = max(counts)
        q_pos = torch.where(valid, torch.tensor(starts)[:, None] + torch.arange(Tm)[None, :], S - 1)  # pad: all keys
        bias = torch.zeros(B, Tm, S).masked_fill_(torch.arange(S)[None, None, :] > q_pos[:, :, None], float("-inf"))
        return q_rows.to(d), bias.to(d), out_rows.to(d)

    flat = torch.tensor(pos + slots + seq + last, dtype=torch.long, device=d)
    pos_t, slots_t, seq_t, last_t = flat.split([len(pos)] * 3 + [B])
    return BatchStep(pos_t, slots_t, kv_slots.to(d), seq_t, last_t, list(counts), masks)


def _one_in_order(base: int, start: int, n: int, device: torch.device) -> BatchStep:
    """`build` for one sequence whose pages lie in order from slot `base`, in few ops: it runs every round."""
    S = start + n
    pos = torch.arange(start, S, device=device)  # [n]
    rows = torch.arange(n, device=device)  # [n]

    def masks() -> Masks:
        if n > 1:
            j = torch.arange(S, device=device)
            bias = torch.zeros(1, n, S, device=device).masked_fill_(j > pos[:, None], float("-inf"))  # [1, n, S]
        else:
            bias = torch.zeros(1, 1, S, device=device)  # one token sees every key
        return rows[None], bias, rows

    kv = (base + torch.arange(S, device=device))[None]
    return BatchStep(pos, pos + base, kv, torch.zeros_like(rows), rows[-1:], [n], masks, base)


def build_tree(
    tables: list[list[int]], starts: list[int], parents: list[list[int]], rows: list[list[int]], page_size: int,
    device: torch.device,
) -> BatchStep:  # fmt: skip
    """A pass over tree nodes: sequence b's node i (parents[b][i] < i, -1 under the prefix) at entry
    starts[b] + i and position starts[b] + its depth, seeing the prefix, its ancestors and itself; the
    pass writes and scores the nodes rows[b] (increasing)."""
    B = len(tables)
    counts = [len(r) for r in rows]
    assert B and len(starts) == len(parents) == B and min(counts) >= 1
    S = max(s + len(p) for s, p in zip(starts, parents, strict=True))
    kv_slots = _slots(tables, S, page_size)
    _, q_rows, out_rows = _padded(counts)
    last = torch.tensor(counts).cumsum(0) - 1  # [B] flat row of each sequence's last node
    bias = torch.zeros(B, max(counts), S)  # padding rows see every key
    pos, slots = [], []
    for b, (s, par, r) in enumerate(zip(starts, parents, rows, strict=True)):
        n = len(par)
        assert len(tables[b]) * page_size >= s + n, "reserve pages before building a step"
        seen = torch.zeros(n, S, dtype=torch.bool)  # [n, S] node i: the prefix, its ancestors, itself
        seen[:, :s] = True
        depth = [0] * n
        for i, p in enumerate(par):
            assert -1 <= p < i, "a tree's nodes come after their parents"
            if p >= 0:
                seen[i] = seen[p]
                depth[i] = depth[p] + 1
            seen[i, s + i] = True
        ri = torch.tensor(r)
        bias[b, : len(r)].masked_fill_(~seen[ri], float("-inf"))
        pos.append(s + torch.tensor(depth)[ri])
        slots.append(kv_slots[b, s + ri])
    d = device
    seq = torch.repeat_interleave(torch.arange(B), torch.tensor(counts))
    masks = (q_rows.to(d), bias.to(d), out_rows.to(d))
    pos_d, slots_d = torch.cat(pos).to(d), torch.cat(slots).to(d)
    return BatchStep(pos_d, slots_d, kv_slots.to(d), seq.to(d), last.to(d), counts, lambda: masks, prefix=False)
