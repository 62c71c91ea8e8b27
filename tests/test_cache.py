"""PagedKVCache: page accounting, K/V round trips, rollback, a full pool, the causal mask."""

from __future__ import annotations

import random

import pytest
import torch

from smallem_cli.model.cache import CacheFullError, PagedKVCache, Step

N_LAYERS, N_KV, HEAD_DIM = 2, 2, 4
PAGE = 4


def new_cache(n_pages: int, page_size: int = PAGE) -> PagedKVCache:
    return PagedKVCache(N_LAYERS, N_KV, HEAD_DIM, n_pages, page_size)


def read_all(cache: PagedKVCache, seq: int, layer: int) -> torch.Tensor:
    """Everything `seq` holds in one layer, through an append of 0 tokens (which changes nothing)."""
    if cache.length(seq) == 0:
        assert cache.tables[seq] == []
        return torch.empty(0, 2, N_KV, HEAD_DIM)
    step = cache.append(seq, 0)
    assert step.pages.tolist() == cache.tables[seq]  # the device copy of the table is never stale
    return as_rows(cache.read(layer, step))


def as_rows(kv: torch.Tensor) -> torch.Tensor:
    """A read, [K or V, kv heads, length, head dim] -> one row per position [length, 2, kv heads, head dim]."""
    return kv.permute(2, 0, 1, 3)


def pages_used(cache: PagedKVCache) -> int:
    return sum(len(t) for t in cache.tables.values())


def snapshot(cache: PagedKVCache) -> tuple[dict, dict, list]:
    return {s: list(t) for s, t in cache.tables.items()}, dict(cache.lengths), list(cache.free)


