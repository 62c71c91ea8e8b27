"""The model-free n-gram proposer, the n-gram backed by a model, and adaptive depth (p-min).

Each changes how many guesses a round checks, never what the user gets: greedy output
identical to the target alone, and sampling exact with a point-mass q (the seed's χ² test).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import MAX_LEN, PROMPT
from test_verify import P1, P2, check_exact

from smallem_cli import defaults as D
from smallem_cli.engine.generate import generate
from smallem_cli.spec.ngram import Fallback, NgramIndex, NgramProposer, best_depth
from smallem_cli.spec.proposers import DraftProposer, MTPProposer, NoProposer
from smallem_cli.spec.sampling import Sampling
from smallem_cli.stats import Stats

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
    assert index([5, 1, 2, 7, 1, 2, 9, 5, 1, 2]).lookup(2) == [7, 1]
    assert index([3, 1, 2, 7, 1, 2, 9, 5, 1, 2]).lookup(2) == [9, 5]  # no 3-gram: the latest 2-gram
    assert index([1, 2, 3, 4]).lookup(3) == []  # nothing repeats
    assert index([4, 8, 4], lo=2).lookup(3) == []  # a 1-gram match is below min_n


def test_lookup_never_matches_the_suffix_itself_and_copies_past_the_end() -> None:
    assert index([7]).lookup(4) == []
    # [7, 8] last occurred at 0..1: what followed is 7, 8, then the copy of the copy
    assert index([7, 8, 7, 8]).lookup(5) == [7, 8, 7, 8, 7]
    assert index([9, 9]).lookup(3) == [9, 9, 9]


def test_index_grows_incrementally_like_built_at_once() -> None:
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 6, (300,), generator=g).tolist()
    whole, parts = index(toks, 2, 4), NgramIndex(2, 4)
    for i in range(0, 300, 7):
        parts.extend(toks[i : i + 7])
    assert whole.last == parts.last and whole.lookup(5) == parts.lookup(5) != []


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        NgramIndex(3, 2)
    with pytest.raises(ValueError):
        NgramIndex(0, 2)


def check_rounds(stats: Stats, out: list[int], k: int) -> None:
    rounds = stats.passes - 1
    assert sum(stats.guessed) == rounds
    assert stats.proposed == sum(m * r for m, r in enumerate(stats.guessed))
    assert stats.accepted <= stats.proposed and stats.new_tokens == len(out)
    assert sum(stats.accepted_at) == stats.accepted


def proposers(kind: str, models: dict, p_min: float = 0.0):
    V = models["target"].cfg.vocab_size
    if kind == "ngram":
        return NgramProposer(V, D.NGRAM_MIN, D.NGRAM_MAX)
    if kind == "ngram-adaptive":
        return NgramProposer(V, D.NGRAM_MIN, D.NGRAM_MAX, D.NGRAM_GUESS_COST)
    if kind == "ngram+mtp":
        return Fallback(NgramProposer(V, 2, 3), MTPProposer(models["target"], models["mtp"], MAX_LEN))
    if kind == "ngram+draft":
        return Fallback(NgramProposer(V, 2, 3), DraftProposer(models["draft"], MAX_LEN))
    if kind == "mtp":
        return MTPProposer(models["target"], models["mtp"], MAX_LEN, p_min=p_min)
    return DraftProposer(models[kind], MAX_LEN, p_min=p_min)


@pytest.fixture(scope="module")
def models(target, draft, near_draft, mtp) -> dict:
    return {"target": target, "draft": draft, "near": near_draft, "mtp": mtp}


@pytest.mark.parametrize("prompt", [PROMPT, REPEAT], ids=["plain", "repeating"])
@pytest.mark.parametrize("kind", ["ngram", "ngram-adaptive", "ngram+mtp", "ngram+draft"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_ngram_greedy_identity(models, prompt: list[int], kind: str, k: int) -> None:
    ref, _ = generate(models["target"], NoProposer(), prompt, N, 0)
    out, stats = generate(models["target"], proposers(kind, models), prompt, N, k)
    assert out == ref
    check_rounds(stats, out, k)
    if kind.startswith("ngram") and "+" not in kind:
        assert stats.guessed[0] > 0  # some rounds found nothing and checked no guess
    assert stats.proposed > 0


def test_ngram_copies_a_repeating_text(models) -> None:
    """Where the target repeats itself, the lookup guesses it: several tokens a pass."""
    target = models["target"]
    ref, _ = generate(target, NoProposer(), PROMPT, 200, 0)
    tail = ref[-60:]  # the random model's own text, which repeats phrases of itself
    _, stats = generate(target, NgramProposer(target.cfg.vocab_size, 2, 4), tail, 100, 4)
    assert stats.accepted_at[3] > 0 and stats.tokens_per_pass > 1.4, stats


@pytest.mark.parametrize("kind", ["mtp", "near", "draft"])
@pytest.mark.parametrize("p_min", [0.3, 0.9])
def test_adaptive_depth_greedy_identity(models, kind: str, p_min: float) -> None:
    ref, _ = generate(models["target"], NoProposer(), PROMPT, N, 0)
    out, stats = generate(models["target"], proposers(kind, models, p_min), PROMPT, N, 4)
    assert out == ref
    check_rounds(stats, out, 4)
    assert sum(stats.guessed[:4]) > 0  # some rounds stopped early


def test_adaptive_depth_zero_is_the_fixed_chain(models) -> None:
    _, st = generate(models["target"], proposers("mtp", models, 0.0), PROMPT, N, 3)
    assert st.guessed[:3] == [0, 0, 0] and st.guessed[3] == st.passes - 1


def test_adaptive_depth_cuts_guesses_it_doubts(models) -> None:
    """A higher p-min checks fewer guesses, and keeps a larger share of them."""
    _, lo = generate(models["target"], proposers("draft", models, 0.2), PROMPT, N, 4)
    _, hi = generate(models["target"], proposers("draft", models, 0.8), PROMPT, N, 4)
    assert hi.proposed / (hi.passes - 1) < lo.proposed / (lo.passes - 1)
    assert hi.acceptance_rate >= lo.acceptance_rate


@pytest.mark.parametrize("kind", ["ngram", "ngram-adaptive", "ngram+mtp", "mtp"])
def test_sampling_is_seeded(models, kind: str) -> None:
    s = Sampling(temperature=1.0, seed=5)
    p_min = 0.3 if kind == "mtp" else 0.0
    a, _ = generate(models["target"], proposers(kind, models, p_min), REPEAT, 60, 4, s)
    b, _ = generate(models["target"], proposers(kind, models, p_min), REPEAT, 60, 4, s)
    assert a == b and len(a) == 60


def test_point_mass_guesses_sample_exactly() -> None:
    """The n-gram's guesses are point masses (q one-hot): the seed's χ² test on pairs passes
    against the target and fails against the proposer's (point-mass) law."""
    V = P1.shape[0]
    q1 = F.one_hot(torch.tensor(2), V).float()
    q2 = F.one_hot(torch.tensor([1, 3, 0, 4, 2]), V).float()  # the token guessed after each token
    chi_p, chi_q = check_exact(P1, P2, q1, q2, seed=7)
    print(f"point mass: chi2 vs target {chi_p:.1f}, vs proposer {chi_q:.1f}")


