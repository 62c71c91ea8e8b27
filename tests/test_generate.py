"""The speculative loop: greedy identity with the target alone, sampling, stop tokens, lengths, stats.

Every proposer (none, ngram, a draft, the MTP module, ngram+draft, ngram+mtp) on the eager
backend and on the native one: `engine.generate.generate(..., backend=...)`.
"""

from __future__ import annotations

import copy
import math
import shutil

import pytest
import torch
from conftest import PROMPT, kv_close, random_model
from engine_help import backend, halved, proposer, reference_logits, sequence_pass

from smallem_cli.backends.engines import Backend
from smallem_cli.config import ModelConfig
from smallem_cli.engine import build
from smallem_cli.engine.config import EngineConfig
from smallem_cli.engine.family import NONE, LoadedProposer
from smallem_cli.engine.forward import mtp_pass, slab_for
from smallem_cli.engine.generate import answer, generate
from smallem_cli.engine.proposers import FallbackProposer
from smallem_cli.engine.request import Request
from smallem_cli.kv.pool import PagePool, pages_for
from smallem_cli.kv.step import build as build_step
from smallem_cli.model.llama import MTPModule, Transformer
from smallem_cli.spec.sampling import NonFiniteError, Sampling
from smallem_cli.stats import Stats

N = 120  # tokens per identity run
KS = (1, 2, 3, 4, 5)
BACKENDS = ("eager", "native")
# every proposer: "draft" (a small model), "near" (the target with weight noise: accepted about
# half the time), "self" (the target as its own draft: every guess kept), the MTP module, the
# n-gram lookup alone and in front of a model
FIXED = ("draft", "near", "self", "mtp")  # a model proposer: k guesses every round
KINDS = ("none", "ngram", *FIXED, "ngram+draft", "ngram+mtp")
# a draft the native kernels can serve: widths multiples of 8 (conftest's DRAFT_CFG has head_dim 12)
NATIVE_DRAFT_CFG = ModelConfig(
    vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, hidden_dim=64, max_seq_len=256
)

no_native = shutil.which("g++") is None or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512")


def alone(
    target: Transformer,
    prompt: list[int] = PROMPT,
    n: int = N,
    sampling: Sampling = Sampling(),
    backend: Backend | None = None,
) -> list[int]:
    out, stats = generate(target, NONE, prompt, n, 0, sampling, backend=backend)
    assert stats.passes == len(out) and stats.proposed == 0  # one token per pass, none guessed
    return out


def make(kind: str, models: dict, vocab: torch.Tensor | None = None) -> LoadedProposer:
    """The loaded proposer of one kind over these models (`engine_help.proposer`)."""
    if kind in ("none", "ngram"):
        return proposer(kind)
    ngram = "ngram+" if kind.startswith("ngram+") else ""
    base = kind.removeprefix("ngram+")
    if base == "mtp":
        return proposer(ngram + "mtp", models["target"], models["mtp"], vocab)
    return proposer(ngram + "draft", model=models[base], vocab=vocab)


@pytest.fixture(scope="module")
def models(target, draft, near_draft, mtp) -> dict:
    return {"target": target, "draft": draft, "near": near_draft, "mtp": mtp, "self": target}


@pytest.fixture(scope="module")
def native_models(target, near_draft, mtp) -> dict:
    """float16-exact copies of the models, with a draft of native widths, and the native backend
    prepared for all of them: every model has its native steps."""
    if no_native:
        pytest.skip("the native engine needs g++ and an AVX2 CPU")
    tgt = halved(target)
    m = {
        "target": tgt,
        "draft": halved(random_model(NATIVE_DRAFT_CFG, seed=1)),
        "near": halved(near_draft),
        "mtp": halved(mtp),
        "self": tgt,
    }
    b = backend("native", tgt, m["draft"], m["near"], m["mtp"])
    assert b.label == "native"
    assert all(b.steps(x) is not None for x in m.values())
    return {**m, "backend": b}


def on(request: pytest.FixtureRequest, backend_name: str, models: dict) -> tuple[dict, Backend | None]:
    """The models a backend runs, and the backend (None: eager)."""
    if backend_name == "eager":
        return models, None
    native = request.getfixturevalue("native_models")
    return native, native["backend"]


def ref_on(request: pytest.FixtureRequest, b: Backend | None) -> list[int]:
    """The greedy reference of the target `on` gives for this backend."""
    return request.getfixturevalue("native_reference" if b else "reference")


@pytest.fixture(scope="module")
def reference(target) -> list[int]:
    return alone(target)


@pytest.fixture(scope="module")
def native_reference(native_models) -> list[int]:
    """The float16-exact target alone, on the native backend: as on the eager one."""
    tgt = native_models["target"]
    ref = alone(tgt, backend=native_models["backend"])
    assert ref == alone(tgt)
    return ref


def rounds(stats: Stats) -> int:
    """Verify rounds run: `passes` counts the target passes that yielded tokens, the prefill's included."""
    return stats.passes - 1


