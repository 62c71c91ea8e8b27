"""The speculative loop: greedy identity with the target alone, sampling, stop tokens, lengths, stats."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import MAX_LEN, PROMPT

from smallem_cli.engine.generate import generate, stream
from smallem_cli.model.llama import Transformer
from smallem_cli.spec.head import Head
from smallem_cli.spec.proposers import DraftProposer, MTPProposer, NoProposer
from smallem_cli.spec.sampling import NonFiniteError, Sampling
from smallem_cli.stats import Stats

N = 120  # tokens per identity run
KS = (1, 2, 3, 4, 5)


def alone(target: Transformer, prompt: list[int] = PROMPT, n: int = N, sampling: Sampling = Sampling()) -> list[int]:
    out, stats = generate(target, NoProposer(), prompt, n, 0, sampling)
    assert stats.passes == len(out) and stats.proposed == 0  # one token per pass, none guessed
    return out


def make(kind: str, models: dict):
    """A fresh proposer of one kind (each generation needs its own caches)."""
    if kind == "mtp":
        return MTPProposer(models["target"], models["mtp"], MAX_LEN)
    return DraftProposer(models[kind], MAX_LEN)


@pytest.fixture(scope="module")
def models(target, draft, near_draft, mtp) -> dict:
    return {"target": target, "draft": draft, "near": near_draft, "mtp": mtp, "self": target}


@pytest.fixture(scope="module")
def reference(target) -> list[int]:
    return alone(target)


def rounds(stats: Stats) -> int:
    """Verify rounds run: `passes` counts the target passes that yielded tokens, the prefill's included."""
    return stats.passes - 1


def check_stats(stats: Stats, out: list[int], k: int) -> None:
    assert stats.new_tokens == len(out) > 0
    assert stats.k == k
    assert stats.proposed == k * rounds(stats)
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


def test_reference_is_a_real_test(target, reference) -> None:
    """The target's greedy run is varied, and no step is a near-tie that float rounding could flip."""
    assert len(reference) == N and len(set(reference)) >= 15
    full = torch.tensor(PROMPT + reference)
    with torch.no_grad():  # the training path: whole sequence, no cache
        logits = target.logits(target.hidden(full[None]))[0, len(PROMPT) - 1 : -1]
    assert logits.argmax(-1).tolist() == reference
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("kind", ["draft", "near", "mtp", "self"])
def test_greedy_identity(models, reference, kind: str, k: int) -> None:
    out, stats = generate(models["target"], make(kind, models), PROMPT, N, k)
    assert out == reference
    check_stats(stats, out, k)
    if kind == "self":  # the target as its own draft: every guess is kept, k+1 tokens a pass
        assert stats.acceptance_rate == 1.0
        assert rounds(stats) == math.ceil((N - 1) / (k + 1))
        assert stats.tokens_per_pass == pytest.approx(N / (rounds(stats) + 1))
        assert k + 1 >= stats.tokens_per_pass > (k + 1) * 0.95
    if kind == "near":  # partly accepted: both the keep-all and the reject paths run
        assert 0.1 < stats.acceptance_rate < 0.95


def test_greedy_identity_with_partial_acceptance_at_every_depth(models, reference) -> None:
    """The noisy draft's rounds stop at every position 0..k: rollback is exercised at each depth."""
    out, stats = generate(models["target"], make("near", models), PROMPT, N, 4)
    assert out == reference
    assert stats.accepted_at[-1] > 0  # some rounds kept all 4
    assert stats.accepted_at[0] < rounds(stats)  # some rounds kept none
    assert len(set(stats.accepted_at)) == 4  # and in between, rounds stopped at each depth


@pytest.mark.parametrize("prompt", [[5], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]])
@pytest.mark.parametrize("kind", ["near", "mtp"])
def test_greedy_identity_other_prompts(models, target, prompt: list[int], kind: str) -> None:
    """A one-token prompt (MTP starts with a single state) and a prompt crossing a page boundary."""
    ref = alone(target, prompt, 60)
    for k in (1, 3):
        assert generate(target, make(kind, models), prompt, 60, k)[0] == ref


