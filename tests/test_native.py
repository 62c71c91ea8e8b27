"""The native engine (`smallem_cli/backends/native/`): C++ kernels over a model's float16 weights,
run for the models a native backend (`engines.Backend`) gave steps.

Every check compares it with the eager backend, the reference: a pass's logits, hidden states
and K/V to float32 rounding (the one-sequence step a prompt and a generation's rounds take, the
flat pass, the MTP module's), greedy generations token for token (every proposer, and the
target alone's), the chains of guesses against the step-by-step ones. Then what it refuses
(weights float16 cannot hold, widths its kernels do not tile, a compiler that fails, a
shared cache folder), that it builds its library once, and the CLI.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from conftest import DRAFT_CFG, PROMPT, TINY, Family, Trained, noisy_copy, random_model, random_mtp
from engine_help import halved, proposer, sequence_pass
from typer.testing import CliRunner

from smallem_cli.backends import engines, native
from smallem_cli.backends.engines import Backend
from smallem_cli.cli.app import app
from smallem_cli.engine.family import NONE
from smallem_cli.engine.forward import mtp_pass, slab_for, transformer_pass
from smallem_cli.engine.generate import generate
from smallem_cli.engine.proposers import DraftProposer, MTPProposer
from smallem_cli.engine.request import Request
from smallem_cli.engine.sequence import Seq
from smallem_cli.kv.pool import PagePool, pages_for
from smallem_cli.kv.step import build
from smallem_cli.model.llama import MTPModule, Transformer
from smallem_cli.spec.head import Head
from smallem_cli.spec.sampling import Sampling
from smallem_cli.stats import Stats

no_native = shutil.which("g++") is None or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512")
pytestmark = pytest.mark.skipif(no_native, reason="the native engine needs g++ and an AVX2 CPU")
CPU = torch.device("cpu")
PS = 16  # page size of the one-sequence layouts below
EAGER = Backend()
R = TypeVar("R")


def prepared(target: Transformer, *models: Transformer | MTPModule, name: str = "native") -> Backend:
    """A backend `name` whose steps serve the target and every model (asserted: none refused)."""
    b, log = Backend(name), []
    assert b.prepare(target, list(models), log.append) == name, log
    return b


def eager_and_native(fn: Callable[[Backend], R], b: Backend) -> tuple[R, R]:
    """fn(backend) on the eager backend, then on `b`, a native one."""
    with torch.no_grad():
        return fn(EAGER), fn(b)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to float32 rounding: the kernels sum in another order (and apply the norms' weights
    to the activations, where the eager path folds them into its float32 weights)."""
    if a.shape != b.shape or a.numel() == 0:
        return a.shape == b.shape
    return bool(torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(a.abs().max())))


