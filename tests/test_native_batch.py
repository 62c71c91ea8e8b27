"""The native engine's pass over a flat batch (`native.NativeSteps.batch`, `smallem_batch_step`).

It serves the batch engine (`smallem batch`, `bench --batch`), token trees and the batched
proposers. Checked against the eager flat pass (the reference): logits, hidden states and the
K/V written through page tables that are not in order, ragged rows, tree masks; a row's numbers
equal the native one-sequence step's bit for bit (same keys, same order); and the engine's
greedy answers on the native backend equal the target alone, for every proposer.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from conftest import PROMPT, TINY, noisy_copy, random_model, random_mtp
from engine_help import halved, proposer, sequence_pass, spy_native
from test_native import CPU, EAGER, close, eager_and_native, no_native, one_sequence, prepared

from smallem_cli.backends import engines
from smallem_cli.backends.engines import Backend
from smallem_cli.backends.native import KV_DTYPE
from smallem_cli.engine import build as engine_build
from smallem_cli.engine.config import EngineConfig
from smallem_cli.engine.family import NONE, LoadedProposer
from smallem_cli.engine.forward import mtp_pass, slab_for, transformer_pass
from smallem_cli.engine.generate import generate
from smallem_cli.engine.request import Request
from smallem_cli.engine.scheduler import Engine
from smallem_cli.kv.step import BatchStep, build, build_tree, visible
from smallem_cli.model.llama import MTPModule, Transformer
from smallem_cli.spec.head import Head
from smallem_cli.spec.sampling import Sampling

pytestmark = pytest.mark.skipif(no_native, reason="the native engine needs g++ and an AVX2 CPU")
PS = 4  # small pages: a sequence spans many, handed out shuffled
Trio = tuple[Transformer, MTPModule, Transformer, Backend]


@pytest.fixture(scope="module")
def trio() -> Trio:
    """float16-exact target (GQA), MTP module and draft, and a native backend with steps for each."""
    target, mtp = halved(random_model(TINY, seed=0)), halved(random_mtp(TINY, seed=2))
    draft = halved(noisy_copy(target, 0.05, seed=5))  # type: ignore[arg-type]
    return target, mtp, draft, prepared(target, mtp, draft)  # type: ignore[return-value, arg-type]


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
    b = build([[3, 0], [1]], [2, 0], [3, 2], 4, torch.device("cpu"))

    def rows(step: BatchStep) -> list[list[int]]:
        vis, start, count = visible(step)
        return [vis[int(s) : int(s) + int(c)].tolist() for s, c in zip(start, count, strict=True)]

    want = [[12, 13, 14], [12, 13, 14, 15], [12, 13, 14, 15, 0], [4], [4, 5]]
    assert b.prefix and rows(b) == want
    assert rows(dataclasses.replace(b, prefix=False)) == want  # from the masks
    one = build([[2, 3]], [5], [2], 4, torch.device("cpu"))  # one sequence, pages in order
    assert one.base == 8 and rows(one) == [list(range(8, 14)), list(range(8, 15))]
    assert rows(dataclasses.replace(one, prefix=False)) == rows(one)


@pytest.mark.parametrize("head", ["all", "last", "none"])
def test_batch_pass_is_the_eager_one(trio: Trio, head: str) -> None:
    """Ragged rows of three sequences (a prompt, a round of guesses, one token) through shuffled
    pages: logits, hidden states and the K/V written match the eager flat pass."""
    target, b = trio[0], trio[3]
    starts, counts = [0, 9, 17], [7, 5, 1]
    tables, n_pages = shuffled_tables([s + n for s, n in zip(starts, counts, strict=True)], seed=1)
    g = torch.Generator().manual_seed(3)
    slab0 = torch.randn(*slab_for(target, n_pages * PS, CPU).shape, generator=g).to(KV_DTYPE)  # the past
    ids = torch.randint(0, TINY.vocab_size, (sum(counts),), generator=g)
    step = build(tables, starts, counts, PS, CPU)

    def run(bk: Backend) -> tuple[torch.Tensor, ...]:
        slab = slab0.clone()
        logits, x = transformer_pass(target, slab, ids, step, head, bk.steps(target))
        return logits, x, slab

    (la, xa, sa), (lb, xb, sb) = eager_and_native(run, b)
    assert close(la, lb) and close(xa, xb) and close(sa, sb), ((la - lb).abs().max(), (xa - xb).abs().max())
    assert lb.shape[0] == {"all": 13, "last": 3, "none": 0}[head]
    assert not torch.equal(sb, slab0)  # the new K/V were written


def test_tree_and_mtp_passes_are_the_eager_ones(trio: Trio) -> None:
    """A pass over tree nodes (each sees the prefix and its ancestors) and the MTP module's
    pass over pairs (target state, token) match the eager ones."""
    target, mtp, _, bk = trio
    tables, n_pages = shuffled_tables([12 + 6, 5 + 6], seed=2)
    parents = [[-1, 0, 0, 1, 2, -1], [-1, -1, 1, 2, 0, 4]]
    b = build_tree(tables, [12, 5], parents, [[0, 1, 2, 3, 4, 5], [1, 2, 3, 5]], PS, CPU)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, TINY.vocab_size, (10,), generator=g)
    h = torch.randn(10, TINY.dim, generator=g)
    slab0 = torch.randn(*slab_for(target, n_pages * PS, CPU).shape, generator=g).to(KV_DTYPE)
    mslab0 = torch.randn(*slab_for(mtp, n_pages * PS, CPU).shape, generator=g).to(KV_DTYPE)

    def run(be: Backend) -> tuple[torch.Tensor, ...]:
        slab, mslab = slab0.clone(), mslab0.clone()
        logits, x = transformer_pass(target, slab, ids, b, "all", be.steps(target))
        return logits, x, slab, mtp_pass(mtp, target, mslab, h, ids, b, be.steps(mtp)), mslab

    a, c = eager_and_native(run, bk)
    assert all(close(x, y) for x, y in zip(a, c, strict=True)), [(x - y).abs().max() for x, y in zip(a, c, strict=True)]


def test_a_row_has_the_one_sequence_pass_numbers(trio: Trio) -> None:
    """The flat pass and the one-sequence step give one sequence's rows the same numbers, bit for
    bit: the same keys in the same order, the same sums (so batching changes no greedy token)."""
    target, b = trio[0], trio[3]
    steps = b.steps(target)
    tokens = torch.randint(0, TINY.vocab_size, (25,), generator=torch.Generator().manual_seed(9))
    one_logits, one_x, _ = one_sequence(target, tokens[:20], tokens[20:], steps)  # [5, V], [5, d]
    logits, x = sequence_pass(target, tokens[:20], tokens[20:], steps)
    assert one_logits.shape == logits.shape == (5, TINY.vocab_size)
    assert torch.equal(logits, one_logits) and torch.equal(x, one_x)


def _engine(trio: Trio, kind: str, k: int, backend: Backend) -> Engine:
    """The batch engine: 8 sequences at a time, the proposer `kind`'s passes on `backend`."""
    target, mtp, draft, _ = trio
    p = proposer(kind, target, {"mtp": mtp, "draft": draft}.get(kind.removeprefix("ngram").removeprefix("+")))
    return engine_build.build(EngineConfig(target, p, backend, k, max_batch=8))