# --- a trained target + MTP module: MTP guesses that are mostly right ------------------------
@pytest.mark.parametrize("k", KS)
def test_trained_mtp_is_accepted_and_exact(trained, k: int) -> None:
    m, period = trained.model, trained.period
    prompt = period[:10]
    ref = alone(m, prompt, N)
    assert ref[:30] == period[10:]  # the target has learnt the stream
    out, stats = generate(m, MTPProposer(m, trained.mtp, MAX_LEN), prompt, N, k)
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
        assert generate(m, MTPProposer(m, trained.mtp, MAX_LEN), prompt, 80, k)[0] == ref


# --- the proposers' incremental state matches a from-scratch computation -----------------------
# Verification hides a proposer's mistakes (the output stays exact), so these tests check the guesses
# themselves: each round's k guesses must be what the proposer computes from the whole sequence,
# through the training path (no cache, unpacked weights).
class Oracle:
    """Wraps a proposer; at every round compares its greedy guesses with `expect(sequence, k)`."""

    def __init__(self, inner, expect) -> None:
        self.inner, self.name, self.expect = inner, inner.name, expect
        self.seq: list[int] = []
        self.checked = self.skipped = 0

    def start(self, prompt, first, hidden) -> None:
        self.inner.start(prompt, first, hidden)
        self.seq = prompt.tolist() + first.tolist()

    def propose(self, k, warp, generator, penalty=None):
        tokens, q = self.inner.propose(k, warp, generator, penalty)
        want, gaps = self.expect(self.seq, k)
        for got, w, gap in zip(tokens.tolist(), want, gaps, strict=True):
            if gap < 1e-4:  # a near-tie: rounding may pick either, and later guesses follow from it
                self.skipped += 1
                break
            assert got == w, (len(self.seq), tokens.tolist(), want)
            self.checked += 1
        return tokens, q

    def accept(self, n, emitted, hidden) -> None:
        self.inner.accept(n, emitted, hidden)
        self.seq += emitted.tolist()

    def release(self) -> None:
        self.inner.release()


def _top(logits: torch.Tensor) -> tuple[int, float]:
    top2 = logits.topk(2).values
    return int(logits.argmax()), float(top2[0] - top2[1])


def draft_expect(draft: Transformer):
    def expect(seq: list[int], k: int) -> tuple[list[int], list[float]]:
        ctx, want, gaps = list(seq), [], []
        with torch.no_grad():
            for _ in range(k):
                t, gap = _top(draft.logits(draft.hidden(torch.tensor(ctx)[None]))[0, -1])
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


@pytest.mark.parametrize("k", (1, 3, 5))
@pytest.mark.parametrize("kind", ["draft", "near", "mtp", "trained-mtp"])
def test_guesses_match_a_from_scratch_computation(models, trained, kind: str, k: int) -> None:
    if kind == "trained-mtp":
        tgt, prompt = trained.model, trained.period[:10]
        oracle = Oracle(MTPProposer(tgt, trained.mtp, MAX_LEN), mtp_expect(tgt, trained.mtp))
    elif kind == "mtp":
        tgt, prompt = models["target"], PROMPT
        oracle = Oracle(make(kind, models), mtp_expect(tgt, models["mtp"]))
    else:
        tgt, prompt = models["target"], PROMPT
        oracle = Oracle(make(kind, models), draft_expect(models[kind]))
    out, stats = generate(tgt, oracle, prompt, 60, k)
    assert out == alone(tgt, prompt, 60)
    assert oracle.checked >= 0.9 * stats.proposed and oracle.skipped <= 2