def check_stats(stats: Stats, out: list[int], k: int, fixed: bool = True) -> None:
    """Counters that hold for every run; `fixed`: a proposer that offers k guesses every round (a
    model), not fewer (the n-gram lookup, which offers what it found and thinks worth checking)."""
    assert stats.new_tokens == len(out) > 0
    assert stats.k == k
    assert len(stats.rounds_by_drafted) == k + 1 and sum(stats.rounds_by_drafted) == rounds(stats)
    assert stats.proposed == sum(m * r for m, r in enumerate(stats.rounds_by_drafted))
    if fixed:
        assert stats.proposed == k * rounds(stats) and stats.rounds_by_drafted[k] == rounds(stats)
    assert 0 <= stats.accepted <= stats.proposed
    assert len(stats.accepted_at) == k
    # a round that kept its i-th guess kept every guess before it
    assert all(a >= b for a, b in zip(stats.accepted_at, stats.accepted_at[1:], strict=False))
    assert sum(stats.accepted_at) == stats.accepted
    assert k == 0 or stats.accepted_at[0] <= rounds(stats)
    # each round yields its accepted guesses plus one token, the prefill one; only the last round may be cut
    produced = stats.passes + stats.accepted
    assert produced >= stats.new_tokens > produced - (k + 1)
    assert stats.tokens_per_pass == pytest.approx(stats.new_tokens / stats.passes)
    assert stats.acceptance_rate == pytest.approx(stats.accepted / stats.proposed if stats.proposed else 0.0)


def check_real(target: Transformer, prompt: list[int], ref: list[int]) -> None:
    """The target's greedy run is varied, is the argmax of the training path's logits, and no
    step is a near-tie that float rounding could flip."""
    assert len(set(ref)) >= 15
    logits = reference_logits(target, torch.tensor(prompt + ref))[len(prompt) - 1 : -1]
    assert logits.argmax(-1).tolist() == ref
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3


def test_reference_is_a_real_test(target, reference) -> None:
    assert len(reference) == N
    check_real(target, PROMPT, reference)


def test_native_reference_is_a_real_test(native_models, native_reference) -> None:
    """The float16-exact target's, which the native identity runs compare with."""
    assert len(native_reference) == N
    check_real(native_models["target"], PROMPT, native_reference)


IDENTITY = [("none", 0)] + [(kind, k) for kind in KINDS if kind != "none" for k in KS]


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize(("kind", "k"), IDENTITY)
def test_greedy_identity(request, models, backend_name: str, kind: str, k: int) -> None:
    """Greedy output is the target alone's, token for token, whatever proposes, on either backend."""
    ms, b = on(request, backend_name, models)
    ref = ref_on(request, b)
    out, stats = generate(ms["target"], make(kind, ms), PROMPT, N, k, backend=b)
    assert out == ref
    check_stats(stats, out, k, fixed=kind not in ("ngram", "ngram+draft", "ngram+mtp"))
    assert stats.backend == backend_name
    if kind == "self":  # the target as its own draft: every guess is kept, k+1 tokens a pass
        assert stats.acceptance_rate == 1.0
        assert rounds(stats) == math.ceil((N - 1) / (k + 1))
        assert stats.tokens_per_pass == pytest.approx(N / (rounds(stats) + 1))
        assert k + 1 >= stats.tokens_per_pass > (k + 1) * 0.95
    if kind == "near":  # partly accepted: both the keep-all and the reject paths run
        assert 0.1 < stats.acceptance_rate < 0.95
    if kind in ("draft", "mtp") and k > 1:  # a random model's guesses: rejections at every k
        assert stats.accepted_at[0] < rounds(stats)
    if kind == "ngram":  # the lookup finds nothing in some rounds: they check no guess
        assert stats.rounds_by_drafted[0] > 0


@pytest.mark.skipif(no_native, reason="the native engine needs g++ and an AVX2 CPU")
def test_greedy_identity_partly_native(native_models, native_reference, draft) -> None:
    """A draft the native kernels cannot serve (head_dim 12) runs eager beside the native target."""
    odd = halved(draft)
    b = backend("native", native_models["target"], odd)
    assert b.label == "partly native" and b.steps(odd) is None
    for k in (1, 4):
        out, stats = generate(native_models["target"], proposer("draft", model=odd), PROMPT, N, k, backend=b)
        assert out == native_reference and stats.backend == "partly native"
        check_stats(stats, out, k)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_greedy_identity_with_partial_acceptance_at_every_depth(request, models, backend_name: str) -> None:
    """The noisy draft's rounds stop at every position 0..k: rollback is exercised at each depth."""
    ms, b = on(request, backend_name, models)
    ref = ref_on(request, b)
    out, stats = generate(ms["target"], make("near", ms), PROMPT, N, 4, backend=b)
    assert out == ref
    assert stats.accepted_at[-1] > 0  # some rounds kept all 4
    assert stats.accepted_at[0] < rounds(stats)  # some rounds kept none
    assert len(set(stats.accepted_at)) == 4  # and in between, rounds stopped at each depth


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("prompt", [[5], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]])
@pytest.mark.parametrize("kind", ["near", "mtp", "ngram+mtp"])
def test_greedy_identity_other_prompts(request, models, prompt: list[int], kind: str, backend_name: str) -> None:
    """A one-token prompt (MTP starts with a single state) and a prompt crossing a page boundary."""
    ms, b = on(request, backend_name, models)
    ref = alone(ms["target"], prompt, 60, backend=b)
    assert ref == alone(ms["target"], prompt, 60)  # the native target alone is the eager one
    for k in (1, 3):
        assert generate(ms["target"], make(kind, ms), prompt, 60, k, backend=b)[0] == ref


