"""The model-free n-gram proposer (prompt lookup, `spec.ngram`), alone and in front of a model
(`ngram+P`, `engine.proposers.FallbackProposer`), and the depth it chooses from its measured acceptance.

Each changes how many guesses a round checks, never what the user gets: greedy output
identical to the target alone, and sampling exact with a point-mass q (the seed's χ² test).
"""

from __future__ import annotations

from typing import cast

import pytest
import torch
import torch.nn.functional as F
from conftest import PROMPT, random_model
from engine_help import backend, halved, proposer
from test_generate import NATIVE_DRAFT_CFG, check_stats, no_native, on
from test_verify import P1, P2, check_exact

from smallem_cli import defaults
from smallem_cli.engine import build
from smallem_cli.engine.family import NONE, LoadedProposer
from smallem_cli.engine.generate import generate
from smallem_cli.engine.proposers import FallbackProposer, NgramProposer
from smallem_cli.engine.sequence import Seq
from smallem_cli.spec.ngram import NgramIndex, NgramLookup, best_depth
from smallem_cli.spec.sampling import Sampling

N = 120
# A prompt that restates itself: copying pays from the first round on.
REPEAT = [*PROMPT, 11, 12, *PROMPT, 11]


def index(tokens: list[int], lo: int = 1, hi: int = 3) -> NgramIndex:
    i = NgramIndex(lo, hi)
    i.extend(tokens)
    return i


def test_lookup_takes_the_longest_then_the_latest_match() -> None:
    # suffix [1, 2]: as a 2-gram it last occurred at 4..5 (followed by 9), as a 1-gram [2] too;
    # the 3-gram [5, 1, 2] occurred at 0..2, followed by 7: the longest wins.
    assert index([5, 1, 2, 7, 1, 2, 9, 5, 1, 2]).match(2)[1] == [7, 1]
    assert index([3, 1, 2, 7, 1, 2, 9, 5, 1, 2]).match(2)[1] == [9, 5]  # no 3-gram: the latest 2-gram
    assert index([1, 2, 3, 4]).match(3)[1] == []  # nothing repeats
    assert index([4, 8, 4], lo=2).match(3)[1] == []  # a 1-gram match is below min_n


def test_lookup_never_matches_the_suffix_itself_and_copies_past_the_end() -> None:
    assert index([7]).match(4)[1] == []
    # [7, 8] last occurred at 0..1: what followed is 7, 8, then the copy of the copy
    assert index([7, 8, 7, 8]).match(5)[1] == [7, 8, 7, 8, 7]
    assert index([9, 9]).match(3)[1] == [9, 9, 9]


def test_index_grows_incrementally_like_built_at_once() -> None:
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 6, (300,), generator=g).tolist()
    whole, parts = index(toks, 2, 4), NgramIndex(2, 4)
    for i in range(0, 300, 7):
        parts.extend(toks[i : i + 7])
    assert whole.last == parts.last and whole.match(5)[1] == parts.match(5)[1] != []


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        NgramIndex(3, 2)
    with pytest.raises(ValueError):
        NgramIndex(0, 2)


def make(kind: str, models: dict, monkeypatch: pytest.MonkeyPatch) -> LoadedProposer:
    """ "ngram" (the engine's lookup: its depth chosen from its measured acceptance), "ngram-fixed"
    (the lookup offering all it finds: a guess cost of 0), "ngram+mtp", "ngram+draft", "mtp"."""
    if kind == "ngram-fixed":
        monkeypatch.setattr(defaults, "NGRAM_DRAFT_COST", 0.0)  # read by `build.proposer_for`
        return proposer("ngram")
    if kind.endswith("mtp"):
        return proposer(kind, models["target"], models["mtp"])
    return proposer(kind, model=models["draft"])


@pytest.fixture(scope="module")
def models(target, draft, mtp) -> dict:
    return {"target": target, "draft": draft, "mtp": mtp}


@pytest.fixture(scope="module")
def native_models(target, mtp) -> dict:
    """float16-exact copies (a draft of native widths), and the native backend prepared for them."""
    if no_native:
        pytest.skip("the native engine needs g++ and an AVX2 CPU")
    m = {"target": halved(target), "draft": halved(random_model(NATIVE_DRAFT_CFG, seed=1)), "mtp": halved(mtp)}
    b = backend("native", m["target"], m["draft"], m["mtp"])
    assert b.label == "native"
    return {**m, "backend": b}