@pytest.mark.parametrize("kind", ["none", "ngram", "mtp", "draft", "ngram+mtp", "ngram+draft"])
def test_native_batches_are_the_target_alone(trio: Trio, kind: str) -> None:
    """12 requests, 8 at a time, every pass native: each answer is the target alone's greedy text,
    and a seeded sampled request draws what it draws on the eager backend."""
    target, b = trio[0], trio[3]
    k = 0 if kind == "none" else 3
    rng = random.Random(5)
    ps = [[rng.randrange(1, TINY.vocab_size) for _ in range(rng.randrange(2, 30))] for _ in range(12)]
    reqs = [Request(i, i, tuple(p), 40 - i, Sampling()) for i, p in enumerate(ps)]
    got = {f.request.index: f.tokens for f in _engine(trio, kind, k, b).run(reqs)}
    for r in reqs:
        ref, _ = generate(target, NONE, list(r.prompt), r.max_new_tokens, 0)
        assert got[r.index] == ref, r.index
    sampled = [Request(0, 0, tuple(PROMPT), 30, Sampling(temperature=1.0, seed=3))]

    def draw(bk: Backend) -> list[int]:
        return next(iter(_engine(trio, kind, k, bk).run(sampled))).tokens

    a, c = eager_and_native(draw, b)
    assert a == c and len(c) == 30


def test_native_batch_pass_is_used(trio: Trio, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the native backend, the engine's passes over several sequences are C calls."""
    calls = spy_native(monkeypatch)
    reqs = [Request(i, i, tuple(PROMPT[: 5 + i]), 10, Sampling()) for i in range(4)]
    list(_engine(trio, "mtp", 2, EAGER).run(reqs))
    assert calls == []  # the eager backend: no C call
    list(_engine(trio, "mtp", 2, trio[3]).run(reqs))
    assert calls and max(calls) > 4  # a prefill of several prompts, rounds of several sequences


def test_native_runs_on_a_cpu_only() -> None:
    """A slab off the CPU is never handed to the C code: the native engines are refused on another
    device (one line, before anything is built), auto there is eager, and an eager backend gives
    no model native steps (its passes are the eager ones)."""
    for device in (torch.device("cuda"), torch.device("meta")):
        for name in engines.NATIVE:
            with pytest.raises(ValueError, match=f"--engine {name} runs on a CPU only"):
                engines.engine_mode(name, device)
            with pytest.raises(ValueError, match="runs on a CPU only"):
                engines.bench_engines(f"eager,{name}", device)
        assert engines.engine_mode("auto", device) == "eager"
        assert engines.bench_engines("auto", device) == ("eager",)
    model = random_model(TINY, seed=0)
    assert EAGER.prepare(model, []) == "eager" and EAGER.steps(model) is None


def test_native_token_trees_are_the_target_alone(trio: Trio, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy token trees with every pass native (the tree's growth and its verify pass): the
    target alone's tokens, with more than one token kept per pass."""
    target, mtp, _, b = trio
    ref, _ = generate(target, NONE, PROMPT, 40, 0)
    calls = spy_native(monkeypatch)
    p = LoadedProposer("mtp", mtp.pack(), Head(target), tree=(8, 4))
    got, st = generate(target, p, PROMPT, 40, 3, backend=b)
    assert got == ref and st.tokens_per_pass > 1 and calls