# --- proposer heads cut to a subset of the vocabulary ---------------------------------------------
class Spy:
    """A proposer wrapper that records every guess."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.guesses = inner, inner.name, []

    def start(self, prompt, first, hidden) -> None:
        self.inner.start(prompt, first, hidden)

    def propose(self, k, warp, generator, penalty=None):
        tokens, q = self.inner.propose(k, warp, generator, penalty)
        self.guesses += tokens.tolist()
        if q is not None:  # q is a distribution over the whole vocabulary, zero outside the cut
            assert q.shape == (k, 64) and torch.allclose(q.sum(-1), torch.ones(k))
        return tokens, q

    def accept(self, n, emitted, hidden) -> None:
        self.inner.accept(n, emitted, hidden)

    def release(self) -> None:
        self.inner.release()


def test_permuted_full_head_proposes_the_same(models, reference) -> None:
    """A 'cut' keeping every token, in another order, must guess exactly what the full head guesses."""
    near = models["near"]
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    full = Spy(DraftProposer(near, MAX_LEN))
    permuted = Spy(DraftProposer(near, MAX_LEN, head=Head(near, perm)))
    out_full, st_full = generate(models["target"], full, PROMPT, N, 3)
    out_perm, st_perm = generate(models["target"], permuted, PROMPT, N, 3)
    assert out_full == out_perm == reference
    assert permuted.guesses == full.guesses and st_perm.accepted_at == st_full.accepted_at


@pytest.mark.parametrize("kind", ["near", "mtp", "self"])
def test_cut_head_keeps_greedy_identity(models, reference, kind: str) -> None:
    counts = torch.bincount(torch.tensor(reference), minlength=64)
    ids = counts.argsort(descending=True, stable=True)[:12]  # the 12 tokens the target uses most
    model = models["target"] if kind == "mtp" else models[kind]
    for k in (1, 3):
        inner = (
            MTPProposer(models["target"], models["mtp"], MAX_LEN, head=Head(model, ids))
            if kind == "mtp"
            else DraftProposer(model, MAX_LEN, head=Head(model, ids))
        )
        spy = Spy(inner)
        out, stats = generate(models["target"], spy, PROMPT, N, k)
        assert out == reference
        check_stats(stats, out, k)
        assert set(spy.guesses) <= set(ids.tolist())  # guesses come from the cut only, as token ids
        if kind == "self":
            assert 0.3 < stats.acceptance_rate < 1.0  # right wherever the target's token is in the cut


@pytest.mark.parametrize("kind", ["near", "mtp"])
def test_cut_head_sampling(models, reference, kind: str) -> None:
    ids = torch.arange(0, 64, 2)  # the even tokens only
    model = models["target"] if kind == "mtp" else models[kind]

    def proposer() -> Spy:
        head = Head(model, ids)
        if kind == "mtp":
            return Spy(MTPProposer(models["target"], models["mtp"], MAX_LEN, head=head))
        return Spy(DraftProposer(model, MAX_LEN, head=head))

    greedy_by_sampling = Sampling(temperature=0.7, top_k=1, seed=1)
    spy = proposer()
    assert generate(models["target"], spy, PROMPT, N, 3, greedy_by_sampling)[0] == reference
    assert spy.guesses and all(g % 2 == 0 for g in spy.guesses)
    a = generate(models["target"], proposer(), PROMPT, 60, 3, SAMPLED)
    b = generate(models["target"], proposer(), PROMPT, 60, 3, SAMPLED)
    assert a[0] == b[0] and len(a[0]) == 60
    assert any(t % 2 for t in a[0])  # the output is the target's: odd tokens appear


def test_trained_mtp_with_a_cut_head(trained) -> None:
    m, period = trained.model, trained.period
    prompt = period[:10]
    ref = alone(m, prompt, N)
    in_period = torch.tensor(sorted(set(period)))
    out, stats = generate(m, MTPProposer(m, trained.mtp, MAX_LEN, head=Head(m, in_period)), prompt, N, 3)
    assert out == ref and stats.acceptance_rate > 0.5  # the cut holds every token the stream needs
    half = in_period[::2]
    spy = Spy(MTPProposer(m, trained.mtp, MAX_LEN, head=Head(m, half)))
    out, stats = generate(m, spy, prompt, N, 3)
    assert out == ref and set(spy.guesses) <= set(half.tolist())
    assert stats.acceptance_rate < 0.8


# --- sampling --------------------------------------------------------------------------------
SAMPLED = Sampling(temperature=0.9, top_k=40, top_p=0.95, seed=7)


@pytest.mark.parametrize("kind", ["none", "draft", "near", "mtp", "self"])
def test_sampling_is_seeded(models, kind: str) -> None:
    def run(seed: int) -> list[int]:
        proposer = NoProposer() if kind == "none" else make(kind, models)
        s = Sampling(SAMPLED.temperature, SAMPLED.top_k, SAMPLED.top_p, seed)
        out, stats = generate(models["target"], proposer, PROMPT, 80, 0 if kind == "none" else 3, s)
        assert len(out) == 80
        check_stats(stats, out, stats.k)
        return out

    a, b, c = run(7), run(7), run(8)
    assert a == b
    assert a != c


def test_sampling_differs_from_greedy(target, reference) -> None:
    out, _ = generate(target, NoProposer(), PROMPT, N, 0, SAMPLED)
    assert out != reference


@pytest.mark.parametrize("k", (1, 4))
def test_sampling_self_draft_accepts_everything(target, k: int) -> None:
    """p == q when the proposer is the target: min(1, p/q) is 1, so every guess is kept."""
    for seed in range(3):
        s = Sampling(temperature=1.3, seed=seed)
        out, stats = generate(target, DraftProposer(target, MAX_LEN), PROMPT, 100, k, s)
        assert stats.acceptance_rate == 1.0 and len(out) == 100
        assert rounds(stats) == math.ceil(99 / (k + 1))


@pytest.mark.parametrize("kind", ["draft", "near", "mtp"])
def test_sampling_top_k_1_is_greedy(models, reference, kind: str) -> None:
    """top-k 1 makes p and q one-hot: the rejection sampler must then give the greedy output."""
    s = Sampling(temperature=0.7, top_k=1, seed=3)
    assert generate(models["target"], NoProposer(), PROMPT, N, 0, s)[0] == reference
    out, stats = generate(models["target"], make(kind, models), PROMPT, N, 3, s)
    assert out == reference
    check_stats(stats, out, 3)


# --- min-p and the repetition penalty: applied to the target before verification ------------------
PENALTIES = (1.5, 0.8)  # above 1 discourages repeats, below 1 favours them


def penalized_logits(target: Transformer, prompt: list[int], out: list[int], penalty: float) -> torch.Tensor:
    """The logits that chose each of `out`, through the training path (whole sequence, no cache), with
    the penalty applied one position at a time by hand: the context is the prompt and out[:i]."""
    full = torch.tensor(prompt + out)
    with torch.no_grad():
        logits = target.logits(target.hidden(full[None]))[0, len(prompt) - 1 : -1].clone()  # [len(out), V]
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
@pytest.mark.parametrize("kind", ["draft", "near", "mtp", "self"])
@pytest.mark.parametrize("penalty", PENALTIES)
def test_greedy_identity_with_repetition_penalty(models, penalized, kind: str, k: int, penalty: float) -> None:
    """The proposer guesses without the penalty; verification uses the penalized target: the output is
    the penalized target alone's, whatever the proposer."""
    out, stats = generate(models["target"], make(kind, models), PROMPT, N, k, Sampling(repetition_penalty=penalty))
    assert out == penalized[penalty]
    check_stats(stats, out, k)


