"""The native engine's pass over a flat batch (`native.NativeSteps.batch`, `smallem_batch_step`).

It serves the batch engine (`smallem batch`, `bench --batch`), token trees and the batched
proposers. Checked against the eager flat pass (the reference): logits, hidden states and the
K/V written through page tables that are not in order, ragged rows, tree masks; a row's numbers
equal the native one-sequence pass's bit for bit (same keys, same order); and the engine's
greedy answers with the native engine on equal the target alone, for every proposer.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from conftest import PROMPT, TINY, noisy_copy, random_model, random_mtp
from test_native import close, eager_and_native, halved, no_native

from smallem_cli.backends import native
from smallem_cli.backends.steps import switch
from smallem_cli.engine import batch as B
from smallem_cli.engine.build import pool_pages
from smallem_cli.engine.forward import mtp_pass, slab_for, transformer_pass
from smallem_cli.engine.generate import generate
from smallem_cli.engine.pool import PagePool
from smallem_cli.engine.proposers import DraftGuess, MTPGuess, NoGuess
from smallem_cli.engine.request import Request
from smallem_cli.engine.runner import TargetRunner
from smallem_cli.engine.scheduler import Engine
from smallem_cli.model.llama import MTPModule, Transformer
from smallem_cli.spec.head import Head
from smallem_cli.spec.proposers import NoProposer
from smallem_cli.spec.sampling import Sampling

pytestmark = pytest.mark.skipif(no_native, reason="the native engine needs g++ and an AVX2 CPU")
PS = 4  # small pages: a sequence spans many, handed out shuffled


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> tuple[Transformer, MTPModule, Transformer]:
    """float16-exact target (GQA), MTP module and draft, each with native steps."""
    root = tmp_path_factory.mktemp("native-cache")
    target, mtp = halved(random_model(TINY, seed=0)), halved(random_mtp(TINY, seed=2))
    draft = halved(noisy_copy(target, 0.05, seed=5))
    log: list[str] = []
    assert native.prepare(target, [mtp, draft], log.append, root) == (3, 3), log  # type: ignore[arg-type]
    return target, mtp, draft  # type: ignore[return-value]


def shuffled_tables(lengths: list[int], seed: int) -> tuple[list[list[int]], int]:
    """Page tables covering `lengths`, their pages drawn out of order from one pool -> (tables, pages)."""
    need = [-(-n // PS) for n in lengths]
    pages = list(range(sum(need) + 3))
    random.Random(seed).shuffle(pages)
    out, i = [], 0
    for n in need:
        out.append(pages[i : i + n])
        i += n
    return out, len(pages)


def test_visible_keys_are_the_masks() -> None:
    """`visible`: each row's slots, in position order, where its mask row is 0; a chain step's
    (kv_slots' rows, no copy) read the same as the masks say."""
    b = B.build([[3, 0], [1]], [2, 0], [3, 2], 4, torch.device("cpu"))

    def rows(step: B.BatchStep) -> list[list[int]]:
        vis, start, count = B.visible(step)
        return [vis[int(s) : int(s) + int(c)].tolist() for s, c in zip(start, count, strict=True)]

    want = [[12, 13, 14], [12, 13, 14, 15], [12, 13, 14, 15, 0], [4], [4, 5]]
    assert b.prefix and rows(b) == want
    assert rows(dataclasses.replace(b, prefix=False)) == want  # from the masks
    one = B.build([[2, 3]], [5], [2], 4, torch.device("cpu"))  # one sequence, pages in order
    assert one.base == 8 and rows(one) == [list(range(8, 14)), list(range(8, 15))]
    assert rows(dataclasses.replace(one, prefix=False)) == rows(one)


@pytest.mark.parametrize("head", ["all", "last", "none"])
def test_batch_pass_is_the_eager_one(trio: tuple[Transformer, MTPModule, Transformer], head: str) -> None:
    """Ragged rows of three sequences (a prompt, a round of guesses, one token) through shuffled
    pages: logits, hidden states and the K/V written match the eager flat pass."""
    target = trio[0]
    starts, counts = [0, 9, 17], [7, 5, 1]
    tables, n_pages = shuffled_tables([s + n for s, n in zip(starts, counts, strict=True)], seed=1)
    g = torch.Generator().manual_seed(3)
    slab0 = torch.randn(*slab_for(target, n_pages * PS, torch.device("cpu")).shape, generator=g)  # the past
    ids = torch.randint(0, TINY.vocab_size, (sum(counts),), generator=g)
    b = B.build(tables, starts, counts, PS, torch.device("cpu"))

    def run() -> tuple[torch.Tensor, ...]:
        slab = slab0.clone()
        logits, x = transformer_pass(target, slab, ids, b, head=head)
        return logits, x, slab

    (la, xa, sa), (lb, xb, sb) = eager_and_native(run)
    assert close(la, lb) and close(xa, xb) and close(sa, sb), ((la - lb).abs().max(), (xa - xb).abs().max())
    assert lb.shape[0] == {"all": 13, "last": 3, "none": 0}[head]


def test_tree_and_mtp_passes_are_the_eager_ones(trio: tuple[Transformer, MTPModule, Transformer]) -> None:
    """A pass over tree nodes (each sees the prefix and its ancestors) and the MTP module's
    pass over pairs (target state, token) match the eager ones."""
    target, mtp, _ = trio
    tables, n_pages = shuffled_tables([12 + 6, 5 + 6], seed=2)
    parents = [[-1, 0, 0, 1, 2, -1], [-1, -1, 1, 2, 0, 4]]
    b = B.build_tree(tables, [12, 5], parents, [[0, 1, 2, 3, 4, 5], [1, 2, 3, 5]], PS, torch.device("cpu"))
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, TINY.vocab_size, (10,), generator=g)
    h = torch.randn(10, TINY.dim, generator=g)
    slab0 = torch.randn(*slab_for(target, n_pages * PS, torch.device("cpu")).shape, generator=g)
    mslab0 = torch.randn(*slab_for(mtp, n_pages * PS, torch.device("cpu")).shape, generator=g)

    def run() -> tuple[torch.Tensor, ...]:
        slab, mslab = slab0.clone(), mslab0.clone()
        logits, x = transformer_pass(target, slab, ids, b, head="all")
        return logits, x, slab, mtp_pass(mtp, target, mslab, h, ids, b), mslab

    a, c = eager_and_native(run)
    assert all(close(x, y) for x, y in zip(a, c, strict=True)), [(x - y).abs().max() for x, y in zip(a, c, strict=True)]