# --- a trained target + MTP module: MTP guesses that are mostly right ------------------------
def trained_mtp(trained, vocab: torch.Tensor | None = None) -> LoadedProposer:
    return proposer("mtp", trained.model, trained.mtp, vocab)


@pytest.mark.parametrize("k", KS)
def test_trained_mtp_is_accepted_and_exact(trained, k: int) -> None:
    m, period = trained.model, trained.period
    prompt = period[:10]
    ref = alone(m, prompt, N)
    assert ref[:30] == period[10:]  # the target has learnt the stream
    out, stats = generate(m, trained_mtp(trained), prompt, N, k)
    assert out == ref
    check_stats(stats, out, k)
    assert stats.acceptance_rate > 0.5  # the MTP module (and its chained guesses) mostly agree
    assert stats.accepted_at[-1] > 0  # some rounds keep all k, so the bonus token and chaining run


def test_trained_mtp_off_distribution_prompt(trained) -> None:
    """A prompt the stream never contains: MTP guesses are often wrong; the output must not change."""
    m = trained.model
    prompt = [7, 7, 7, 2, 9, 61, 33]
    ref = alone(m, prompt, 80)
    for k in (2, 4):
        assert generate(m, trained_mtp(trained), prompt, 80, k)[0] == ref


# --- the proposers' guesses, seen from inside the engine ------------------------------------------
class Wrapped:
    """A batched proposer (`engine.proposers.Proposer`) passed through, for a test to watch."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.taps = inner, inner.name, inner.taps

    def start(self, seqs, fed, hidden) -> None:
        self.inner.start(seqs, fed, hidden)

    def propose(self, seqs, ks):
        return self.inner.propose(seqs, ks)

    def accept(self, seq, n, emitted, hidden) -> None:
        self.inner.accept(seq, n, emitted, hidden)

    def drop(self, seq) -> None:
        self.inner.drop(seq)


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch):
    """watch(wrap) -> the list of wrappers made: every engine built from then on (a generation's
    too: `build.build`) has its proposer wrapped in wrap(inner)."""

    def install(wrap) -> list:
        made: list = []
        real = build.proposer_for

        def wrapped(p, target, pool, b, *suffix):
            made.append(wrap(real(p, target, pool, b, *suffix)))
            return made[-1]

        monkeypatch.setattr(build, "proposer_for", wrapped)
        return made

    return install


# Verification hides a proposer's mistakes (the output stays exact), so these tests check the guesses
# themselves: each round's k guesses must be what the proposer computes from the whole sequence,
# through the training path (no cache, unpacked weights).
class Oracle(Wrapped):
    """At every round compares the greedy guesses with `expect(sequence, k)`."""

    def __init__(self, inner, expect) -> None:
        super().__init__(inner)
        self.expect = expect
        self.seq: list[int] = []
        self.checked = self.skipped = self.offered = 0

    def start(self, seqs, fed, hidden) -> None:
        super().start(seqs, fed, hidden)
        assert len(seqs) == 1
        self.seq = fed[0].tolist() + seqs[0].last.view(-1).tolist()

    def propose(self, seqs, ks):
        got = super().propose(seqs, ks)
        tokens, q = got[0]
        assert q is None and tokens.shape[0] == ks[0]
        self.offered += ks[0]
        want, gaps = self.expect(self.seq, ks[0])
        for t, w, gap in zip(tokens.tolist(), want, gaps, strict=True):
            if gap < 2e-3:  # a near-tie: the cache's float16 may pick either; later guesses follow from it
                self.skipped += 1
                break
            assert t == w, (len(self.seq), tokens.tolist(), want)
            self.checked += 1
        return got

    def accept(self, seq, n, emitted, hidden) -> None:
        super().accept(seq, n, emitted, hidden)
        self.seq += emitted.tolist()


def _top(logits: torch.Tensor) -> tuple[int, float]:
    top2 = logits.topk(2).values
    return int(logits.argmax()), float(top2[0] - top2[1])


def draft_expect(draft: Transformer):
    def expect(seq: list[int], k: int) -> tuple[list[int], list[float]]:
        ctx, want, gaps = list(seq), [], []
        for _ in range(k):
            t, gap = _top(reference_logits(draft, torch.tensor(ctx))[-1])
            want.append(t)
            gaps.append(gap)
            ctx.append(t)
        return want, gaps

    return expect


def mtp_expect(target: Transformer, mtp):
    """Guess 1 from (h_j, x_{j+1}) over the true states; guess i+1 chains on the module's own output state."""

    def expect(seq: list[int], k: int) -> tuple[list[int], list[float]]:
        x = torch.tensor(seq)[None]
        want, gaps = [], []
        with torch.no_grad():
            h = target.hidden(x[:, :-1])  # states at positions 0 .. L-2
            e = target.embed_tokens(x[:, 1:])  # the token after each
            for _ in range(k):
                T = h.shape[1]
                out = mtp(h, e, target.cos[:T], target.sin[:T])
                t, gap = _top(target.logits(out[0, -1]))
                want.append(t)
                gaps.append(gap)
                h = torch.cat([h, out[:, -1:]], dim=1)
                e = torch.cat([e, target.embed_tokens(torch.tensor([[t]]))], dim=1)
        return want, gaps

    return expect