def test_greedy_identity_with_penalty_and_min_p(models, reference, penalized) -> None:
    """min-p never drops the top token: greedy (temperature 0, or top-k 1) ignores it, the penalty stays."""
    for kind, k in (("none", 0), ("near", 3), ("mtp", 4)):

        def run(s: Sampling, kind: str = kind, k: int = k) -> list[int]:
            proposer = NoProposer() if kind == "none" else make(kind, models)
            return generate(models["target"], proposer, PROMPT, N, k, s)[0]

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
        out, stats = generate(m, MTPProposer(m, trained.mtp, MAX_LEN), prompt, N, k, s)
        assert out == ref
        check_stats(stats, out, k)


@pytest.mark.parametrize("kind", ["none", "near", "mtp"])
def test_sampled_tokens_pass_min_p_of_the_penalized_target(models, kind: str) -> None:
    """Every sampled token has, under the penalized target at its position, a probability of at least
    min_p times the top one's; without min-p some token has less (the check can fail)."""
    target, T, min_p, pen = models["target"], 1.0, 0.3, 1.3

    def ratios(s: Sampling, seed: int) -> torch.Tensor:
        proposer = NoProposer() if kind == "none" else make(kind, models)
        out, _ = generate(target, proposer, PROMPT, 80, 0 if kind == "none" else 3, s)
        assert len(out) == 80
        probs = torch.softmax(penalized_logits(target, PROMPT, out, pen) / T, dim=-1)
        return probs.gather(1, torch.tensor(out)[:, None])[:, 0] / probs.amax(-1)  # [80]

    for seed in range(3):
        assert ratios(Sampling(T, seed=seed, min_p=min_p, repetition_penalty=pen), seed).min() >= min_p * (1 - 1e-5)
    assert min(float(ratios(Sampling(T, seed=seed, repetition_penalty=pen), seed).min()) for seed in range(3)) < min_p


