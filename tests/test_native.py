"""The native engine (`smallem_cli/native/`): C++ kernels over a model's float16 weights.

Every check compares it with the eager path, the reference: a pass's logits, hidden states
and K/V to float32 rounding, greedy generations token for token (target alone, MTP chain,
draft), the MTP chain's guesses against the step-by-step ones. Then what it refuses
(weights float16 cannot hold, widths its kernels do not tile, a compiler that fails, a
shared cache folder), that it builds its library once, and the CLI.
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import DRAFT_CFG, PROMPT, TINY, Family, noisy_copy, random_model, random_mtp
from typer.testing import CliRunner

from smallem_cli.backends import engines, native
from smallem_cli.backends.steps import switch
from smallem_cli.cli.app import app
from smallem_cli.engine.generate import generate
from smallem_cli.model.llama import MTPModule, Transformer
from smallem_cli.spec.head import Head
from smallem_cli.spec.proposers import DraftProposer, MTPProposer, NoProposer
from smallem_cli.spec.sampling import Sampling
from smallem_cli.spec.verify import Penalty, Warper

no_native = shutil.which("g++") is None or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512")
pytestmark = pytest.mark.skipif(no_native, reason="the native engine needs g++ and an AVX2 CPU")


def halved(model: Transformer | MTPModule) -> Transformer | MTPModule:
    """A copy whose weights are float16 values (as a checkpoint's), packed again."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.half().float())
    return m.pack()


def attach(model: Transformer | MTPModule, target: Transformer, log, root: Path) -> bool:
    """Give a model native steps (`native._attach`) -> whether it has them; why not, in one line
    through `log`, as `native.prepare` says it."""
    why = native._attach(model, target, log, root, "native")
    if why is not None:
        log(f"native decode step unavailable ({type(model).__name__}): {why}")
    return why is None


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("native-cache")


@pytest.fixture(scope="module")
def pair(root: Path) -> tuple[Transformer, MTPModule]:
    """A float16-exact target (GQA: 4 heads on 2 kv heads) and MTP module, with native steps."""
    target, mtp = halved(random_model(TINY, seed=0)), halved(random_mtp(TINY, seed=2))
    log: list[str] = []
    assert native.prepare(target, [mtp], log.append, root) == (2, 2), log  # type: ignore[arg-type]
    return target, mtp  # type: ignore[return-value]


def eager_and_native(fn):
    """fn() run on the eager path, then on the native one."""
    switch("eager")
    try:
        with torch.no_grad():
            a = fn()
            switch("native")
            return a, fn()
    finally:
        switch(None)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to float32 rounding: the kernels sum in another order (and apply the norms' weights
    to the activations, where the eager path folds them into its float32 weights)."""
    if a.shape != b.shape or a.numel() == 0:
        return a.shape == b.shape
    return bool(torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(a.abs().max())))


@pytest.mark.parametrize(
    ("T", "head", "last"),
    [(1, True, False), (2, False, True), (3, True, True), (5, True, False), (11, True, False), (16, True, False)],
)
def test_target_pass_is_the_eager_one(pair: tuple[Transformer, MTPModule], T: int, head: bool, last: bool) -> None:
    """Logits, hidden states and the K/V a pass writes match the eager pass's, for any T."""
    target, _ = pair
    cache = target.new_cache(4)
    seq = cache.new_sequence()
    tokens = torch.randint(0, TINY.vocab_size, (40,), generator=torch.Generator().manual_seed(T))
    target(tokens[:20], cache, seq)

    def one() -> tuple[torch.Tensor, ...]:
        logits, hidden = target(tokens[20 : 20 + T], cache, seq, head=head, last=last)
        kv = cache.kv[:, :, :, 20 : 20 + T].clone()
        cache.keep(seq, 20)
        return logits, hidden, kv

    a, b = eager_and_native(one)
    assert all(close(x, y) for x, y in zip(a, b, strict=True)), [(x - y).abs().max() for x, y in zip(a, b, strict=True)]
    assert b[1].shape[0] == (1 if last else T) and b[0].shape[0] == (0 if not head else 1 if last else T)


def test_verify_pass_reads_its_argmax_and_finite_flag(root: Path) -> None:
    """A pass with a head also returns each row's argmax (torch's) and 1 if every logit is finite;
    with a NaN in the final norm the flag is 0, and a generation stops at its first round with
    NonFiniteError (its prefill's logits, from the eager head, were finite: one token came out)."""
    from smallem_cli.engine.generate import stream
    from smallem_cli.spec.sampling import NonFiniteError

    model = halved(random_model(TINY, seed=4))
    assert attach(model, model, lambda _: None, root)  # type: ignore[arg-type]
    steps = model.native
    assert steps is not None
    cache = model.new_cache(4)  # type: ignore[union-attr]
    seq = cache.new_sequence()
    tokens = torch.randint(0, TINY.vocab_size, (24,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model(tokens[:19], cache, seq)  # type: ignore[operator]
        past = cache.append(seq, 0).past()
        logits, _, _, top = steps.get(5, True, False)(tokens[19:], *steps.trig(19, 24), past)  # type: ignore[misc]
        assert top.tolist() == [*logits.argmax(-1).tolist(), 1]
        g = next(t for t in steps.keep if t.data_ptr() == steps.mw.g_final)  # the final norm the C code reads
        g[3] = float("nan")
        _, _, _, top = steps.get(5, True, False)(tokens[19:], *steps.trig(19, 24), past)  # type: ignore[misc]
        assert top[-1] == 0
    switch("native")
    chunks: list[list[int]] = []
    try:
        with pytest.raises(NonFiniteError, match="not finite"):
            for chunk in stream(model, NoProposer(), PROMPT, 20, 0):  # type: ignore[arg-type]
                chunks.append(chunk)
    finally:
        switch(None)
    assert len(chunks) == 1


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
    pair: tuple[Transformer, MTPModule], temperature: float, top_k: int, top_p: float, min_p: float
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


def test_native_penalty_is_torchs(pair: tuple[Transformer, MTPModule]) -> None:
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


def test_pass_refuses_a_slab_without_room(pair: tuple[Transformer, MTPModule]) -> None:
    """A pass writes its K/V into the slab right after the past it reads: with no room there
    (a past that ends the slab) it refuses, rather than write past the slab's memory."""
    target, _ = pair
    c, steps = target.cfg, target.native
    assert steps is not None
    slab = torch.zeros(c.n_layers, 2, c.n_kv_heads, 20, c.head_dim)
    with pytest.raises(ValueError, match="no room in the slab for 1 positions after a past of 20"):
        steps.get(1, True, False)(torch.tensor([3]), *steps.trig(20, 21), slab)  # type: ignore[misc]
    step = steps.get(1, True, False)
    assert step is not None
    new = step(torch.tensor([3]), *steps.trig(19, 20), slab[:, :, :, :19])[2]
    assert new.data_ptr() == slab[:, :, :, 19:].data_ptr() and slab[:, :, :, 19].abs().sum() > 0  # written in place


def test_widths_not_multiples_of_eight(root: Path) -> None:
    """A vocabulary of 61 tokens: the head's last panel of eight rows is padded, and only its
    real columns are written (a prompt's pass over an empty past, then a verify-sized pass)."""
    model = halved(random_model(dataclasses.replace(TINY, vocab_size=61), seed=9))
    assert attach(model, model, lambda _: None, root)  # type: ignore[arg-type]
    tokens = torch.randint(0, 61, (24,), generator=torch.Generator().manual_seed(9))

    def passes() -> tuple[torch.Tensor, ...]:
        cache = model.new_cache(4)  # type: ignore[union-attr]
        seq = cache.new_sequence()
        first, _ = model(tokens[:19], cache, seq)  # type: ignore[operator]
        logits, hidden = model(tokens[19:], cache, seq)  # type: ignore[operator]
        return first, logits, hidden

    a, b = eager_and_native(passes)
    assert b[1].shape == (5, 61) and all(close(x, y) for x, y in zip(a, b, strict=True))


def test_mtp_pass_is_the_eager_one(pair: tuple[Transformer, MTPModule]) -> None:
    target, mtp = pair
    prop = MTPProposer(target, mtp, 64)
    g = torch.Generator().manual_seed(1)
    h, nxt = torch.randn(12, TINY.dim, generator=g) * 3, torch.randint(0, TINY.vocab_size, (12,), generator=g)
    prop.step(h[:8], nxt[:8])

    def one() -> tuple[torch.Tensor, torch.Tensor]:
        out = prop.step(h[8:], nxt[8:])
        kv = prop.cache.kv[:, :, :, 8:12].clone()
        prop.cache.keep(prop.seq, 8)
        return out, kv

    a, b = eager_and_native(one)
    assert close(a[0], b[0]) and close(a[1], b[1])


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
    pair: tuple[Transformer, MTPModule], cut: int, sampled: bool, n: int, k: int, penalised: bool
) -> None:
    """The native chain (one call for the catch-up on n pairs and k guesses, one guess too) guesses what the
    step-by-step loop guesses, with the whole head or one cut to some tokens (37: the last panel
    of eight rows padded), greedy or sampled (the same draws of the run's generator, and the q
    each guess was drawn from), and leaves the module's cache as it was; a backlog longer than
    a native pass (70 pairs) catches up first, then chains from the state; under a repetition
    penalty too (each guess scored over the context and the guesses before it)."""
    target, mtp = pair
    head = Head(target, torch.arange(TINY.vocab_size - 1, -1, -1)[:cut]) if cut else None
    g = torch.Generator().manual_seed(3)
    for trial in range(4):
        h, nxt = torch.randn(n, TINY.dim, generator=g) * 3, torch.randint(0, TINY.vocab_size, (n,), generator=g)
        penalty = Penalty(torch.rand(TINY.vocab_size, generator=g) < 0.3, 1.5) if penalised else None

        def guesses(
            h: torch.Tensor = h, nxt: torch.Tensor = nxt, seed: int = trial, penalty: Penalty | None = penalty
        ) -> tuple[list[int], torch.Tensor | None]:
            prop = MTPProposer(target, mtp, 128, head)
            prop.start(nxt[:1], nxt[1:2], h[:1])
            prop.pending_h, prop.pending_next = h, nxt
            warp = Warper(1.3) if sampled else None
            tokens, q = prop.propose(k, warp, torch.Generator().manual_seed(seed), penalty)
            assert prop.cache.length(prop.seq) >= prop.true_len == n
            prop.accept(0, nxt[:1], h[:1])
            assert prop.cache.length(prop.seq) == n  # the chain's entries dropped
            return torch.as_tensor(tokens).view(-1).tolist(), q

        (a, qa), (b, qb) = eager_and_native(guesses)
        assert a == b and len(a) == k, (trial, a, b)
        assert (qa is None) == (qb is None) == (not sampled)
        if sampled:
            assert close(qa, qb) and torch.allclose(qb.sum(-1), torch.ones(k))


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("cut", [False, True])
@pytest.mark.parametrize("sampled", [False, True, "top-p"])
def test_draft_chain_guesses_as_the_steps_do(
    pair: tuple[Transformer, MTPModule],
    root: Path,
    cut: bool,
    sampled: bool | str,
    k: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A draft's chain (one call for k guesses, each fed through the draft; one guess too; under
    top-p too, both drawing at the temperature alone: `verify.proposal`) guesses what its
    step-by-step loop guesses, whole head or cut, greedy or sampled (same draws, same q), and
    leaves the draft's cache where the loop leaves it: the k-1 fed guesses, then the ones the
    target kept."""
    target, _ = pair
    draft = halved(noisy_copy(target, 0.05, seed=5))
    assert attach(draft, target, lambda _: None, root)  # type: ignore[arg-type]
    head = Head(draft, torch.arange(TINY.vocab_size - 1, -1, -1)[:40]) if cut else None  # type: ignore[arg-type]
    calls = []
    chain = native.NativeSteps.chain
    monkeypatch.setattr(native.NativeSteps, "chain", lambda self, *a, **kw: calls.append(1) or chain(self, *a, **kw))
    g = torch.Generator().manual_seed(4)
    kept = min(2, k)  # guesses the target keeps
    for trial in range(4):
        prompt = torch.randint(0, TINY.vocab_size, (9,), generator=g)

        def guesses(prompt: torch.Tensor = prompt, seed: int = trial) -> tuple[list[int], torch.Tensor | None, int]:
            prop = DraftProposer(draft, 64, head=head)  # type: ignore[arg-type]
            prop.start(prompt[:-1], prompt[-1:], torch.empty(0))
            warp = (Warper(1.3, top_p=0.9) if sampled == "top-p" else Warper(1.3)) if sampled else None
            tokens, q = prop.propose(k, warp, torch.Generator().manual_seed(seed))
            assert prop.cache.length(prop.seq) == 9 + k - 1  # the catch-up, then guesses 1 .. k-1 fed
            prop.accept(kept, torch.cat([tokens[:kept], tokens[:1]]), torch.empty(0))
            return torch.as_tensor(tokens).view(-1).tolist(), q, prop.cache.length(prop.seq)

        (a, qa, na), (b, qb, nb) = eager_and_native(guesses)
        # the fed guesses the target kept stay (a kept last guess was never fed: it comes next round)
        assert a == b and len(a) == k and na == nb == 9 + min(kept, k - 1), (trial, a, b, na, nb)
        assert len(calls) == trial + 1  # the native run's guesses came from the chain, in one call
        assert (qa is None) == (qb is None) == (not sampled)
        if sampled:
            assert close(qa, qb) and torch.allclose(qb.sum(-1), torch.ones(k))


@pytest.mark.parametrize("kind", ["none", "mtp", "draft"])
def test_generation_is_the_eager_one(pair: tuple[Transformer, MTPModule], root: Path, kind: str) -> None:
    """Greedy tokens equal the eager run's, with the same guesses kept (the chain's and the
    draft's included); seeded sampling too."""
    target, mtp = pair
    draft = halved(noisy_copy(target, 0.05, seed=5))  # agrees often, not always
    assert attach(draft, target, lambda _: None, root)  # type: ignore[arg-type]

    def make() -> NoProposer | MTPProposer | DraftProposer:
        if kind == "mtp":
            return MTPProposer(target, mtp, 200)
        return DraftProposer(draft, 200) if kind == "draft" else NoProposer()  # type: ignore[arg-type]

    for sampling in (Sampling(), Sampling(temperature=1.0, seed=7)):
        a, b = eager_and_native(lambda s=sampling: generate(target, make(), PROMPT, 80, 0 if kind == "none" else 3, s))
        assert a[0] == b[0] and len(set(a[0])) >= 10, sampling
        assert (a[1].proposed, a[1].accepted) == (b[1].proposed, b[1].accepted)


def test_refuses_weights_and_widths_it_cannot_serve(root: Path) -> None:
    """float32 weights (float16 would change the model) and a head width its kernels do not
    tile: one line each, the model left on the eager path."""
    log: list[str] = []
    f32 = random_model(TINY, seed=0)
    assert not attach(f32, f32, log.append, root) and f32.native is None
    narrow = halved(random_model(DRAFT_CFG, seed=1))  # head_dim 12
    assert not attach(narrow, narrow, log.append, root)  # type: ignore[arg-type]
    assert len(log) == 2 and "float16-exact" in log[0] and "multiples of 8" in log[1], log
    out, _ = generate(f32, NoProposer(), PROMPT, 10, 0)
    assert len(out) == 10


def test_library_is_built_once_and_failures_are_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pair: tuple[Transformer, MTPModule]
) -> None:
    monkeypatch.setattr(native.kernels, "_LIBS", {})
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
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    target = halved(random_model(TINY, seed=0))
    assert not attach(target, target, log.append, tmp_path / "b")  # type: ignore[arg-type]
    assert len(log) == 3 and "the C++ compiler failed" in log[-1] and log[-2].startswith("building"), log
    monkeypatch.setenv("CXX", "g++")
    shared = tmp_path / "c"
    (shared / "native").mkdir(parents=True)
    (shared / "native").chmod(0o777)  # a library that gets loaded: never from a folder others can write
    assert not attach(target, target, log.append, shared)  # type: ignore[arg-type]
    assert "writable by others" in log[-1]


def test_the_avx2_build_beside_the_widest_gives_the_same_numbers(root: Path) -> None:
    """`--engine native-avx2`: the AVX2 build (panels of 8 rows) beside the widest one this CPU
    runs (panels of 16 with AVX-512). Every output is the same float32 sum, in the same order, in
    either build: passes (T = 1, 2, 3, 5, 11, 16: tiles of each shape, whole and padded panels;
    attention rows two by two and alone), the MTP chain's guesses and q (a head cut to 37 rows),
    and whole generations, greedy and sampled, agree bit for bit."""
    target, mtp = halved(random_model(TINY, seed=6)), halved(random_mtp(TINY, seed=7))
    for engine in native.ENGINES:
        assert native.prepare(target, [mtp], print, root, engine) == (2, 2)  # type: ignore[arg-type]
    assert target.native is not None and target.native_avx2 is not None
    assert target.native_avx2.width == 8 and mtp.native_avx2.width == 8  # type: ignore[union-attr]
    assert target.native.width == (16 if native.kernels.best_isa() == "avx512" else 8)
    tokens = torch.randint(0, TINY.vocab_size, (60,), generator=torch.Generator().manual_seed(1))
    head = Head(target, torch.arange(TINY.vocab_size - 1, -1, -1)[:37])

    def run() -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        cache = target.new_cache(8)
        seq = cache.new_sequence()
        _, prompt_h = target(tokens[:20], cache, seq)  # [20, d]
        for T in (1, 2, 3, 5, 11, 16):
            logits, hidden = target(tokens[20 : 20 + T], cache, seq)
            out += [logits, hidden, cache.kv[:, :, :, 20 : 20 + T].clone()]
            cache.keep(seq, 20)
        for warp in (None, Warper(0.8)):
            prop = MTPProposer(target, mtp, 128, head)
            prop.start(tokens[:20], tokens[20:21], prompt_h)
            guesses, q = prop.propose(4, warp, torch.Generator().manual_seed(2))
            out += [torch.as_tensor(guesses).view(-1)] + ([] if q is None else [q])
            prop.release()
        for sampling in (Sampling(), Sampling(temperature=0.9, seed=5)):
            gen, _ = generate(target, MTPProposer(target, mtp, 200), PROMPT, 30, 3, sampling)
            out.append(torch.tensor(gen))
        return out

    got = {}
    try:
        with torch.no_grad():
            for engine in native.ENGINES:
                switch(engine)
                got[engine] = run()
    finally:
        switch(None)
    a, b = got["native"], got["native-avx2"]
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


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