ORACLE = [(kind, b) for kind in ("draft", "near", "mtp", "ngram+draft", "ngram+mtp") for b in BACKENDS]


@pytest.mark.parametrize("k", (1, 3, 5))
@pytest.mark.parametrize(("kind", "backend_name"), [*ORACLE, ("trained-mtp", "eager")])
def test_guesses_match_a_from_scratch_computation(
    request, models, trained, watch, kind: str, backend_name: str, k: int
) -> None:
    """The catch-up, the chained guesses and the rollback keep the proposer's cache what a
    from-scratch pass computes: on the eager passes, and the native chain of guesses; behind the
    n-gram lookup too, where the model catches up on the rounds the lookup guessed."""
    ms, b = on(request, backend_name, models)
    if kind == "trained-mtp":
        tgt, prompt = trained.model, trained.period[:10]
        p, expect = trained_mtp(trained), mtp_expect(tgt, trained.mtp)
    elif kind.endswith("mtp"):
        tgt, prompt = ms["target"], PROMPT
        p, expect = make(kind, ms), mtp_expect(tgt, ms["mtp"])
    else:
        tgt, prompt = ms["target"], PROMPT
        p, expect = make(kind, ms), draft_expect(ms[kind.removeprefix("ngram+")])
    ref = alone(tgt, prompt, 60, backend=b)
    oracles: list[Oracle] = []

    def wrap(inner):
        if isinstance(inner, FallbackProposer):  # the model behind the lookup: told every round, asked for
            inner.other = Oracle(inner.other, expect)  # type: ignore[assignment]  # k where it found nothing
            oracles.append(inner.other)  # type: ignore[arg-type]
            return inner
        oracles.append(Oracle(inner, expect))
        return oracles[-1]

    watch(wrap)
    out, stats = generate(tgt, p, prompt, 60, k, backend=b)
    assert out == ref and len(oracles) == 1
    oracle = oracles[0]
    assert oracle.checked >= 0.9 * oracle.offered and oracle.skipped <= 2 and oracle.offered > 0
    if kind.startswith("ngram+"):  # the lookup guessed in some rounds, the model in others
        assert oracle.offered < stats.proposed
    else:
        assert oracle.offered == stats.proposed