def one_sequence(
    model: Transformer,
    past: torch.Tensor,
    new: torch.Tensor,
    steps: native.NativeSteps | None = None,
    head: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`new` after `past`, one sequence whose pages lie in order (slots 0 ..): the past through
    the flat pass, then `new` through the model's native one-sequence step (`NativeSteps.step`,
    what `TargetRunner.one_pass` runs for a prompt or a round) with `steps`, else the eager flat
    pass -> (logits: every row's, or none (no `head`), hidden [T, d], the K/V `new` wrote [L, 2, Hkv, T, D])."""
    P, T = past.shape[0], new.shape[0]
    slab = slab_for(model, (pages_for(P + T, PS) + 1) * PS, CPU)
    table = list(range(slab.shape[3] // PS))
    with torch.no_grad():
        if P:
            transformer_pass(model, slab, past, build([table], [0], [P], PS, CPU), "none", steps)
        if steps is None:
            logits, hidden = transformer_pass(model, slab, new, build([table], [P], [T], PS, CPU), "all")
            logits = logits if head else logits[:0]
        else:
            assert steps.serves(P, P + T)
            logits, hidden, kv, _ = steps.step(new, slab[:, :, :, :P], T if head else 0)
            assert kv.data_ptr() == slab[:, :, :, P:].data_ptr()  # written in place, right after the past
    return logits, hidden, slab[:, :, :, P : P + T].clone()


def mtp_sequence(
    mtp: MTPModule, target: Transformer, h: torch.Tensor, ids: torch.Tensor, P: int, steps=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP module's pass over pairs (h [n, d], ids [n]) P .. n-1 after the first P, one sequence
    in its own slab (`forward.mtp_pass`: native with `steps`) -> (its states [n-P, d], the K/V written)."""
    n = ids.shape[0]
    slab = slab_for(mtp, (pages_for(n, PS) + 1) * PS, CPU)
    table = list(range(slab.shape[3] // PS))
    with torch.no_grad():
        mtp_pass(mtp, target, slab, h[:P], ids[:P], build([table], [0], [P], PS, CPU), steps)
        out = mtp_pass(mtp, target, slab, h[P:], ids[P:], build([table], [P], [n - P], PS, CPU), steps)
    return out, slab[:, :, :, P:n].clone()


def first_round(
    b: Backend,
    target: Transformer,
    model: Transformer | MTPModule,
    fed: torch.Tensor,
    last: torch.Tensor,
    hidden: torch.Tensor,
    k: int,
    sampling: Sampling,
    head: Head | None = None,
    seen: torch.Tensor | None = None,
) -> tuple[MTPProposer | DraftProposer, Seq, torch.Tensor, torch.Tensor | None]:
    """A sequence's first round of k guesses from the engine's batched proposer of `model` (the MTP
    module over `target`, or a draft) on backend `b`: the sequence alone in its pool (its pages in
    order: with native steps the round is one chain call, `NativeSteps.chain`), started on the
    prompt `fed` (the target's states `hidden` [P, d]) and `last`, the token after it; `seen`: the
    repetition penalty's context -> (the proposer, the sequence, its guesses [k], q [k, V] or None)."""
    n = fed.shape[0]
    pool = PagePool(pages_for(n + k + 1, PS) + 1, PS)
    s = Seq(
        req=Request(0, 0, tuple(fed.tolist()), k + 1, sampling),
        uid=1,
        gen=torch.Generator().manual_seed(sampling.seed),
        warp=sampling.warp(),
        stats=Stats("test", k),
        k=k,
        tokens=[*fed.tolist(), int(last)],
        last=last.view(1),
        cached=n,
        seen=seen,
    )
    pool.add(s.uid)
    pool.reserve(s.uid, n + k + 1)
    p: MTPProposer | DraftProposer
    if isinstance(model, MTPModule):
        p = MTPProposer(target, model, pool, head or Head(target), b)
    else:
        p = DraftProposer(model, pool, head or Head(model), "draft", b)
    with torch.no_grad():
        p.start([s], [fed], [hidden])
        ((tokens, q),) = p.propose([s], [k])
    return p, s, tokens, q


@pytest.fixture(scope="module")
def pair() -> tuple[Transformer, MTPModule, Backend]:
    """A float16-exact target (GQA: 4 heads on 2 kv heads) and MTP module, and a native backend
    with steps for both."""
    target, mtp = halved(random_model(TINY, seed=0)), halved(random_mtp(TINY, seed=2))
    return target, mtp, prepared(target, mtp)  # type: ignore[return-value, arg-type]


@pytest.fixture(scope="module")
def draft(pair: tuple[Transformer, MTPModule, Backend]) -> Transformer:
    """A float16-exact draft that agrees with the target often, not always; the pair's backend has its steps."""
    target, _, b = pair
    d = halved(noisy_copy(target, 0.05, seed=5))
    assert b.prepare(target, [d]) == "native"
    return d  # type: ignore[return-value]


@pytest.mark.parametrize(("T", "head"), [(1, True), (2, False), (3, True), (5, True), (11, True), (16, True)])
def test_target_pass_is_the_eager_one(pair: tuple[Transformer, MTPModule, Backend], T: int, head: bool) -> None:
    """Logits, hidden states and the K/V a pass writes match the eager pass's, for any T: the
    one-sequence step (with or without its head), and the flat pass over the same sequence (every
    row's logits)."""
    target, _, b = pair
    steps = b.steps(target)
    assert steps is not None
    tokens = torch.randint(0, TINY.vocab_size, (40,), generator=torch.Generator().manual_seed(T))
    past, new = tokens[:20], tokens[20 : 20 + T]
    a, c = one_sequence(target, past, new, None, head), one_sequence(target, past, new, steps, head)
    assert c[1].shape[0] == T and c[0].shape[0] == (T if head else 0)
    if not head:  # no logits (the step's empty rows are not the head's width: nothing reads them)
        a, c = a[1:], c[1:]
    assert all(close(x, y) for x, y in zip(a, c, strict=True)), [(x - y).abs().max() for x, y in zip(a, c, strict=True)]
    flat_a, flat_c = sequence_pass(target, past, new), sequence_pass(target, past, new, steps)
    assert close(flat_a[0], flat_c[0]) and close(flat_a[1], flat_c[1]) and flat_c[0].shape == (T, TINY.vocab_size)


def test_verify_pass_reads_its_argmax_and_finite_flag() -> None:
    """A pass with a head also returns each row's argmax (torch's) and 1 if every logit is finite;
    with a NaN in the final norm the flag is 0, and a generation stops at its first round with
    NonFiniteError (its prefill's logits, from the eager head, were finite: one token came out)."""
    from smallem_cli.engine.build import build as build_engine
    from smallem_cli.engine.config import EngineConfig
    from smallem_cli.engine.generate import answer
    from smallem_cli.spec.sampling import NonFiniteError

    model = halved(random_model(TINY, seed=4))
    b = prepared(model)  # type: ignore[arg-type]
    steps = b.steps(model)
    assert steps is not None
    tokens = torch.randint(0, TINY.vocab_size, (24,), generator=torch.Generator().manual_seed(4))
    slab = slab_for(model, 2 * PS, CPU)
    with torch.no_grad():
        transformer_pass(model, slab, tokens[:19], build([[0, 1]], [0], [19], PS, CPU), "none")  # type: ignore[arg-type]
        past = slab[:, :, :, :19]
        logits, _, _, top = steps.step(tokens[19:], past, 5)
        assert top is not None
        assert top.tolist() == [*logits.argmax(-1).tolist(), 1]
        g = next(t for t in steps.keep if t.data_ptr() == steps.mw.g_final)  # the final norm the C code reads
        g[3] = float("nan")
        top = steps.step(tokens[19:], past, 5)[3]
        assert top is not None and top[-1] == 0
    chunks: list[list[int]] = []
    with pytest.raises(NonFiniteError, match="not finite"):
        for chunk in answer(build_engine(EngineConfig(model, NONE, b, 0)), Request(0, 0, tuple(PROMPT), 20)):  # type: ignore[arg-type]
            chunks.append(chunk)
    assert chunks == []  # the prompt's pass reads the same final norm: its logits already fail


def native_rule(
    logits: torch.Tensor,
    temperature: float,
    drafts: torch.Tensor,
    q: torch.Tensor,
    g: torch.Generator,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
):
    """`smallem_verify_sample` over B independent rows (logits [B, k+1, V], guesses [B, k], q [B, k, V]),
    one call per row on uniforms drawn for all of them at once -> [B, k + 2]: n, then the tokens."""
    lib = native.kernels.loaded()
    B, k, V = drafts.shape[0], drafts.shape[1], logits.shape[-1]
    logits, q, drafts = logits.float().contiguous(), q.float().contiguous(), drafts.contiguous()
    u, u_next = torch.rand(B, k, generator=g), torch.rand(B, generator=g, dtype=torch.float64)
    out, r = torch.empty(B, k + 2, dtype=torch.long), torch.empty(3 * V)
    ptrs = [t.data_ptr() for t in (logits, drafts, q, u, u_next, out)]
    sizes = [(k + 1) * V * 4, k * 8, k * V * 4, k * 4, 8, (k + 2) * 8]  # bytes per row
    for i in range(B):
        lg, dr, qq, uu, un, o = (p + i * s for p, s in zip(ptrs, sizes, strict=True))
        lib.smallem_verify_sample(lg, k, V, 1.0 / temperature, dr, qq, uu, un, r.data_ptr(), o, top_k, top_p, min_p)
    return out


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.0, 3, 0.85, 0.0), (0.8, 0, 0.85, 0.0), (1.0, 0, 1.0, 0.35)],
)
def test_native_verification_is_exact(
    pair: tuple[Transformer, MTPModule, Backend], temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    """The C rule a native run verifies sampled guesses with (`native.verify_sample`, whose draws
    are `verify_sample`'s: test_generation_is_the_eager_one), from raw logits and a temperature,
    with top-k, top-p or min-p too: the seed's chi-square on 200,000 two-token generations (as
    test_verify's) passes against the target's law (`warp`), fails against the proposer. The
    filters' cut-offs lie clear of the targets' probabilities, and P2's rows are nudged apart
    (no two equal): at a tie or on a boundary, which token stays is a convention, and the C
    code's (token order) and torch's may differ."""
    from test_verify import CHI2_CRIT, P1, P2, Q1, Q2, chi_square

    from smallem_cli.spec.verify import sample, warp

    assert pair  # the library is loaded
    L1, L2 = P1.log(), P2.log() + torch.linspace(0, 0.01, 5)  # raw logits: the target's law is warp(L, temperature)
    filters = {"top_k": top_k or None, "top_p": top_p, "min_p": min_p}
    p1, p2 = warp(L1, temperature, **filters), warp(L2, temperature, **filters)
    g = torch.Generator().manual_seed(21)
    N, V = 200_000, 5
    d1 = sample(Q1.expand(N, V), g)
    d2 = sample(Q2[d1], g)
    logits = torch.stack([L1.expand(N, V), L2[d1], L2[d2]], dim=1)  # [N, 3, V]
    cut = (top_k, top_p, min_p)
    out = native_rule(logits, temperature, torch.stack([d1, d2], 1), torch.stack([Q1.expand(N, V), Q2[d1]], 1), g, *cut)
    n, t1 = out[:, 0], out[:, 1]
    assert torch.equal(t1[n >= 1], d1[n >= 1])
    d = sample(Q2[t1], g)  # the second token, after a rejection: a round of its own from t1
    second = native_rule(torch.stack([L2[t1], L2[t1]], 1), temperature, d[:, None], Q2[t1][:, None], g, *cut)
    t2 = torch.where(n >= 1, out[:, 2], second[:, 1])
    counts = torch.bincount(t1 * V + t2, minlength=V * V).view(V, V)
    chi_p, df, impossible = chi_square(counts, N * p1[:, None] * p2)
    assert impossible == 0 and chi_p < CHI2_CRIT[df], (chi_p, df)
    chi_q, _, _ = chi_square(counts, N * Q1[:, None] * Q2)
    assert chi_q > 1000, chi_q


def test_native_penalty_is_torchs(pair: tuple[Transformer, MTPModule, Backend]) -> None:
    """The repetition penalty a native round applies (`native.penalize_argmax`, in place) gives
    `verify.penalize`'s numbers bit for bit, and each row's argmax as torch's (the first largest):
    a context, tokens fed once or twice in the pass, logits of both signs, ties."""
    from smallem_cli.spec.verify import penalize

    assert pair  # the library is loaded
    g = torch.Generator().manual_seed(5)
    V = 300
    for trial in range(20):
        T = 1 + trial % 6
        rows = torch.randn(T, V, generator=g) * 3
        rows[:, :8] = rows[0, 8]  # ties, some of them penalised
        seen = torch.rand(V, generator=g) < 0.1
        fed = torch.randint(0, V, (T,), generator=g)
        if T > 2:
            fed[2] = fed[0]  # fed twice
        penalty = (1.2, 0.8, 3.0)[trial % 3]
        want = penalize(rows, seen, fed, penalty)
        got = rows.clone()
        top = native.penalize_argmax(got, seen, fed, penalty)
        assert torch.equal(got, want) and torch.equal(top, want.argmax(-1)), trial


def test_pass_refuses_a_slab_without_room(pair: tuple[Transformer, MTPModule, Backend]) -> None:
    """A pass writes its K/V into the slab right after the past it reads: with no room there
    (a past that ends the slab) it refuses, rather than write past the slab's memory."""
    target, _, b = pair
    c, steps = target.cfg, b.steps(target)
    assert steps is not None
    slab = torch.zeros(c.n_layers, 2, c.n_kv_heads, 20, c.head_dim, dtype=native.KV_DTYPE)
    with pytest.raises(ValueError, match="no room in the slab for 1 positions after a past of 20"):
        steps.step(torch.tensor([3]), slab, 1)
    new = steps.step(torch.tensor([3]), slab[:, :, :, :19], 1)[2]
    assert new.data_ptr() == slab[:, :, :, 19:].data_ptr() and slab[:, :, :, 19].abs().sum() > 0  # written in place


def test_widths_not_multiples_of_eight() -> None:
    """A vocabulary of 61 tokens: the head's last panel of eight rows is padded, and only its
    real columns are written (a prompt's pass over an empty past, then a verify-sized pass, by the
    one-sequence step and by the flat pass)."""
    model = halved(random_model(dataclasses.replace(TINY, vocab_size=61), seed=9))
    b = prepared(model)  # type: ignore[arg-type]
    tokens = torch.randint(0, 61, (24,), generator=torch.Generator().manual_seed(9))

    def passes(bk: Backend) -> tuple[torch.Tensor, ...]:
        steps = bk.steps(model)
        first = one_sequence(model, tokens[:0], tokens[:19], steps)[0]  # type: ignore[arg-type]
        logits, hidden, _ = one_sequence(model, tokens[:19], tokens[19:], steps)  # type: ignore[arg-type]
        flat = sequence_pass(model, tokens[:19], tokens[19:], steps)[0]  # type: ignore[arg-type]
        return first, logits, hidden, flat

    a, c = eager_and_native(passes, b)
    assert c[1].shape == c[3].shape == (5, 61) and c[0].shape == (19, 61)
    assert all(close(x, y) for x, y in zip(a, c, strict=True))


def test_mtp_pass_is_the_eager_one(pair: tuple[Transformer, MTPModule, Backend]) -> None:
    """The MTP module's pass over 4 pairs after 8 (`forward.mtp_pass`): its states and the K/V it
    writes match the eager pass's."""
    target, mtp, b = pair
    g = torch.Generator().manual_seed(1)
    h, nxt = torch.randn(12, TINY.dim, generator=g) * 3, torch.randint(0, TINY.vocab_size, (12,), generator=g)
    a, c = eager_and_native(lambda bk: mtp_sequence(mtp, target, h, nxt, 8, bk.steps(mtp)), b)
    assert close(a[0], c[0]) and close(a[1], c[1]) and c[0].shape == (4, TINY.dim)


def chain_spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record each call of `NativeSteps.chain` (its k)."""
    calls: list[int] = []
    chain = native.NativeSteps.chain
    monkeypatch.setattr(
        native.NativeSteps, "chain", lambda self, ids, k, *a, **kw: calls.append(k) or chain(self, ids, k, *a, **kw)
    )
    return calls


@pytest.mark.parametrize(
    ("cut", "sampled", "n", "k", "penalised"),
    [
        (0, False, 10, 4, False),
        (40, False, 10, 4, False),
        (37, False, 10, 4, False),
        (0, True, 10, 4, False),
        (37, True, 10, 4, False),
        (0, False, 70, 4, False),
        (0, False, 10, 1, False),
        (37, True, 10, 1, False),
        (0, False, 10, 4, True),
        (37, True, 10, 4, True),
    ],
)
def test_mtp_chain_guesses_as_the_steps_do(
    pair: tuple[Transformer, MTPModule, Backend],
    monkeypatch: pytest.MonkeyPatch,
    cut: int,
    sampled: bool,
    n: int,
    k: int,
    penalised: bool,
) -> None:
    """The native chain (one call for the catch-up on n pairs and k guesses, one guess too) guesses
    what the engine's step-by-step loop (`MTPProposer.propose`) guesses on the eager backend, with the
    whole head or one cut to some tokens (37: the last panel of eight rows padded), greedy or
    sampled (the same draws of the sequence's generator, and the q each guess was drawn from),
    and leaves the module's cache as the loop does: the k-1 chained entries after the n true ones,
    dropped when the round ends. A backlog longer than a native pass (70 pairs) is no chain's: the
    loop serves it, on native passes. Under a repetition penalty too (each guess scored over the
    context and the guesses before it)."""
    target, mtp, b = pair
    head = Head(target, torch.arange(TINY.vocab_size - 1, -1, -1)[:cut]) if cut else None
    calls = chain_spy(monkeypatch)
    g = torch.Generator().manual_seed(3)
    for trial in range(4):
        h, fed = torch.randn(n, TINY.dim, generator=g) * 3, torch.randint(0, TINY.vocab_size, (n + 1,), generator=g)
        seen = torch.rand(TINY.vocab_size, generator=g) < 0.3 if penalised else None
        sampling = Sampling(temperature=1.3 if sampled else 0.0, seed=trial, repetition_penalty=1.5 if penalised else 1)

        def guesses(
            bk: Backend, h: torch.Tensor = h, fed: torch.Tensor = fed, seen: torch.Tensor | None = seen, s=sampling
        ) -> tuple[list[int], torch.Tensor | None]:
            p, seq, tokens, q = first_round(bk, target, mtp, fed[:-1], fed[-1:], h, k, s, head, seen)
            st = p.state[seq.uid]
            assert (st.length, st.confirmed) == (n + k - 1, n)  # the n pairs, then guesses 1 .. k-1 chained
            p.accept(seq, 0, fed[:1], h[:1])
            assert st.length == n  # the chain's entries dropped
            return tokens.tolist(), q

        (a, qa), (c, qc) = eager_and_native(guesses, b)
        assert a == c and len(a) == k, (trial, a, c)
        assert calls == ([] if n > native.MAX_T else [k] * (trial + 1))  # the native round: one chain call
        assert (qa is None) == (qc is None) == (not sampled)
        if sampled:
            assert qa is not None and qc is not None
            assert close(qa, qc) and torch.allclose(qc.sum(-1), torch.ones(k))
            assert cut == 0 or qc[:, torch.arange(TINY.vocab_size - 1, -1, -1)[cut:]].abs().sum() == 0


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("cut", [False, True])
@pytest.mark.parametrize("sampled", [False, True, "top-p"])
def test_draft_chain_guesses_as_the_steps_do(
    pair: tuple[Transformer, MTPModule, Backend],
    draft: Transformer,
    cut: bool,
    sampled: bool | str,
    k: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A draft's chain (one call for k guesses, each fed through the draft; one guess too; under
    top-p too, both drawing at the temperature alone: `verify.proposal`) guesses what the engine's
    step-by-step loop (`DraftProposer.propose`) guesses on the eager backend, whole head or cut, greedy
    or sampled (same draws, same q), and leaves the draft's cache where the loop leaves it: the k-1
    fed guesses, then the ones the target kept."""
    target, _, b = pair
    head = Head(draft, torch.arange(TINY.vocab_size - 1, -1, -1)[:40]) if cut else None
    calls = chain_spy(monkeypatch)
    g = torch.Generator().manual_seed(4)
    kept = min(2, k)  # guesses the target keeps
    for trial in range(4):
        prompt = torch.randint(0, TINY.vocab_size, (9,), generator=g)
        top_p = 0.9 if sampled == "top-p" else None
        sampling = Sampling(temperature=1.3, top_p=top_p, seed=trial) if sampled else Sampling()

        def guesses(bk: Backend, prompt: torch.Tensor = prompt, s: Sampling = sampling):
            p, seq, tokens, q = first_round(bk, target, draft, prompt[:-1], prompt[-1:], torch.empty(0), k, s, head)
            st = p.state[seq.uid]
            assert st.length == 9 + k - 1  # the catch-up, then guesses 1 .. k-1 fed
            p.accept(seq, kept, torch.cat([tokens[:kept], tokens[:1]]), torch.empty(0))
            return tokens.tolist(), q, st.length

        (a, qa, na), (c, qc, nc) = eager_and_native(guesses, b)
        # the fed guesses the target kept stay (a kept last guess was never fed: it comes next round)
        assert a == c and len(a) == k and na == nc == 9 + min(kept, k - 1), (trial, a, c, na, nc)
        assert calls == [k] * (trial + 1)  # the native run's guesses came from the chain, in one call
        assert (qa is None) == (qc is None) == (not sampled)
        if sampled:
            assert qa is not None and qc is not None
            assert close(qa, qc) and torch.allclose(qc.sum(-1), torch.ones(k))


@pytest.mark.parametrize("kind", ["none", "ngram", "mtp", "draft", "ngram+mtp", "ngram+draft"])
def test_generation_is_the_eager_one(
    pair: tuple[Transformer, MTPModule, Backend], draft: Transformer, kind: str
) -> None:
    """Every proposer on the native backend: greedy tokens are the target alone's (eager) and the
    eager run's, with the same guesses kept (the chains' included); seeded sampling draws the
    eager run's tokens."""
    target, mtp, b = pair
    model = {"mtp": mtp, "draft": draft}.get(kind.removeprefix("ngram").removeprefix("+"))
    p = proposer(kind, target, model)
    alone, _ = generate(target, NONE, PROMPT, 80, 0)
    k = 0 if kind == "none" else 3
    for sampling in (Sampling(), Sampling(temperature=1.0, seed=7)):
        a, c = eager_and_native(lambda bk, s=sampling: generate(target, p, PROMPT, 80, k, s, backend=bk), b)
        assert a[0] == c[0] and len(set(a[0])) >= 10, sampling
        assert (a[1].proposed, a[1].accepted) == (c[1].proposed, c[1].accepted)
        if sampling.greedy:
            assert c[0] == alone
            assert kind == "none" or c[1].proposed > 0
            assert "draft" not in kind or c[1].accepted > 0, c[1]  # a draft's guesses were kept, some of them


def test_refuses_widths_it_cannot_serve(pair: tuple[Transformer, MTPModule, Backend]) -> None:
    """A head width its kernels do not tile: one line, that model left on the eager path (the
    backend's label says how much of the run is native); the text is the eager one's."""
    log: list[str] = []
    narrow = halved(random_model(DRAFT_CFG, seed=1))  # head_dim 12
    target = pair[0]
    partly = Backend("native")
    assert partly.prepare(target, [narrow], log.append) == "partly native", log  # type: ignore[list-item]
    assert partly.steps(target) is not None and partly.steps(narrow) is None
    assert len(log) == 1 and "(Transformer)" in log[0] and "multiples of 8" in log[0], log
    p = proposer("draft", target, narrow)
    assert generate(target, p, PROMPT, 30, 3, backend=partly)[0] == generate(target, p, PROMPT, 30, 3)[0]


def test_library_is_built_once_and_failures_are_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pair: tuple[Transformer, MTPModule, Backend]
) -> None:
    monkeypatch.setattr(native.kernels, "_LIBS", {})
    monkeypatch.setattr(native.kernels, "_FAILED", {})
    log: list[str] = []
    native.library(tmp_path / "a", log.append)
    assert len(log) == 1 and log[0].startswith("building the native decode step")
    assert len(list((tmp_path / "a" / "native").glob("step-*.so"))) == 1

    def no_compiler(*a, **kw):
        raise AssertionError("compiled again")

    monkeypatch.setattr(native.kernels, "_LIBS", {})
    monkeypatch.setattr(subprocess, "run", no_compiler)
    native.library(tmp_path / "a", log.append)  # from the cache: no compiler
    assert len(log) == 1
    monkeypatch.undo()

    monkeypatch.setattr(native.kernels, "_LIBS", {})
    monkeypatch.setattr(native.kernels, "_FAILED", {})
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    monkeypatch.setenv("SMALLEM_CACHE", str(tmp_path / "b"))
    target = halved(random_model(TINY, seed=0))
    assert Backend("native").prepare(target, [], log.append) == "eager"  # type: ignore[arg-type]
    assert len(log) == 3 and "the C++ compiler failed" in log[-1] and log[-2].startswith("building"), log
    assert log[-1].startswith("native decode step unavailable (Transformer)"), log
    monkeypatch.setenv("CXX", "g++")
    shared = tmp_path / "c"
    (shared / "native").mkdir(parents=True)
    (shared / "native").chmod(0o777)  # a library that gets loaded: never from a folder others can write
    monkeypatch.setenv("SMALLEM_CACHE", str(shared))
    assert Backend("native").prepare(target, [], log.append) == "eager"  # type: ignore[arg-type]
    assert "writable by others" in log[-1] and not list((shared / "native").glob("*.so"))


def test_the_avx2_build_beside_the_widest_gives_the_same_numbers() -> None:
    """`--engine native-avx2`: the AVX2 build (panels of 8 rows) beside the widest one this CPU
    runs (panels of 16 with AVX-512). Every output is the same float32 sum, in the same order, in
    either build: passes (T = 1, 2, 3, 5, 11, 16: tiles of each shape, whole and padded panels;
    attention rows two by two and alone; the one-sequence step and the flat pass), the MTP chain's
    guesses and q (a head cut to 37 rows), and whole generations, greedy and sampled, agree bit
    for bit."""
    target, mtp = halved(random_model(TINY, seed=6)), halved(random_mtp(TINY, seed=7))
    backends = {engine: prepared(target, mtp, name=engine) for engine in native.ENGINES}  # type: ignore[arg-type]
    wide, avx2 = backends["native"], backends["native-avx2"]
    assert avx2.steps(target).width == 8 and avx2.steps(mtp).width == 8  # type: ignore[union-attr]
    assert wide.steps(target).width == (16 if native.kernels.best_isa() == "avx512" else 8)  # type: ignore[union-attr]
    assert wide.steps(target) is not avx2.steps(target)  # each backend its own steps for the same model
    tokens = torch.randint(0, TINY.vocab_size, (60,), generator=torch.Generator().manual_seed(1))
    head = Head(target, torch.arange(TINY.vocab_size - 1, -1, -1)[:37])  # type: ignore[arg-type]

    def run(bk: Backend) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        steps = bk.steps(target)
        for T in (1, 2, 3, 5, 11, 16):
            out += one_sequence(target, tokens[:20], tokens[20 : 20 + T], steps)  # type: ignore[arg-type]
            out += sequence_pass(target, tokens[:20], tokens[20 : 20 + T], steps)  # type: ignore[arg-type]
        _, prompt_h = sequence_pass(target, tokens[:0], tokens[:20], steps, "none")  # type: ignore[arg-type]
        for sampling in (Sampling(), Sampling(temperature=0.8, seed=2)):
            *_, guesses, q = first_round(bk, target, mtp, tokens[:20], tokens[20:21], prompt_h, 4, sampling, head)  # type: ignore[arg-type]
            out += [guesses] + ([] if q is None else [q])
        for sampling in (Sampling(), Sampling(temperature=0.9, seed=5)):
            gen, _ = generate(target, proposer("mtp", target, mtp), PROMPT, 30, 3, sampling, backend=bk)  # type: ignore[arg-type]
            out.append(torch.tensor(gen))
        return out

    with torch.no_grad():
        a, c = run(wide), run(avx2)
    assert len(a) == len(c) == 6 * 5 + 3 + 2 and all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


def test_builds_follow_the_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The widest build is the CPU's: AVX-512 where torch finds it, else AVX2; the AVX-512 build
    is refused on a CPU without it, and a CPU without AVX2 gets neither (one line, no build)."""
    from smallem_cli.backends.native import kernels

    monkeypatch.setattr(kernels, "_LIBS", {})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert kernels.best_isa() == "avx2"
    with pytest.raises(native.NativeUnavailable, match="does not run the avx512 build"):
        kernels.library(tmp_path, print, "avx512")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    with pytest.raises(native.NativeUnavailable, match="lacks AVX2"):
        kernels.library(tmp_path, print)
    assert not (tmp_path / "native").exists()  # refused before anything was built


def test_engine_names_and_bench_engines() -> None:
    cpu = torch.device("cpu")
    assert engines.bench_engines("auto", cpu) == ("eager", "native")
    with pytest.raises(ValueError, match="--engines"):
        engines.bench_engines("native,compiled", cpu)  # the compiled engine is gone
    assert engines.bench_engines("native-avx2,native", cpu) == ("native-avx2", "native")
    assert engines.fastest(("native", "native-avx2", "eager")) == "native"
    assert engines.engine_mode("native-avx2", cpu) == "native-avx2" and engines.engine_mode("auto", cpu) == "native"
    assert engines.engine_mode("eager", cpu) == "eager"  # a name, never None
    with pytest.raises(ValueError, match="native"):
        engines.bench_engines("native,bogus", cpu)


def test_cli_native_engine_prints_the_eager_text(
    family: Family, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`--engine native` (and auto, its default on a CPU) print the eager engine's text; the
    first run builds the library (one line), later runs only load it."""
    monkeypatch.setenv("SMALLEM_CACHE", str(tmp_path))
    monkeypatch.delenv("SMALLEM_ENGINE", raising=False)  # auto: native on a CPU
    monkeypatch.setattr(native.kernels, "_LIBS", {})
    runner = CliRunner()

    def run(*args: str):
        argv = ["generate", "The quick brown fox", "--target", str(family.target), "-n", "30", *args]
        return runner.invoke(app, argv)

    eager = run("--engine", "eager")
    first = run("--engine", "native")
    assert first.exit_code == 0 and first.stdout == eager.stdout and eager.stdout.strip()
    lines = first.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("building the native") and lines[1].endswith(", native)"), lines
    monkeypatch.setattr(native.kernels, "_LIBS", {})
    again = run("--engine", "auto", "--proposer", "mtp", "-k", "3")
    mtp_eager = run("--engine", "eager", "--proposer", "mtp", "-k", "3")
    assert again.exit_code == 0 and again.stdout == mtp_eager.stdout == eager.stdout
    assert again.stderr.splitlines()[-1].endswith(", native)") and len(again.stderr.splitlines()) == 1, again.stderr
    avx2 = run("--engine", "native-avx2", "--proposer", "mtp", "-k", "3")  # the AVX2 build: the same text
    assert avx2.exit_code == 0 and avx2.stdout == eager.stdout
    assert avx2.stderr.splitlines()[-1].endswith(", native-avx2)"), avx2.stderr


def test_threads_follow_the_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """generate's default threads: all cores on a quiet machine, the cores others leave free
    while they run (at least one), torch's default where /proc/loadavg cannot be read."""
    from smallem_cli import options

    loadavg = tmp_path / "loadavg"
    monkeypatch.setattr(options, "LOADAVG", loadavg)
    assert options.threads_for_load(2) is None  # unreadable
    for running, cores, want in [(1, 2, None), (2, 2, 1), (3, 2, 1), (3, 8, 6), (2, 1, None)]:
        loadavg.write_text(f"0.50 0.40 0.30 {running}/300 12345\n")
        assert options.threads_for_load(cores) == want, (running, cores)


def test_prefetch_rows_by_maker() -> None:
    """The products' prefetch threshold follows the CPU's maker, as measured (`kernels.prefetch_rows`)."""
    from smallem_cli.backends.native.kernels import prefetch_rows

    assert prefetch_rows("vendor_id\t: AuthenticAMD\ncpu family\t: 25\n") == 5
    assert prefetch_rows("vendor_id\t: GenuineIntel\n") == 8
    assert prefetch_rows("") == 8
    assert prefetch_rows() in (5, 8)


def test_json_stats_name_the_backend(family: Family, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`generate --json` and every `batch` answer say which backend ran the target's passes."""
    import json

    monkeypatch.setenv("SMALLEM_CACHE", str(tmp_path))
    runner = CliRunner()
    for engine in ("eager", "native"):
        argv = ["generate", "The quick brown fox", "--target", str(family.target), "-n", "8", "--json", "-q"]
        got = runner.invoke(app, [*argv, "--proposer", "mtp", "--engine", engine])
        assert got.exit_code == 0, got.stderr
        assert json.loads(got.stdout)["stats"]["backend"] == engine
        argv = ["batch", "--target", str(family.target), "-n", "8", "-q", "--engine", engine]
        got = runner.invoke(app, argv, input="The quick brown fox\nA slow one\n")
        assert got.exit_code == 0, got.stderr
        assert [json.loads(line)["stats"]["backend"] for line in got.stdout.splitlines()] == [engine] * 2


@pytest.mark.parametrize("kind", ["none", "draft", "mtp"])
def test_float32_weights_run_native_as_they_are(trained: Trained, kind: str) -> None:
    """Weights float16 cannot hold (a model trained in float32) are read as float32: the run is
    native, says so, and its greedy tokens are the eager engine's, proposer chains included."""
    target = trained.model
    model = {"draft": noisy_copy(target, 0.05, seed=5), "mtp": trained.mtp}.get(kind)
    p = proposer(kind, target, model)
    b = Backend("native")
    assert b.prepare(target, p.models) == "native (f32)"
    assert all(b.steps(m).kinds == {"f32"} for m in [target, *p.models])  # type: ignore[union-attr]
    k = 0 if model is None else 3
    got = generate(target, p, trained.period[:10], 40, k, backend=b)[0]
    assert len(got) == 40 and got == generate(target, p, trained.period[:10], 40, k)[0]


def test_each_matrix_is_read_in_the_narrowest_exact_type() -> None:
    """float16 where it holds a matrix exactly, else bfloat16 (the values of a bfloat16 checkpoint,
    some too small for float16), else float32; the text is the eager engine's."""
    model = halved(random_model(TINY, seed=0))
    with torch.no_grad():
        for w in (model.layers[0].gate_proj.weight, model.layers[0].up_proj.weight):  # read as one matrix
            w.copy_(w.to(torch.bfloat16).float())  # bfloat16-valued, one value below float16's range
        model.layers[0].up_proj.weight[0, 0] = 2.0**-30
        model.layers[1].down_proj.weight[0, 0] = 1.0 + 2.0**-20  # float32 alone holds it
    b = Backend("native")
    assert b.prepare(model.pack(), []) == "native (bf16+f16+f32)"
    got = generate(model, NONE, PROMPT, 30, 0, backend=b)[0]
    assert got == generate(model, NONE, PROMPT, 30, 0)[0]