@pytest.mark.parametrize("kind", ["none", "near", "mtp"])
def test_sampling_with_options_is_seeded(models, kind: str) -> None:
    def run(seed: int) -> list[int]:
        proposer = NoProposer() if kind == "none" else make(kind, models)
        s = Sampling(0.9, None, 0.95, seed, min_p=0.05, repetition_penalty=1.2)
        return generate(models["target"], proposer, PROMPT, 60, 0 if kind == "none" else 3, s)[0]

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


@pytest.mark.parametrize("kind", ["none", "near", "mtp", "self"])
@pytest.mark.parametrize("at_least", [1, 7, 30])
def test_stop_token_ends_the_output(models, reference, kind: str, at_least: int) -> None:
    stop, idx = first_new(reference, at_least)
    for k in (1, 2, 4) if kind != "none" else (0,):
        proposer = NoProposer() if kind == "none" else make(kind, models)
        out, stats = generate(models["target"], proposer, PROMPT, N, k, stop_token=stop)
        assert out == reference[:idx]
        assert stop not in out
        assert stats.new_tokens == idx


def test_stop_token_as_first_token(target, reference) -> None:
    for proposer, k in ((NoProposer(), 0), (DraftProposer(target, MAX_LEN), 3)):
        out, stats = generate(target, proposer, PROMPT, N, k, stop_token=reference[0])
        assert out == [] and stats.new_tokens == 0 and stats.proposed == 0


def test_stop_token_never_produced_changes_nothing(target, reference) -> None:
    absent = next(t for t in range(64) if t not in reference)
    out, _ = generate(target, DraftProposer(target, MAX_LEN), PROMPT, N, 3, stop_token=absent)
    assert out == reference


def test_stream_stops_when_the_consumer_stops(target, reference) -> None:
    """Chunks come round by round; a consumer that stops early still sees valid stats."""
    stats = Stats("self", 3)
    got: list[int] = []
    for chunk in stream(target, DraftProposer(target, MAX_LEN), PROMPT, N, 3, stats=stats):
        assert 1 <= len(chunk) <= 4
        got += chunk
        if len(got) >= 20:
            break
    assert got == reference[: len(got)] and stats.new_tokens == len(got)


@pytest.mark.parametrize("kind", ["none", "near", "mtp", "self"])
def test_max_new_tokens_is_exact(models, reference, kind: str) -> None:
    """Including when the last round yields more tokens than remain (the self draft yields k+1 each)."""
    for n in (1, 2, 3, 5, 6, 7, 11, 17):
        for k in (1, 3, 5) if kind != "none" else (0,):
            proposer = NoProposer() if kind == "none" else make(kind, models)
            out, stats = generate(models["target"], proposer, PROMPT, n, k)
            assert out == reference[:n], (n, k)
            assert stats.new_tokens == n
            check_stats(stats, out, k)