# --- proposer heads cut to a subset of the vocabulary ---------------------------------------------
class Spy(Wrapped):
    """Records every guess; a sampled guess's q must be a distribution over the whole vocabulary."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.guesses: list[int] = []

    def propose(self, seqs, ks):
        got = super().propose(seqs, ks)
        for tokens, q in got:
            self.guesses += tokens.tolist()
            if q is not None:  # q is a distribution over the whole vocabulary, zero outside the cut
                m = tokens.shape[0]
                assert q.shape == (m, 64) and torch.allclose(q.sum(-1), torch.ones(m))
                assert (q.gather(1, tokens[:, None]) > 0).all()  # each guess is possible under its q
        return got


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_permuted_full_head_proposes_the_same(request, models, watch, backend_name: str) -> None:
    """A 'cut' keeping every token, in another order, must guess exactly what the full head guesses."""
    ms, b = on(request, backend_name, models)
    ref = ref_on(request, b)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    spies = watch(Spy)
    out_full, st_full = generate(ms["target"], make("near", ms), PROMPT, N, 3, backend=b)
    out_perm, st_perm = generate(ms["target"], make("near", ms, perm), PROMPT, N, 3, backend=b)
    full, permuted = spies
    assert out_full == out_perm == ref
    assert full.guesses and permuted.guesses == full.guesses and st_perm.accepted_at == st_full.accepted_at


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("kind", ["near", "mtp", "self"])
def test_cut_head_keeps_greedy_identity(request, models, watch, kind: str, backend_name: str) -> None:
    ms, b = on(request, backend_name, models)
    ref = ref_on(request, b)
    counts = torch.bincount(torch.tensor(ref), minlength=64)
    ids = counts.argsort(descending=True, stable=True)[:12]  # the 12 tokens the target uses most
    spies = watch(Spy)
    for k in (1, 3):
        out, stats = generate(ms["target"], make(kind, ms, ids), PROMPT, N, k, backend=b)
        spy = spies[-1]
        assert out == ref
        check_stats(stats, out, k)
        assert spy.guesses and set(spy.guesses) <= set(ids.tolist())  # from the cut only, as token ids
        if kind == "self":
            assert 0.3 < stats.acceptance_rate < 1.0  # right wherever the target's token is in the cut


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("kind", ["near", "mtp"])
def test_cut_head_sampling(request, models, watch, kind: str, backend_name: str) -> None:
    ms, b = on(request, backend_name, models)
    ref = ref_on(request, b)
    ids = torch.arange(0, 64, 2)  # the even tokens only
    spies = watch(Spy)
    greedy_by_sampling = Sampling(temperature=0.7, top_k=1, seed=1)
    assert generate(ms["target"], make(kind, ms, ids), PROMPT, N, 3, greedy_by_sampling, backend=b)[0] == ref
    assert spies[-1].guesses and all(g % 2 == 0 for g in spies[-1].guesses)
    a = generate(ms["target"], make(kind, ms, ids), PROMPT, 60, 3, SAMPLED, backend=b)
    assert spies[-1].guesses and all(g % 2 == 0 for g in spies[-1].guesses)
    c = generate(ms["target"], make(kind, ms, ids), PROMPT, 60, 3, SAMPLED, backend=b)
    assert a[0] == c[0] and len(a[0]) == 60
    assert any(t % 2 for t in a[0])  # the output is the target's: odd tokens appear


def test_trained_mtp_with_a_cut_head(trained, watch) -> None:
    m, period = trained.model, trained.period
    prompt = period[:10]
    ref = alone(m, prompt, N)
    in_period = torch.tensor(sorted(set(period)))
    out, stats = generate(m, trained_mtp(trained, in_period), prompt, N, 3)
    assert out == ref and stats.acceptance_rate > 0.5  # the cut holds every token the stream needs
    half = in_period[::2]
    spies = watch(Spy)
    out, stats = generate(m, trained_mtp(trained, half), prompt, N, 3)
    assert out == ref and spies[0].guesses and set(spies[0].guesses) <= set(half.tolist())
    assert stats.acceptance_rate < 0.8


# --- sampling --------------------------------------------------------------------------------
SAMPLED = Sampling(temperature=0.9, top_k=40, top_p=0.95, seed=7)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_sampling_is_seeded(request, models, kind: str, backend_name: str) -> None:
    ms, b = on(request, backend_name, models)

    def run(seed: int) -> list[int]:
        s = Sampling(SAMPLED.temperature, SAMPLED.top_k, SAMPLED.top_p, seed)
        out, stats = generate(ms["target"], make(kind, ms), PROMPT, 80, 0 if kind == "none" else 3, s, backend=b)
        assert len(out) == 80
        check_stats(stats, out, stats.k, fixed=kind in FIXED)
        return out

    a, b_, c = run(7), run(7), run(8)
    assert a == b_
    assert a != c


def test_sampling_differs_from_greedy(target, reference) -> None:
    out, _ = generate(target, NONE, PROMPT, N, 0, SAMPLED)
    assert out != reference


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("k", (1, 4))
def test_sampling_self_draft_accepts_everything(request, models, backend_name: str, k: int) -> None:
    """p == q when the proposer is the target: min(1, p/q) is 1, so every guess is kept."""
    ms, b = on(request, backend_name, models)
    for seed in range(3):
        s = Sampling(temperature=1.3, seed=seed)
        out, stats = generate(ms["target"], make("self", ms), PROMPT, 100, k, s, backend=b)
        assert stats.acceptance_rate == 1.0 and len(out) == 100
        assert rounds(stats) == math.ceil(99 / (k + 1))


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("kind", ["draft", "near", "mtp", "ngram+mtp"])
def test_sampling_top_k_1_is_greedy(request, models, kind: str, backend_name: str) -> None:
    """top-k 1 makes p and q one-hot: the rejection sampler must then give the greedy output."""
    ms, b = on(request, backend_name, models)
    ref = ref_on(request, b)
    s = Sampling(temperature=0.7, top_k=1, seed=3)
    assert generate(ms["target"], NONE, PROMPT, N, 0, s, backend=b)[0] == ref
    out, stats = generate(ms["target"], make(kind, ms), PROMPT, N, 3, s, backend=b)
    assert out == ref
    check_stats(stats, out, 3, fixed=kind in FIXED)


# --- min-p and the repetition penalty: applied to the target before verification ------------------
PENALTIES = (1.5, 0.8)  # above 1 discourages repeats, below 1 favours them


def penalized_logits(target: Transformer, prompt: list[int], out: list[int], penalty: float) -> torch.Tensor:
    """The logits that chose each of `out`, through the training path (whole sequence, no cache), with
    the penalty applied one position at a time by hand: the context is the prompt and out[:i]."""
    logits = reference_logits(target, torch.tensor(prompt + out))[len(prompt) - 1 : -1].clone()  # [len(out), V]
    for i in range(len(out)):
        for t in set(prompt + out[:i]):
            x = logits[i, t]
            logits[i, t] = x / penalty if x > 0 else x * penalty
    return logits


@pytest.fixture(scope="module")
def penalized(target) -> dict[float, list[int]]:
    return {pen: alone(target, sampling=Sampling(repetition_penalty=pen)) for pen in PENALTIES}


@pytest.mark.parametrize("penalty", PENALTIES)
def test_penalized_reference_is_a_real_test(target, reference, penalized, penalty: float) -> None:
    """The target alone with the penalty picks the argmax of its penalized logits, with no near-tie,
    and the penalty changes the text."""
    ref = penalized[penalty]
    assert len(ref) == N and ref != reference
    logits = penalized_logits(target, PROMPT, ref, penalty)
    assert logits.argmax(-1).tolist() == ref
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3
    if penalty > 1:  # fewer repeats than without it
        assert len(set(ref)) > len(set(reference))


@pytest.mark.parametrize("k", (1, 3, 5))
@pytest.mark.parametrize("kind", ["draft", "near", "mtp", "self", "ngram", "ngram+mtp"])
@pytest.mark.parametrize("penalty", PENALTIES)
def test_greedy_identity_with_repetition_penalty(models, penalized, kind: str, k: int, penalty: float) -> None:
    """The proposer guesses without the penalty; verification uses the penalized target: the output is
    the penalized target alone's, whatever the proposer."""
    out, stats = generate(models["target"], make(kind, models), PROMPT, N, k, Sampling(repetition_penalty=penalty))
    assert out == penalized[penalty]
    check_stats(stats, out, k, fixed=kind in FIXED)