def test_a_row_has_the_one_sequence_pass_numbers(trio: tuple[Transformer, MTPModule, Transformer]) -> None:
    """The batch pass and the one-sequence pass give one sequence's rows the same numbers, bit for
    bit: the same keys in the same order, the same sums (so batching changes no greedy token)."""
    target = trio[0]
    cache = target.new_cache(4)
    seq = cache.new_sequence()
    tokens = torch.randint(0, TINY.vocab_size, (25,), generator=torch.Generator().manual_seed(9))
    switch("native")
    try:
        with torch.no_grad():
            target(tokens[:20], cache, seq)
            one_logits, one_x = target(tokens[20:], cache, seq)  # [5, V], [5, d]
            cache.keep(seq, 20)
            slab = cache.kv.clone()  # [L, 2, Hkv, slots, D]: the prompt's K/V at slots 0 .. 19
            table = list(range(slab.shape[3] // cache.page_size))
            b = B.build([table], [20], [5], cache.page_size, torch.device("cpu"))
            logits, x = transformer_pass(target, slab, tokens[20:], b, head="all")
    finally:
        switch(None)
    assert torch.equal(logits, one_logits) and torch.equal(x, one_x)


def _engine(trio: tuple[Transformer, MTPModule, Transformer], kind: str, k: int) -> Engine:
    target, mtp, draft = trio
    pool = PagePool(pool_pages(8, target.cfg.max_seq_len, 16), 16)
    proposer = {
        "none": lambda: NoGuess(),
        "mtp": lambda: MTPGuess(target, mtp, pool, Head(target)),
        "draft": lambda: DraftGuess(draft, pool, Head(draft), "draft"),
    }[kind]()
    slab = slab_for(target, pool.n_pages * 16, torch.device("cpu"))
    return Engine(TargetRunner(target, slab, pool), proposer, k, auto_k=False, max_batch=8, eot=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["none", "mtp", "draft"])
def test_native_batches_are_the_target_alone(trio: tuple[Transformer, MTPModule, Transformer], kind: str) -> None:
    """12 requests, 8 at a time, every pass native: each answer is the target alone's greedy text,
    and a seeded sampled request draws what it draws on the eager engine."""
    target = trio[0]
    rng = random.Random(5)
    ps = [[rng.randrange(1, TINY.vocab_size) for _ in range(rng.randrange(2, 30))] for _ in range(12)]
    reqs = [Request(i, i, tuple(p), 40 - i, Sampling()) for i, p in enumerate(ps)]
    switch("native")
    try:
        got = {f.request.index: f.tokens for f in _engine(trio, kind, 0 if kind == "none" else 3).run(reqs)}
    finally:
        switch(None)
    for r in reqs:
        ref, _ = generate(target, NoProposer(), list(r.prompt), r.max_new_tokens, 0)
        assert got[r.index] == ref, r.index
    sampled = [Request(0, 0, tuple(PROMPT), 30, Sampling(temperature=1.0, seed=3))]

    def draw() -> list[int]:
        return next(iter(_engine(trio, kind, 0 if kind == "none" else 3).run(sampled))).tokens

    a, b = eager_and_native(draw)
    assert a == b


def test_native_batch_pass_is_used(trio: tuple[Transformer, MTPModule, Transformer], monkeypatch) -> None:
    """With the native engine on, the engine's passes over several sequences are C calls."""
    calls: list[int] = []
    real = native.NativeSteps.batch

    def spy(self, tokens, *a, **kw):
        calls.append(int(tokens.shape[0]))
        return real(self, tokens, *a, **kw)

    monkeypatch.setattr(native.NativeSteps, "batch", spy)
    reqs = [Request(i, i, tuple(PROMPT[: 5 + i]), 10, Sampling()) for i in range(4)]
    switch("native")
    try:
        list(_engine(trio, "mtp", 2).run(reqs))
    finally:
        switch(None)
    assert calls and max(calls) > 4  # a prefill of several prompts, rounds of several sequences


def test_cpu_only(trio: tuple[Transformer, MTPModule, Transformer]) -> None:
    """A slab off the CPU is never handed to the C code (the eager pass serves it)."""
    from smallem_cli.engine.forward import _native

    assert _native(trio[0], torch.empty(0, device="meta")) is None
    switch("native")
    try:
        assert _native(trio[0], torch.empty(0)) is not None
    finally:
        switch(None)


def test_native_token_trees_are_the_target_alone(trio: tuple[Transformer, MTPModule, Transformer]) -> None:
    """Greedy token trees with every pass native (the tree's growth and its verify pass): the
    target alone's tokens, with more than one token kept per pass."""
    from smallem_cli.spec.proposers import MTPProposer

    target, mtp, _ = trio
    ref, _ = generate(target, NoProposer(), PROMPT, 40, 0)
    switch("native")
    try:
        calls: list[int] = []
        real = native.NativeSteps.batch

        def spy(self, tokens, *a, **kw):
            calls.append(int(tokens.shape[0]))
            return real(self, tokens, *a, **kw)

        native.NativeSteps.batch = spy  # type: ignore[method-assign]
        try:
            got, st = generate(target, MTPProposer(target, mtp, 200, tree=(8, 4)), PROMPT, 40, 3)
        finally:
            native.NativeSteps.batch = real  # type: ignore[method-assign]
    finally:
        switch(None)
    assert got == ref and st.tokens_per_pass > 1 and calls