def test_sampled_max_new_tokens_is_exact(target) -> None:
    for n in (1, 4, 9):
        out, stats = generate(target, DraftProposer(target, MAX_LEN), PROMPT, n, 5, SAMPLED)
        assert len(out) == n and stats.new_tokens == n


def test_max_new_tokens_zero_gives_nothing(target) -> None:
    out, stats = generate(target, NoProposer(), PROMPT, 0, 0)
    assert out == [] and stats.new_tokens == 0


def test_long_run_to_the_context_edge(target) -> None:
    """Prompt + new tokens + k + 1 up to the context (256): the caches and rope tables suffice."""
    n = target.cfg.max_seq_len - len(PROMPT) - 4 - 1
    ref = alone(target, PROMPT, n)
    out, stats = generate(target, DraftProposer(target, MAX_LEN), PROMPT, n, 4)
    assert out == ref and len(out) == n
    check_stats(stats, out, 4)


def test_last_position_alone_matches_the_full_pass(models: dict) -> None:
    """`last=True`: the last row's output as in a full pass, and the same K/V stored for every row."""
    for model in (models["target"], models["draft"]):
        ids = torch.tensor(PROMPT)
        caches = [model.new_cache(8) for _ in range(2)]
        seqs = [c.new_sequence() for c in caches]
        _, full = model(ids, caches[0], seqs[0], head=False)
        _, last = model(ids, caches[1], seqs[1], head=False, last=True)
        assert last.shape == (1, model.cfg.dim)
        torch.testing.assert_close(last, full[-1:], rtol=1e-5, atol=1e-5)
        nxt = [model(torch.tensor([7, 8]), c, s)[0] for c, s in zip(caches, seqs, strict=True)]
        torch.testing.assert_close(nxt[0], nxt[1], rtol=1e-5, atol=1e-5)  # the cached keys and values agree
    target, mtp = models["target"], models["mtp"]
    h, tokens = torch.randn(5, target.cfg.dim), torch.tensor(PROMPT[:5])
    assert target.rope_packed is not None
    outs = []
    for last in (False, True):
        cache = mtp.new_cache(4)
        seq = cache.new_sequence()
        step = cache.append(seq, 5)
        outs.append(mtp.decode(h, tokens, target.embed_tokens.weight, target.rope_packed[:5], cache, step, last))
    torch.testing.assert_close(outs[1], outs[0][-1:], rtol=1e-5, atol=1e-5)


def test_mtp_decode_matches_its_training_forward(models: dict) -> None:
    """The packed decode path (token half of the projection looked up, rope by complex multiply,
    paged cache) computes what the training path computes."""
    target, mtp = models["target"], models["mtp"]
    T = 6
    h, tokens = torch.randn(T, target.cfg.dim), torch.tensor(PROMPT[:T])
    with torch.no_grad():
        ref = mtp(h[None], target.embed_tokens(tokens)[None], target.cos[:T], target.sin[:T])[0]
    cache = mtp.new_cache(4)
    step = cache.append(cache.new_sequence(), T)
    assert target.rope_packed is not None
    out = mtp.decode(h, tokens, target.embed_tokens.weight, target.rope_packed[:T], cache, step)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("at", ["prefill", "round"])
def test_non_finite_logits_stop_loudly(target, at: str) -> None:
    """NaN logits would make argmax and sampling pick token 0 in silence: the loop raises instead."""
    import copy

    broken = copy.deepcopy(target)
    if at == "prefill":
        broken.head_t[:, 5] = float("nan")  # every position's logit 5
    chunks: list[list[int]] = []
    with pytest.raises(NonFiniteError, match="not finite"):
        for chunk in stream(broken, NoProposer(), PROMPT, 20, 0):
            chunks.append(chunk)
            if at == "round":
                broken.head_t[:, 5] = float("nan")  # from the first round on
    assert len(chunks) == (0 if at == "prefill" else 1)  # the prefill's token came out before the NaN