@pytest.mark.parametrize("kind", ["near", "mtp", "self", "ngram+mtp"])
@pytest.mark.parametrize("penalty", PENALTIES)
def test_greedy_identity_with_repetition_penalty_native(native_models, kind: str, penalty: float) -> None:
    """The same on the native backend (its chain of guesses scores them with the penalty, in C)."""
    tgt, b = native_models["target"], native_models["backend"]
    s = Sampling(repetition_penalty=penalty)
    ref = alone(tgt, sampling=s, backend=b)
    assert ref == alone(tgt, sampling=s) and ref != alone(tgt, backend=b)
    for k in (1, 4):
        out, stats = generate(tgt, make(kind, native_models), PROMPT, N, k, s, backend=b)
        assert out == ref
        check_stats(stats, out, k, fixed=kind in FIXED)


def test_greedy_identity_with_penalty_and_min_p(models, reference, penalized) -> None:
    """min-p never drops the top token: greedy (temperature 0, or top-k 1) ignores it, the penalty stays."""
    for kind, k in (("none", 0), ("near", 3), ("mtp", 4), ("ngram+mtp", 4)):

        def run(s: Sampling, kind: str = kind, k: int = k) -> list[int]:
            return generate(models["target"], make(kind, models), PROMPT, N, k, s)[0]

        assert run(Sampling(min_p=0.3)) == reference
        assert run(Sampling(min_p=0.3, repetition_penalty=1.5)) == penalized[1.5]
        assert run(Sampling(temperature=0.7, top_k=1, min_p=0.2, repetition_penalty=1.5, seed=3)) == penalized[1.5]


def test_trained_mtp_with_repetition_penalty(trained) -> None:
    """A periodic stream repeats every token: a strong penalty changes the text from the first token on;
    MTP's guesses (made without it) are often wrong, and the output must still be the penalized target's."""
    m, prompt = trained.model, trained.period[:10]
    s = Sampling(repetition_penalty=5.0)
    ref = alone(m, prompt, N, s)
    assert ref != alone(m, prompt, N)
    for k in (2, 4):
        out, stats = generate(m, trained_mtp(trained), prompt, N, k, s)
        assert out == ref
        check_stats(stats, out, k)


@pytest.mark.parametrize("kind", ["none", "near", "mtp"])
def test_sampled_tokens_pass_min_p_of_the_penalized_target(models, kind: str) -> None:
    """Every sampled token has, under the penalized target at its position, a probability of at least
    min_p times the top one's; without min-p some token has less (the check can fail)."""
    target, T, min_p, pen = models["target"], 1.0, 0.3, 1.3

    def ratios(s: Sampling) -> torch.Tensor:
        out, _ = generate(target, make(kind, models), PROMPT, 80, 0 if kind == "none" else 3, s)
        assert len(out) == 80
        probs = torch.softmax(penalized_logits(target, PROMPT, out, pen) / T, dim=-1)
        return probs.gather(1, torch.tensor(out)[:, None])[:, 0] / probs.amax(-1)  # [80]

    for seed in range(3):
        assert ratios(Sampling(T, seed=seed, min_p=min_p, repetition_penalty=pen)).min() >= min_p * (1 - 1e-5)
    assert min(float(ratios(Sampling(T, seed=seed, repetition_penalty=pen)).min()) for seed in range(3)) < min_p