LOOKUPS = ["ngram", "ngram-fixed", "ngram+mtp", "ngram+draft"]


@pytest.mark.parametrize("backend_name", ["eager", "native"])
@pytest.mark.parametrize("prompt", [PROMPT, REPEAT], ids=["plain", "repeating"])
@pytest.mark.parametrize("kind", LOOKUPS)
@pytest.mark.parametrize("k", [1, 3, 6])
def test_ngram_greedy_identity(
    request, models, monkeypatch, prompt: list[int], kind: str, k: int, backend_name: str
) -> None:
    ms, b = on(request, backend_name, models)
    ref, _ = generate(ms["target"], NONE, prompt, N, 0, backend=b)
    out, stats = generate(ms["target"], make(kind, ms, monkeypatch), prompt, N, k, backend=b)
    assert out == ref
    check_stats(stats, out, k, fixed=False)
    if "+" not in kind:
        assert stats.rounds_by_drafted[0] > 0  # some rounds found nothing and checked no guess
    if kind == "ngram-fixed":  # a match is copied k deep (past the text's end too), and all of it offered
        assert sum(stats.rounds_by_drafted[1:k]) == 0 and stats.rounds_by_drafted[k] > 0
    assert stats.proposed > 0


class Counting:
    """A batched proposer passed through, counting the guesses it offers."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.offered, self.rounds = inner, inner.name, 0, 0
        self.taps = inner.taps

    def start(self, seqs, fed, hidden) -> None:
        self.inner.start(seqs, fed, hidden)

    def propose(self, seqs, ks):
        got = self.inner.propose(seqs, ks)
        self.rounds += sum(k > 0 for k in ks)
        self.offered += sum(t.shape[0] for t, _ in got)
        return got

    def accept(self, seq, n, emitted, hidden) -> None:
        self.inner.accept(seq, n, emitted, hidden)

    def drop(self, seq) -> None:
        self.inner.drop(seq)


@pytest.mark.parametrize("backend_name", ["eager", "native"])
@pytest.mark.parametrize("kind", ["ngram+mtp", "ngram+draft"])
def test_fallback_guesses_by_lookup_where_it_matches_and_by_the_model_elsewhere(
    request, models, monkeypatch, kind: str, backend_name: str
) -> None:
    """`ngram+P`: the lookup's guesses where it found some, P's (asked for k) in the other rounds;
    P catches up on the rounds the lookup guessed, and the output stays the target's."""
    ms, b = on(request, backend_name, models)
    made: list[FallbackProposer] = []
    real = build.proposer_for

    def counted(p, target, pool, bk, *suffix):
        fb = real(p, target, pool, bk, *suffix)
        assert isinstance(fb, FallbackProposer) and isinstance(fb.first, NgramProposer)
        fb.first, fb.other = Counting(fb.first), Counting(fb.other)  # type: ignore[assignment]
        made.append(fb)
        return fb

    ref, _ = generate(ms["target"], NONE, REPEAT, N, 0, backend=b)
    monkeypatch.setattr(build, "proposer_for", counted)
    out, stats = generate(ms["target"], make(kind, ms, monkeypatch), REPEAT, N, 4, backend=b)
    assert out == ref and len(made) == 1
    lookup, model = made[0].first, made[0].other
    assert lookup.rounds == stats.passes - 1  # asked every round
    assert lookup.offered > 0 and model.offered > 0  # each guessed in some rounds
    assert model.offered == 4 * model.rounds  # asked only where the lookup found nothing: k then
    assert lookup.offered + model.offered == stats.proposed


def test_ngram_copies_a_repeating_text(models) -> None:
    """Where the target repeats itself, the lookup guesses it: several tokens a pass."""
    target = models["target"]
    ref, _ = generate(target, NONE, PROMPT, 200, 0)
    tail = ref[-60:]  # the random model's own text, which repeats phrases of itself
    _, stats = generate(target, proposer("ngram"), tail, 100, 4)
    assert stats.accepted_at[3] > 0 and stats.tokens_per_pass > 1.4, stats