def test_ngram_sampled_q_is_one_hot(models) -> None:
    p = NgramProposer(64, 2, 3)
    p.start(torch.tensor([5, 6, 7, 5, 6]), torch.tensor([7]), torch.empty(0))
    toks, q = p.propose(3, lambda x: x, None)
    assert toks.tolist() == [5, 6, 7] and q is not None
    assert torch.equal(q, F.one_hot(toks, 64).float())
    toks, q = p.propose(3, None, None)
    assert q is None


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
    p = NgramProposer(64, 2, 3, guess_cost=0.16)
    p.start(torch.tensor([1, 2, 3, 1, 2]), torch.tensor([3]), torch.empty(0))
    for i in range(12):  # the lookup says what followed "1 2 3" last time; the target, a new token
        p.propose(4, None, None)
        p.accept(0, torch.tensor([10 + i]), torch.empty(0))
        p.index.extend([1, 2, 3])  # a lookup every round
    toks, _ = p.propose(4, None, None)
    assert toks.shape[0] == 0 and p.rates[0] < 0.2
    for _ in range(6):  # now the lookup would have been right, offered or not
        looked = p.index.lookup(4)
        p.propose(4, None, None)
        p.accept(0, torch.tensor(looked[:1]), torch.empty(0))
    toks, _ = p.propose(4, None, None)
    assert toks.shape[0] >= 1 and p.rates[0] > 0.5


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