@pytest.mark.parametrize("kind", ["none", "near", "mtp"])
def test_sampling_with_options_is_seeded(models, kind: str) -> None:
    def run(seed: int) -> list[int]:
        s = Sampling(0.9, None, 0.95, seed, min_p=0.05, repetition_penalty=1.2)
        return generate(models["target"], make(kind, models), PROMPT, 60, 0 if kind == "none" else 3, s)[0]

    a, b, c = run(7), run(7), run(8)
    assert a == b and len(a) == 60 and a != c


def test_sampling_defaults_are_off() -> None:
    s = Sampling()
    assert s.greedy and not s.penalized and s.warp() is None
    assert Sampling(min_p=0.5, repetition_penalty=1.2).greedy  # greedy means temperature 0
    w = Sampling(0.8, 5, 0.9, 1, min_p=0.1).warp()
    assert w is not None and (w.temperature, w.top_k, w.top_p, w.min_p) == (0.8, 5, 0.9, 0.1)


# --- stop token and length -------------------------------------------------------------------
def first_new(ref: list[int], at_least: int) -> tuple[int, int]:
    """A token whose first occurrence in ref is at index >= at_least: (token, index)."""
    for i, t in enumerate(ref):
        if i >= at_least and t not in ref[:i]:
            return t, i
    raise AssertionError("no suitable stop token")


@pytest.mark.parametrize("kind", ["none", "near", "mtp", "self", "ngram+mtp"])
@pytest.mark.parametrize("at_least", [1, 7, 30])
def test_an_end_id_ends_the_output(models, reference, kind: str, at_least: int) -> None:
    """The first of the model's end ids to come ends the output (it is not emitted); the others,
    never produced, change nothing."""
    stop, idx = first_new(reference, at_least)
    absent = next(t for t in range(64) if t not in reference)
    for k in (1, 2, 4) if kind != "none" else (0,):
        out, stats = generate(models["target"], make(kind, models), PROMPT, N, k, end_ids=(absent, stop))
        assert out == reference[:idx]
        assert stop not in out
        assert stats.new_tokens == idx and stats.end_token == 1
        if kind == "none":  # a token a pass, the end token's pass included
            assert stats.passes == idx + 1 and stats.tokens_per_pass == 1.0


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_an_end_id_as_first_token(request, models, backend_name: str) -> None:
    ms, b = on(request, backend_name, models)
    ref = ref_on(request, b)
    for kind, k in (("none", 0), ("self", 3), ("mtp", 3)):
        out, stats = generate(ms["target"], make(kind, ms), PROMPT, N, k, end_ids=[ref[0]], backend=b)
        assert out == [] and stats.new_tokens == 0 and stats.proposed == 0
        assert stats.passes == 1 and stats.tokens_per_pass == 1.0  # the pass yielded the end token


def test_end_ids_never_produced_change_nothing(models, reference) -> None:
    absent = [t for t in range(64) if t not in reference][:3]
    out, _ = generate(models["target"], make("self", models), PROMPT, N, 3, end_ids=absent)
    assert out == reference


def stream(target, p, prompt: list[int], n: int, k: int, stats: Stats | None = None, backend: Backend | None = None):
    """One prompt's tokens round by round, on an engine of its own (`generate`'s, kept open)."""
    return answer(build.build(EngineConfig(target, p, backend or Backend(), k)), Request(0, 0, tuple(prompt), n), stats)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_stream_stops_when_the_consumer_stops(request, models, backend_name: str) -> None:
    """Chunks come round by round; a consumer that stops early still sees valid stats."""
    ms, b = on(request, backend_name, models)
    ref = ref_on(request, b)
    stats = Stats("self", 3)
    got: list[int] = []
    for chunk in stream(ms["target"], make("self", ms), PROMPT, N, 3, stats=stats, backend=b):
        assert 1 <= len(chunk) <= 4
        got += chunk
        if len(got) >= 20:
            break
    assert 20 <= len(got) < N
    assert got == ref[: len(got)] and stats.new_tokens == len(got)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("kind", ["none", "near", "mtp", "self", "ngram+mtp"])
def test_max_new_tokens_is_exact(request, models, kind: str, backend_name: str) -> None:
    """Including when the last round yields more tokens than remain (the self draft yields k+1 each)."""
    ms, b = on(request, backend_name, models)
    ref = ref_on(request, b)
    for n in (1, 2, 3, 5, 6, 7, 11, 17):
        for k in (1, 3, 5) if kind != "none" else (0,):
            out, stats = generate(ms["target"], make(kind, ms), PROMPT, n, k, backend=b)
            assert out == ref[:n], (n, k)
            assert stats.new_tokens == n
            check_stats(stats, out, k, fixed=kind in FIXED)