def check_accounting(cache: PagedKVCache) -> None:
    """Every page is in exactly one place: one sequence's table or the free list."""
    in_tables = [p for t in cache.tables.values() for p in t]
    assert pages_used(cache) == len(in_tables)
    assert len(in_tables) + len(cache.free) == cache.n_pages
    assert sorted(in_tables + cache.free) == list(range(cache.n_pages))  # no page twice, none lost
    for seq, table in cache.tables.items():
        assert len(table) == -(-cache.length(seq) // cache.page_size)  # exactly the pages the length needs


class Shadow:
    """The K/V each sequence should hold, per layer and position, kept beside the cache."""

    def __init__(self, cache: PagedKVCache, seed: int) -> None:
        self.cache = cache
        self.gen = torch.Generator().manual_seed(seed)
        self.data: dict[int, list[torch.Tensor]] = {}  # seq -> per layer [length, 2, kv heads, head dim]

    def new(self) -> int:
        seq = self.cache.new_sequence()
        self.data[seq] = [torch.empty(0, 2, N_KV, HEAD_DIM) for _ in range(N_LAYERS)]
        return seq

    def append(self, seq: int, n: int) -> Step:
        start = self.cache.length(seq)
        step = self.cache.append(seq, n)
        assert (step.start, step.length) == (start, start + n)
        table, ps = self.cache.tables[seq], self.cache.page_size
        assert step.pages.tolist() == table  # the device copy of the table is never stale
        assert step.slots.tolist() == [table[p // ps] * ps + p % ps for p in range(start, start + n)]
        for layer in range(N_LAYERS):
            kv = torch.randn(n, 2, N_KV, HEAD_DIM, generator=self.gen)
            self.cache.write(layer, step, kv)
            self.data[seq][layer] = torch.cat([self.data[seq][layer], kv])
            # read through the step itself: everything visible after the write
            assert torch.equal(as_rows(self.cache.read(layer, step)), self.data[seq][layer])
        return step

    def keep(self, seq: int, n: int) -> None:
        self.cache.keep(seq, n)
        self.data[seq] = [d[:n] for d in self.data[seq]]

    def release(self, seq: int) -> None:
        self.cache.release(seq)
        del self.data[seq]

    def check(self) -> None:
        check_accounting(self.cache)
        assert set(self.cache.tables) == set(self.data)
        for seq, layers in self.data.items():
            assert self.cache.length(seq) == len(layers[0])
            for layer, want in enumerate(layers):
                assert torch.equal(read_all(self.cache, seq, layer), want)


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_pages_and_data_consistent(seed: int) -> None:
    rnd = random.Random(seed)
    cache = new_cache(n_pages=9)
    sh = Shadow(cache, seed)
    seqs = [sh.new() for _ in range(3)]
    counts = {"append": 0, "full": 0, "keep": 0, "release": 0}
    for _ in range(300):
        op = rnd.random()
        if not seqs or op < 0.05:
            seqs.append(sh.new())
        elif op < 0.6:
            seq = rnd.choice(seqs)
            n = rnd.randint(1, 9)
            before = snapshot(cache)
            try:
                sh.append(seq, n)
                counts["append"] += 1
            except CacheFullError:
                counts["full"] += 1
                assert snapshot(cache) == before
        elif op < 0.92:
            seq = rnd.choice(seqs)
            sh.keep(seq, rnd.randint(0, cache.length(seq)))
            counts["keep"] += 1
        else:
            seq = seqs.pop(rnd.randrange(len(seqs)))
            sh.release(seq)
            counts["release"] += 1
        sh.check()
    # the walk really exercised every path, the full pool included
    assert all(v > 3 for v in counts.values()), counts
    for seq in seqs:
        sh.release(seq)
    assert cache.tables == {} and pages_used(cache) == 0 and sorted(cache.free) == list(range(9))


def test_interleaved_sequences_do_not_overwrite_each_other() -> None:
    cache = new_cache(n_pages=11)
    sh = Shadow(cache, seed=0)
    a, b = sh.new(), sh.new()
    for n in (3, 5, 1, 6, 2):  # interleaved appends: the two tables end up with alternating pages
        sh.append(a, n)
        sh.append(b, n + 1)
    assert set(cache.tables[a]).isdisjoint(cache.tables[b])
    sh.check()


@pytest.mark.parametrize(("length", "k", "kept"), [(6, 4, 0), (7, 5, 2), (8, 3, 0), (8, 3, 3), (1, 9, 4), (0, 4, 1)])
def test_keep_after_a_round_restores_the_state(length: int, k: int, kept: int) -> None:
    """A verify round appends k+1 tokens; keeping `length` (+ the accepted) undoes the rest exactly."""
    cache = new_cache(n_pages=12)
    sh = Shadow(cache, seed=1)
    other = sh.new()
    sh.append(other, 5)  # another sequence owns pages in the same pool
    seq = sh.new()
    if length:
        sh.append(seq, length)
    before = snapshot(cache)
    data_before = [read_all(cache, seq, layer).clone() for layer in range(N_LAYERS)]

    sh.append(seq, k + 1)  # the verify pass
    assert cache.length(seq) == length + k + 1
    cache.keep(seq, length)  # everything rejected
    sh.data[seq] = [d[:length] for d in sh.data[seq]]
    assert snapshot(cache) == before  # tables, lengths and the free list, in order
    for layer in range(N_LAYERS):
        assert torch.equal(read_all(cache, seq, layer), data_before[layer])
    sh.check()

    sh.append(seq, k + 1)  # again, this time keeping some
    sh.keep(seq, length + kept)
    assert len(cache.tables[seq]) == -(-(length + kept) // PAGE)
    assert cache.tables[seq][: len(before[0][seq])] == before[0][seq]  # old pages stay where they were
    sh.check()
    sh.append(seq, 3)  # and the sequence grows on from there
    sh.check()


def test_full_pool_raises_and_changes_nothing() -> None:
    cache = new_cache(n_pages=5)
    sh = Shadow(cache, seed=2)
    a, b = sh.new(), sh.new()
    sh.append(a, 9)  # 3 pages, the last one a quarter full
    sh.append(b, 4)  # 1 page
    before = snapshot(cache)
    with pytest.raises(CacheFullError, match="full"):
        cache.append(a, 3 + 2 * PAGE)  # needs 2 more pages, 1 is free
    with pytest.raises(CacheFullError):
        cache.append(sh.new(), 2 * PAGE)
    del sh.data[max(cache.tables)]  # that new, empty sequence stays, with no pages
    cache.release(max(cache.tables))
    assert snapshot(cache) == before
    sh.check()
    sh.append(a, 3 + PAGE)  # exactly what is left fits: the last free page
    assert cache.free == []
    sh.check()
    with pytest.raises(CacheFullError):
        cache.append(b, 1)  # b's page is full and none is free
    assert cache.length(b) == 4
    sh.check()
    sh.keep(a, 0)  # a's pages come back, b can grow
    sh.append(b, 3 * PAGE)
    sh.check()


def test_keep_out_of_range_raises_and_changes_nothing() -> None:
    cache = new_cache(n_pages=4)
    sh = Shadow(cache, seed=3)
    seq = sh.new()
    sh.append(seq, 5)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="cannot keep 6 tokens of a sequence of 5"):
        cache.keep(seq, 6)
    with pytest.raises(ValueError):
        cache.keep(seq, -1)
    assert snapshot(cache) == before
    sh.keep(seq, 5)  # keeping everything is allowed and changes nothing
    assert snapshot(cache) == before
    sh.check()


@pytest.mark.parametrize(("start", "n"), [(0, 2), (0, 7), (3, 5), (4, 4), (9, 6), (13, 3)])
def test_causal_bias(start: int, n: int) -> None:
    cache = new_cache(n_pages=8)
    seq = cache.new_sequence()
    if start:
        cache.append(seq, start)
    step = cache.append(seq, n)
    assert step.bias is not None and step.bias.shape == (n, start + n)
    rows = torch.arange(n)[:, None]
    cols = torch.arange(start + n)[None, :]
    above = cols > rows + start  # new token i sees positions 0 .. start+i
    assert torch.isneginf(step.bias[above]).all()
    assert (step.bias[~above] == 0).all()
    assert int(above.sum()) == n * (n - 1) // 2


def test_single_token_step_has_no_bias() -> None:
    cache = new_cache(n_pages=2)
    seq = cache.new_sequence()
    cache.append(seq, 3)
    step = cache.append(seq, 1)
    assert step.bias is None and (step.start, step.length) == (3, 4)


def test_append_of_nothing_to_an_empty_sequence() -> None:
    cache = new_cache(n_pages=2)
    seq = cache.new_sequence()
    step = cache.append(seq, 0)
    assert (step.start, step.length, step.pages.tolist(), step.bias) == (0, 0, [], None)
    assert cache.read(0, step).shape == (2, N_KV, 0, HEAD_DIM)
    check_accounting(cache)


def test_bad_pool_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        new_cache(n_pages=0)
    with pytest.raises(ValueError):
        new_cache(n_pages=3, page_size=0)
