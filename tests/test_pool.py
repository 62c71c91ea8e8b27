"""The page pool (`engine.pool.PagePool`): page accounting, rollback (trim), a full pool, the
slots a pass writes and reads through the page tables (`engine.batch`), the causal mask, and
the K/V of kept positions surviving a rollback, in the engine's own slab."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import PROMPT, kv_close
from engine_help import reference_logits

from smallem_cli.backends.engines import Backend
from smallem_cli.engine.build import proposer_for
from smallem_cli.engine.family import NONE, LoadedProposer
from smallem_cli.engine.forward import slab_for, transformer_pass
from smallem_cli.engine.generate import generate
from smallem_cli.engine.proposers import DraftProposer
from smallem_cli.engine.request import Request
from smallem_cli.engine.round import decode_round
from smallem_cli.engine.sequence import Seq
from smallem_cli.engine.target import TargetRunner, prefill
from smallem_cli.kv.pool import PagePool, PoolExhausted, pages_for
from smallem_cli.kv.step import BatchStep, build, in_order
from smallem_cli.spec.head import Head
from smallem_cli.stats import Stats

PAGE = 4
WIDTH = 3  # a stand-in slab: one row of WIDTH numbers per slot


def snapshot(pool: PagePool) -> tuple[dict[int, list[int]], list[int]]:
    """The tables and the free list, in order (the order pages are handed out in)."""
    return {s: list(t) for s, t in pool.tables.items()}, list(pool.free)


def check_accounting(pool: PagePool, lengths: dict[int, int]) -> None:
    """Every page is in exactly one place, one sequence's table or the free list, and each
    sequence holds exactly the pages its length needs."""
    pool.check()
    in_tables = [p for t in pool.tables.values() for p in t]
    assert len(in_tables) + len(pool.free) == pool.n_pages == pool.used() + len(pool.free)
    assert sorted(in_tables + pool.free) == list(range(pool.n_pages))  # no page twice, none lost
    assert pool.used() == len(in_tables)
    assert set(pool.tables) == set(lengths)
    for seq, n in lengths.items():
        assert len(pool.tables[seq]) == pages_for(n, pool.page_size) == pool.pages_for(n)


class Shadow:
    """The rows each sequence should hold at its positions, kept beside a stand-in slab that the
    pool's slots address as a pass addresses the K/V slab (`batch.build`)."""

    def __init__(self, pool: PagePool, seed: int) -> None:
        self.pool = pool
        self.slab = torch.zeros(pool.n_pages * pool.page_size, WIDTH)
        self.gen = torch.Generator().manual_seed(seed)
        self.data: dict[int, torch.Tensor] = {}  # seq -> [length, WIDTH]
        self._uid = 0

    def new(self) -> int:
        self._uid += 1
        self.pool.add(self._uid)
        self.data[self._uid] = torch.empty(0, WIDTH)
        return self._uid

    def length(self, seq: int) -> int:
        return self.data[seq].shape[0]

    def append(self, seq: int, n: int) -> BatchStep:
        """n new positions: pages reserved, the step a pass would take, its rows written at its slots."""
        start = self.length(seq)
        self.pool.reserve(seq, start + n)
        table, ps = self.pool.tables[seq], self.pool.page_size
        step = build([table], [start], [n], ps, torch.device("cpu"))
        want = [table[p // ps] * ps + p % ps for p in range(start + n)]
        assert want == [self.pool.slot(seq, p) for p in range(start + n)]
        assert step.slots.tolist() == want[start:]  # written where the pool says
        assert step.kv_slots[0, : start + n].tolist() == want  # read where the pool says
        assert step.positions.tolist() == list(range(start, start + n))
        rows = torch.randn(n, WIDTH, generator=self.gen)
        self.slab.index_copy_(0, step.slots, rows)
        self.data[seq] = torch.cat([self.data[seq], rows])
        # read through the step itself: everything visible after the write
        assert torch.equal(self.slab[step.kv_slots[0, : start + n]], self.data[seq])
        return step

    def keep(self, seq: int, n: int) -> None:
        """The rollback: `seq` keeps its first n positions."""
        self.pool.trim(seq, n)
        self.data[seq] = self.data[seq][:n]

    def release(self, seq: int) -> None:
        self.pool.release(seq)
        del self.data[seq]

    def read(self, seq: int) -> torch.Tensor:
        slots = [self.pool.slot(seq, j) for j in range(self.length(seq))]
        return self.slab[torch.tensor(slots, dtype=torch.long)]

    def check(self) -> None:
        check_accounting(self.pool, {s: self.length(s) for s in self.data})
        for seq, want in self.data.items():
            assert torch.equal(self.read(seq), want)  # no other sequence wrote over it


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_pages_and_data_consistent(seed: int) -> None:
    rnd = random.Random(seed)
    pool = PagePool(9, PAGE)
    sh = Shadow(pool, seed)
    seqs = [sh.new() for _ in range(3)]
    counts = {"append": 0, "full": 0, "keep": 0, "release": 0}
    for _ in range(300):
        op = rnd.random()
        if not seqs or op < 0.05:
            seqs.append(sh.new())
        elif op < 0.6:
            seq = rnd.choice(seqs)
            n = rnd.randint(1, 9)
            before = snapshot(pool)
            if pool.need(seq, sh.length(seq) + n) > len(pool.free):
                with pytest.raises(PoolExhausted):
                    sh.append(seq, n)
                counts["full"] += 1
                assert snapshot(pool) == before  # nothing taken
            else:
                sh.append(seq, n)
                counts["append"] += 1
        elif op < 0.92:
            seq = rnd.choice(seqs)
            sh.keep(seq, rnd.randint(0, sh.length(seq)))
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
    assert pool.tables == {} and pool.used() == 0 and sorted(pool.free) == list(range(9))


def test_interleaved_sequences_do_not_overwrite_each_other() -> None:
    pool = PagePool(11, PAGE)
    sh = Shadow(pool, seed=0)
    a, b = sh.new(), sh.new()
    for n in (3, 5, 1, 6, 2):  # interleaved appends: the two tables end up with alternating pages
        sh.append(a, n)
        sh.append(b, n + 1)
    assert set(pool.tables[a]).isdisjoint(pool.tables[b])
    assert in_order(pool.tables[a], len(pool.tables[a])) is None  # the gathered path was taken
    sh.check()


@pytest.mark.parametrize(("length", "k", "kept"), [(6, 4, 0), (7, 5, 2), (8, 3, 0), (8, 3, 3), (1, 9, 4), (0, 4, 1)])
def test_trim_after_a_round_restores_the_state(length: int, k: int, kept: int) -> None:
    """A verify round writes k+1 positions; trimming back to `length` (+ the accepted) undoes
    the rest exactly: the page list shrinks, the emptied pages return to the free list."""
    pool = PagePool(12, PAGE)
    sh = Shadow(pool, seed=1)
    other = sh.new()
    sh.append(other, 5)  # another sequence owns pages in the same pool
    seq = sh.new()
    if length:
        sh.append(seq, length)
    before = snapshot(pool)
    data_before = sh.read(seq).clone()

    sh.append(seq, k + 1)  # the verify pass
    assert len(pool.tables[seq]) == pages_for(length + k + 1, PAGE)
    grown = pool.tables[seq][len(before[0][seq]) :]
    sh.keep(seq, length)  # everything rejected
    assert snapshot(pool) == before  # tables and the free list, in order
    assert set(grown) <= set(pool.free)  # what the round took is back
    assert torch.equal(sh.read(seq), data_before)
    sh.check()

    sh.append(seq, k + 1)  # again, this time keeping some
    sh.keep(seq, length + kept)
    assert len(pool.tables[seq]) == pages_for(length + kept, PAGE)
    assert pool.tables[seq][: len(before[0][seq])] == before[0][seq]  # old pages stay where they were
    assert len(pool.free) == 12 - pages_for(5, PAGE) - pages_for(length + kept, PAGE)
    sh.check()
    sh.append(seq, 3)  # and the sequence grows on from there
    sh.check()


def test_full_pool_raises_and_changes_nothing() -> None:
    pool = PagePool(5, PAGE)
    sh = Shadow(pool, seed=2)
    a, b = sh.new(), sh.new()
    sh.append(a, 9)  # 3 pages, the last one a quarter full
    sh.append(b, 4)  # 1 page
    before = snapshot(pool)
    assert pool.need(a, 9 + 3 + 2 * PAGE) == 2 and len(pool.free) == 1
    with pytest.raises(PoolExhausted, match="2 pages needed, 1 free of 5"):
        pool.reserve(a, 9 + 3 + 2 * PAGE)  # needs 2 more pages, 1 is free
    c = sh.new()
    with pytest.raises(PoolExhausted):
        pool.reserve(c, 2 * PAGE)
    assert pool.tables[c] == []
    sh.release(c)  # that new, empty sequence goes, with no pages
    assert snapshot(pool) == before
    sh.check()
    sh.append(a, 3 + PAGE)  # exactly what is left fits: the last free page
    assert pool.free == []
    sh.check()
    with pytest.raises(PoolExhausted):
        pool.reserve(b, 5)  # b's page is full and none is free
    assert len(pool.tables[b]) == 1
    pool.reserve(b, 4)  # what b holds already needs nothing
    sh.check()
    sh.keep(a, 0)  # a's pages come back, b can grow
    assert pool.tables[a] == [] and len(pool.free) == 4
    sh.append(b, 3 * PAGE)
    sh.check()


def test_trim_past_the_end_changes_nothing() -> None:
    """A trim to what the pages hold or more is no growth: nothing moves."""
    pool = PagePool(4, PAGE)
    sh = Shadow(pool, seed=3)
    seq = sh.new()
    sh.append(seq, 5)
    before = snapshot(pool)
    for n in (5, 6, 2 * PAGE, 100):
        pool.trim(seq, n)
        assert snapshot(pool) == before
    sh.check()


def test_release_gives_every_page_back_and_forgets_the_sequence() -> None:
    pool = PagePool(6, PAGE)
    sh = Shadow(pool, seed=4)
    a, b = sh.new(), sh.new()
    sh.append(a, 7)
    sh.append(b, 2)
    sh.release(a)
    assert a not in pool.tables and pool.used() == 1
    sh.check()
    pool.add(a)  # the same id may come back (a preempted sequence, recomputed)
    assert pool.tables[a] == []
    with pytest.raises(ValueError, match="already in the pool"):
        pool.add(b)


def test_a_grown_pool_hands_out_its_old_free_pages_first() -> None:
    pool = PagePool(3, PAGE)
    sh = Shadow(pool, seed=5)
    a = sh.new()
    sh.append(a, 5)  # pages 0, 1
    pool.grow(5)
    sh.slab = torch.cat([sh.slab, torch.zeros(2 * PAGE, WIDTH)])  # the slab widened to match
    assert pool.n_pages == 5 and pool.used() == 2
    sh.append(a, 2 * PAGE)  # 2 more pages: the old free one first, then the new ones in order
    assert pool.tables[a] == [0, 1, 2, 3]
    sh.check()
    with pytest.raises(ValueError, match="does not shrink"):
        pool.grow(4)
    pool.check()


@pytest.mark.parametrize("alone", [True, False])
@pytest.mark.parametrize(("start", "n"), [(0, 2), (0, 7), (3, 5), (4, 4), (9, 6), (13, 3)])
def test_causal_bias(start: int, n: int, alone: bool) -> None:
    """New token i sees positions 0 .. start+i: alone with its pages in order (one range of the
    slab), and beside another sequence, its pages interleaved with the other's (gathered)."""
    pool = PagePool(16, PAGE)
    pool.add(1)
    pool.add(2)
    if not alone:
        for m in range(1, pages_for(start + n, PAGE) + 1):
            pool.reserve(1, m * PAGE)
            pool.reserve(2, m * PAGE)  # every other page is the other's
    pool.reserve(1, start + n)
    if alone:
        step = build([pool.tables[1]], [start], [n], PAGE, torch.device("cpu"))
        assert step.base is not None
    else:
        step = build([pool.tables[1], pool.tables[2]], [start, 0], [n, 1], PAGE, torch.device("cpu"))
        assert step.base is None and step.bias.shape[0] == 2
        assert (step.bias[1, 0, :1] == 0).all() and torch.isneginf(step.bias[1, 0, 1:]).all()  # the other's row
    assert step.bias.shape[1:] == (n, start + n)
    bias = step.bias[0]
    rows = torch.arange(n)[:, None]
    cols = torch.arange(start + n)[None, :]
    above = cols > rows + start
    assert torch.isneginf(bias[above]).all()
    assert (bias[~above] == 0).all()
    assert int(above.sum()) == n * (n - 1) // 2
    assert step.slots[:n].tolist() == [pool.slot(1, j) for j in range(start, start + n)]


@pytest.mark.parametrize("in_order", [True, False])
def test_single_token_step_sees_every_key(in_order: bool) -> None:
    pool = PagePool(4, PAGE)
    pool.add(1)
    pool.add(2)
    pool.reserve(1, 2)
    if not in_order:
        pool.reserve(2, 1)
    pool.reserve(1, 6)
    step = build([pool.tables[1]], [5], [1], PAGE, torch.device("cpu"))
    assert (step.base is not None) == in_order
    assert step.bias.shape == (1, 1, 6) and (step.bias == 0).all()
    assert step.positions.tolist() == [5] and step.slots.tolist() == [pool.slot(1, 5)]


def test_reserve_of_nothing_takes_nothing() -> None:
    pool = PagePool(2, PAGE)
    pool.add(1)
    pool.reserve(1, 0)
    assert pool.tables[1] == [] and pool.need(1, 0) == 0 and pool.used() == 0
    pool.trim(1, 0)
    check_accounting(pool, {1: 0})


def test_bad_pool_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        PagePool(0, PAGE)
    with pytest.raises(ValueError):
        PagePool(3, 0)


# --- the K/V of kept positions survive a rollback, in the engine's slab ------------------------
def kv_at(slab: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """A slab's K/V [layer, K or V, kv head, len(slots), head dim] at these slots."""
    return slab.index_select(3, torch.tensor(slots, dtype=torch.long))


def fresh_kv(model, tokens: list[int]) -> torch.Tensor:
    """The K/V a fresh prefill of `tokens` writes, in a pool of its own: [L, 2, Hkv, T, D]."""
    pool = PagePool(pages_for(len(tokens), PAGE), PAGE)
    pool.add(0)
    pool.reserve(0, len(tokens))
    slab = slab_for(model, pool.n_pages * PAGE, torch.device("cpu"))
    step = build([pool.tables[0]], [0], [len(tokens)], PAGE, torch.device("cpu"))
    with torch.inference_mode():
        transformer_pass(model, slab, torch.tensor(tokens), step, "none")
    return kv_at(slab, [pool.slot(0, j) for j in range(len(tokens))])


def test_kept_kv_survive_a_rollback_and_the_reuse_of_its_pages(target) -> None:
    """A sequence writes a verify pass of 5 guesses, keeps 1, gives its emptied pages back; another
    sequence takes them and writes there. The kept K/V are untouched, bit for bit, and both
    sequences then continue as the whole-sequence reference does."""
    dev = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    pool = PagePool(12, PAGE)
    slab = slab_for(target, pool.n_pages * PAGE, dev)

    def pass_(seq: int, start: int, tokens: list[int]) -> torch.Tensor:
        pool.reserve(seq, start + len(tokens))
        step = build([pool.tables[seq]], [start], [len(tokens)], PAGE, dev)
        with torch.inference_mode():
            return transformer_pass(target, slab, torch.tensor(tokens), step, "all")[0]

    def slots(seq: int, n: int) -> list[int]:
        return [pool.slot(seq, j) for j in range(n)]

    a, b = [int(t) for t in torch.randint(1, 64, (7,), generator=gen)], PROMPT[:5]
    pool.add(1)
    pool.add(2)
    pass_(1, 0, a[:4])  # interleaved prefills: the tables alternate
    pass_(2, 0, b)
    pass_(1, 4, a[4:])
    guesses = [int(t) for t in torch.randint(1, 64, (5,), generator=gen)]
    pass_(1, 7, guesses)  # the verify pass: positions 7 .. 11, 3 pages
    assert len(pool.tables[1]) == 3
    kept_kv = kv_at(slab, slots(1, 8)).clone()
    b_kv = kv_at(slab, slots(2, 5)).clone()
    free_before = list(pool.free)

    pool.trim(1, 8)  # the first guess kept, 4 rolled back: the third page empties
    emptied = set(pool.free) - set(free_before)
    assert len(pool.tables[1]) == 2 and len(emptied) == 1 and pool.used() == 4
    pool.check()
    more_b = [int(t) for t in torch.randint(1, 64, (3 * PAGE,), generator=gen)]
    pass_(2, 5, more_b)  # b grows into the emptied page and writes there
    assert emptied <= set(pool.tables[2])
    assert torch.equal(kv_at(slab, slots(1, 8)), kept_kv)  # a's kept positions, untouched
    assert torch.equal(kv_at(slab, slots(2, 5)), b_kv)

    true_a = a + guesses[:1]
    more_a = [int(t) for t in torch.randint(1, 64, (6,), generator=gen)]
    got_a = pass_(1, 8, more_a)  # a continues over its kept positions (one of them a kept guess)
    assert kv_close(got_a, reference_logits(target, torch.tensor(true_a + more_a))[8:])
    assert kv_close(kv_at(slab, slots(1, 14)), fresh_kv(target, true_a + more_a))
    got_b = pass_(2, 5 + 3 * PAGE, [7])
    assert kv_close(got_b, reference_logits(target, torch.tensor([*b, *more_b, 7]))[-1:])
    pool.check()


def new_seq(uid: int, prompt: list[int], k: int) -> Seq:
    st = Stats("draft", k)
    return Seq(Request(uid, uid, tuple(prompt), 100), uid, torch.Generator(), None, st, k, list(prompt))


def test_speculative_rounds_roll_back_to_a_fresh_pass(target, draft) -> None:
    """Rounds of a draft that is mostly wrong, two sequences in one pool: after each round the
    page list holds what the kept positions need (emptied pages back in the pool), and at the
    end the target's and the draft's K/V of every kept position are a fresh prefill's, and the
    next logits the whole-sequence reference's."""
    dev, k = torch.device("cpu"), 4
    pool = PagePool(40, PAGE)
    runner = TargetRunner(target, slab_for(target, pool.n_pages * PAGE, dev), pool)
    p = LoadedProposer("draft", draft, Head(draft))
    bp = proposer_for(p, target, pool, Backend())
    assert isinstance(bp, DraftProposer)
    seqs = [new_seq(1, PROMPT, k), new_seq(2, [*PROMPT[3:], 11, 12], k)]
    returned = rolled = 0
    with torch.inference_mode():
        for s in seqs:
            pool.add(s.uid)
            pool.reserve(s.uid, len(s.tokens) + k + 2)
        for s, first in zip(seqs, prefill(runner, bp, seqs), strict=True):
            s.tokens.append(first)
        for _ in range(12):
            for s in seqs:
                pool.reserve(s.uid, s.cached + k + 2)  # what a round may write (`round_ahead`)
            used = pool.used()
            for s, (m, n, emitted) in zip(seqs, decode_round(runner, bp, seqs), strict=True):
                s.tokens.extend(emitted)
                rolled += m > n
                assert s.cached == len(s.tokens) - 1  # every token but `last` is in the cache
                assert len(pool.tables[s.uid]) == pages_for(s.cached, PAGE)
            returned += pool.used() < used
            pool.check()
        assert rolled > 10 and returned > 3  # rollbacks happened, and gave pages back
        for s in seqs:
            ref, _ = generate(target, NONE, list(s.req.prompt), len(s.tokens) - len(s.req.prompt), 0)
            assert s.tokens[len(s.req.prompt) :] == ref  # greedy: the target's own tokens
            true = s.tokens[:-1]
            assert kv_close(kv_at(runner.slab, [pool.slot(s.uid, j) for j in range(s.cached)]), fresh_kv(target, true))
            n_draft = bp.state[s.uid].length  # the draft's cache: what it was fed and is still true
            assert 0 < n_draft <= s.cached
            d_kv = kv_at(bp.slab, [pool.slot(s.uid, j) for j in range(n_draft)])
            assert kv_close(d_kv, fresh_kv(draft, true[:n_draft]))
            pool.reserve(s.uid, s.cached + 1)
            logits, _, _ = runner.verify_pass([s], s.last, [1])
            assert kv_close(logits, reference_logits(target, torch.tensor(s.tokens))[-1:])