@pytest.mark.parametrize("kind", ["mtp", "ngram+mtp"])
def test_a_model_proposer_checks_k_guesses_every_round(models, monkeypatch, kind: str) -> None:
    """A model proposer's chain is fixed: k guesses every round (the lookup in front of it offers fewer)."""
    _, st = generate(models["target"], make(kind, models, monkeypatch), PROMPT, N, 3)
    rounds = st.passes - 1
    if kind == "mtp":
        assert st.rounds_by_drafted == [0, 0, 0, rounds]
    else:  # the random model's text repeats little: P guesses most rounds
        assert sum(st.rounds_by_drafted) == rounds and 0 < st.rounds_by_drafted[3] < rounds


@pytest.mark.parametrize("kind", ["ngram", "ngram-fixed", "ngram+mtp", "mtp"])
def test_sampling_is_seeded(models, monkeypatch, kind: str) -> None:
    def run(seed: int) -> list[int]:
        s = Sampling(temperature=1.0, seed=seed)
        return generate(models["target"], make(kind, models, monkeypatch), REPEAT, 60, 4, s)[0]

    a, b, c = run(5), run(5), run(6)
    assert a == b and len(a) == 60 and a != c


def test_point_mass_guesses_sample_exactly() -> None:
    """The n-gram's guesses are point masses (q one-hot): the seed's χ² test on pairs passes
    against the target and fails against the proposer's (point-mass) law."""
    V = P1.shape[0]
    q1 = F.one_hot(torch.tensor(2), V).float()
    q2 = F.one_hot(torch.tensor([1, 3, 0, 4, 2]), V).float()  # the token guessed after each token
    chi_p, chi_q = check_exact(P1, P2, q1, q2, seed=7)
    print(f"point mass: chi2 vs target {chi_p:.1f}, vs proposer {chi_q:.1f}")


def test_ngram_sampled_q_is_one_hot(models) -> None:
    p = NgramLookup(64, 2, 3)
    p.start(torch.tensor([5, 6, 7, 5, 6]), torch.tensor([7]))
    toks, q = p.propose(3, lambda x: x, None)
    assert toks.tolist() == [5, 6, 7] and q is not None
    assert torch.equal(q, F.one_hot(toks, 64).float())
    toks, q = p.propose(3, None, None)
    assert q is None


def test_ngram_sampled_q_is_one_hot_in_the_engine(models, monkeypatch) -> None:
    """The batched lookup (`NgramProposer`) in a sampled generation: each guess's q is a point mass
    on it; greedy, no q."""
    seen: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    real = build.proposer_for

    def spied(p, target, pool, bk, *suffix):
        bp = real(p, target, pool, bk, *suffix)
        assert isinstance(bp, NgramProposer)
        inner = bp.propose

        def propose(seqs, ks):
            got = inner(seqs, ks)
            seen.extend(got)
            return got

        bp.propose = propose  # type: ignore[method-assign]
        return bp

    monkeypatch.setattr(build, "proposer_for", spied)
    monkeypatch.setattr(defaults, "NGRAM_DRAFT_COST", 0.0)  # every lookup offered
    generate(models["target"], proposer("ngram"), REPEAT, 40, 4, Sampling(temperature=1.0, seed=5))
    offered = [(t, q) for t, q in seen if t.shape[0]]
    assert offered
    for t, q in offered:
        assert q is not None and torch.equal(q, F.one_hot(t, 64).float())
    seen.clear()
    generate(models["target"], proposer("ngram"), REPEAT, 40, 4)
    assert any(t.shape[0] for t, _ in seen) and all(q is None for _, q in seen)


def test_best_depth_weighs_acceptance_against_the_pass() -> None:
    assert best_depth(0.02, 0.02, 4, 0.16) == 0  # matches by chance: no guess is worth its cost
    assert best_depth(0.35, 0.3, 4, 0.16) == 1
    assert best_depth(0.35, 0.9, 4, 0.16) == 4  # a copy, when its first token is right
    assert best_depth(0.9, 0.9, 4, 0.16) == 4
    assert best_depth(1.0, 1.0, 6, 0.16) == 6
    assert best_depth(0.5, 0.5, 4, 0.0) == 4  # a free pass: every guess pays