def test_sampled_max_new_tokens_is_exact(models) -> None:
    for kind in ("self", "ngram+mtp"):
        for n in (1, 4, 9):
            out, stats = generate(models["target"], make(kind, models), PROMPT, n, 5, SAMPLED)
            assert len(out) == n and stats.new_tokens == n


def test_max_new_tokens_zero_gives_nothing(target) -> None:
    out, stats = generate(target, NONE, PROMPT, 0, 0)
    assert out == [] and stats.new_tokens == 0


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_long_run_to_the_context_edge(request, models, backend_name: str) -> None:
    """Prompt + new tokens + k + 1 up to the context (256): the caches and rope tables suffice."""
    ms, b = on(request, backend_name, models)
    target = ms["target"]
    n = target.cfg.max_seq_len - len(PROMPT) - 4 - 1
    ref = alone(target, PROMPT, n, backend=b)
    for kind in ("self", "mtp"):
        out, stats = generate(target, make(kind, ms), PROMPT, n, 4, backend=b)
        assert out == ref and len(out) == n
        check_stats(stats, out, 4)


# --- one sequence's passes through the paged layout against the training path --------------------
def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_last_position_alone_matches_the_full_pass(request, models, backend_name: str) -> None:
    """head "last": the last row's logits as in a full pass (head "all"), the same states for every
    row; a pass after a cached past reads K/V that give the training path's logits."""
    ms, b = on(request, backend_name, models)
    empty = torch.empty(0, dtype=torch.long)
    ids = torch.tensor(PROMPT)
    for model in (ms["target"], ms["draft"]):
        steps = None if b is None else b.steps(model)
        assert (steps is None) == (b is None)
        full, h_full = sequence_pass(model, empty, ids, steps, "all")
        last, h_last = sequence_pass(model, empty, ids, steps, "last")
        assert full.shape == (len(PROMPT), 64) and last.shape == (1, 64)
        close(last, full[-1:])
        close(h_last, h_full)
        assert kv_close(full, reference_logits(model, ids))
        nxt, _ = sequence_pass(model, ids, torch.tensor([7, 8]), steps)  # the prompt's K/V cached first
        assert kv_close(nxt, reference_logits(model, torch.tensor([*PROMPT, 7, 8]))[-2:])


def mtp_sequence_pass(
    mtp: MTPModule, target: Transformer, h: torch.Tensor, tokens: torch.Tensor, split: int, steps=None
) -> torch.Tensor:
    """The module's states over pairs (h_j, token j+1), in two passes (the first `split` pairs,
    then the rest over their cached K/V), through a pool of its own."""
    T = tokens.shape[0]
    pool = PagePool(pages_for(T, 16) + 1, 16)
    pool.add(0)
    pool.reserve(0, T)
    slab = slab_for(mtp, pool.n_pages * 16, h.device)
    outs = []
    with torch.inference_mode():
        for lo, hi in ((0, split), (split, T)):
            b = build_step([pool.tables[0]], [lo], [hi - lo], 16, h.device)
            outs.append(mtp_pass(mtp, target, slab, h[lo:hi], tokens[lo:hi], b, steps))
    return torch.cat(outs)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_mtp_pass_matches_its_training_forward(request, models, backend_name: str) -> None:
    """The engine's MTP pass (token half of the projection looked up, rope by complex multiply,
    paged slab, a cached past) computes what the training path computes."""
    ms, b = on(request, backend_name, models)
    target, mtp = ms["target"], ms["mtp"]
    T = 6
    h, tokens = torch.randn(T, target.cfg.dim, generator=torch.Generator().manual_seed(0)), torch.tensor(PROMPT[:T])
    with torch.no_grad():
        ref = mtp(h[None], target.embed_tokens(tokens)[None], target.cos[:T], target.sin[:T])[0]
    steps = None if b is None else b.steps(mtp)
    assert (steps is None) == (b is None)
    for split in (1, 4):
        assert kv_close(mtp_sequence_pass(mtp, target, h, tokens, split, steps), ref)


@pytest.mark.parametrize("at", ["prefill", "round"])
def test_non_finite_logits_stop_loudly(target, at: str) -> None:
    """NaN logits would make argmax and sampling pick token 0 in silence: the loop raises instead."""
    broken = copy.deepcopy(target)
    assert broken.head_t is not None and broken.head_rows is not None

    def poison() -> None:  # every position's logit 5, whichever layout of the head a pass reads
        broken.head_t[:, 5] = float("nan")  # type: ignore[index]
        broken.head_rows[5] = float("nan")  # type: ignore[index]

    if at == "prefill":
        poison()
    chunks: list[list[int]] = []
    with pytest.raises(NonFiniteError, match="not finite"):
        for chunk in stream(broken, NONE, PROMPT, 20, 0):
            chunks.append(chunk)
            if at == "round":
                poison()  # from the first round on
    assert len(chunks) == (0 if at == "prefill" else 1)  # the prefill's token came out before the NaN