def test_ngram_depth_follows_the_acceptance_it_measures() -> None:
    """Its silent checks see every lookup, offered or not: wrong lookups bring its depth to 0,
    right ones back up, without offering a guess in between."""
    p = NgramLookup(64, 2, 3, draft_cost=0.16)
    p.start(torch.tensor([1, 2, 3, 1, 2]), torch.tensor([3]))
    for i in range(12):  # the lookup says what followed "1 2 3" last time; the target, a new token
        p.propose(4, None, None)
        p.accept(torch.tensor([10 + i]))
        p.index.extend([1, 2, 3])  # a lookup every round
    toks, _ = p.propose(4, None, None)
    assert toks.shape[0] == 0 and p.rates[0] < 0.2
    for _ in range(6):  # now the lookup would have been right, offered or not
        looked = p.index.match(4)[1]
        p.propose(4, None, None)
        p.accept(torch.tensor(looked[:1]))
    toks, _ = p.propose(4, None, None)
    assert toks.shape[0] >= 1 and p.rates[0] > 0.5


def test_rounds_without_guesses_are_taken_in_as_accept_would() -> None:
    """Under load (k 0) the lookup is not asked and only queues a round's tokens; when it is next asked, its rates
    and index are what a lookup of nothing every round would have made, to the bit, and so is its next guess."""
    g = torch.Generator().manual_seed(1)
    rounds = [torch.randint(0, 8, (int(n),), generator=g) for n in torch.randint(1, 4, (9,), generator=g)]
    each, queued = NgramLookup(64, 2, 3, draft_cost=0.16), NgramLookup(64, 2, 3, draft_cost=0.16)
    for p in (each, queued):
        p.start(torch.tensor([1, 2, 3, 1, 2]), torch.tensor([3]))
        p.propose(4, None, None)
        p.accept(torch.tensor([1, 2]))  # rates away from the prior: their decay shows
    for out in rounds:
        each.propose(0, None, None)  # asked for nothing: every round's bookkeeping at once
        each.accept(out)
        queued.accept(out)
    assert each.backlog == [] and len(queued.backlog) == len(rounds)
    queued.propose(0, None, None)
    assert (each.accepted, each.reached) == (queued.accepted, queued.reached) and each.accepted != [0.0, 0.0]
    assert each.index.tokens == queued.index.tokens and each.index.last == queued.index.last
    assert torch.equal(each.propose(4, None, None)[0], queued.propose(4, None, None)[0])


def test_the_batched_lookup_queues_what_it_was_not_asked_for() -> None:
    """`NgramProposer`: a sequence at k 0 gets no guess and its tokens wait; asked again, the lookup has them all."""

    class S:
        uid, warp, gen, seen = 7, None, None, None
        last = torch.tensor([4])

    ng = NgramProposer(64, 2, 3, 0.0)
    s = cast(Seq, S())
    ng.start([s], [torch.tensor([5, 1, 2])], [torch.empty(0)])
    for out in ([7, 9], [1, 2]):
        assert ng.propose([s], [0])[0][0].shape[0] == 0
        ng.accept(s, 0, torch.tensor(out), torch.empty(0))
    assert ng.each[7].index.tokens == [5, 1, 2, 4] and len(ng.each[7].backlog) == 2
    assert ng.propose([s], [2])[0][0].tolist() == [4, 7]  # "1 2" was followed by 4 7
    assert ng.each[7].index.tokens == [5, 1, 2, 4, 7, 9, 1, 2] and ng.each[7].backlog == []


def test_the_default_proposer_depends_on_the_mode(family) -> None:
    """No --proposer: the n-gram lookup backed by MTP when greedy, MTP alone when sampling."""
    import json

    from typer.testing import CliRunner

    from smallem_cli.cli.app import app

    base = ["generate", "--target", str(family.target), "-n", "12", "--json", "-q", "And"]
    greedy = json.loads(CliRunner().invoke(app, base).stdout)
    sampled = json.loads(CliRunner().invoke(app, [*base, "--temperature", "0.7"]).stdout)
    assert greedy["stats"]["proposer"] == "ngram+mtp" and sampled["stats"]["proposer"] == "mtp"
    alone = json.loads(CliRunner().invoke(app, [*base, "--proposer", "none"]).stdout)
    assert greedy["tokens"] == alone["tokens"]
