"""Tests for smallem_cli.spec.verify: greedy and sampled verification, warp, sample.

The sampling tests are statistical but seeded, so they are deterministic. The exactness
test simulates 200,000 two-token generations at once and compares the joint distribution
of (t1, t2) with the target's by Pearson's chi-square.
"""

from __future__ import annotations

import pytest
import torch

from smallem_cli.spec import verify
from smallem_cli.spec.verify import Warper, penalize, proposal, sample, verify_greedy, verify_sample, warp


def greedy_rows(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's greedy rule (`verify_greedy`) on each row: drafts long [B, k], target_logits [B, k+1, V]
    -> (n [B], out [B, k+1]): the target's argmaxes, of which a round emits out[:, :n+1] (the rest to ignore)."""
    best = target_logits.argmax(dim=-1)  # [B, k+1]
    n = [verify_greedy(d, b) for d, b in zip(drafts.tolist(), best.tolist(), strict=True)]
    return torch.tensor(n, dtype=torch.long), best


# Pearson chi-square critical values at the 0.1% level, by degrees of freedom.
CHI2_CRIT = {
    1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12,
    9: 27.88, 10: 29.59, 11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70, 16: 39.25,
    17: 40.79, 18: 42.31, 19: 43.82, 20: 45.31, 21: 46.80, 22: 48.27, 23: 49.73, 24: 51.18,
}  # fmt: skip

# A two-token target: p(t1) and p(t2 | t1), the second token depending on the first.
P1 = torch.tensor([0.30, 0.05, 0.25, 0.15, 0.25])
P2 = torch.tensor(
    [
        [0.60, 0.10, 0.10, 0.10, 0.10],
        [0.05, 0.05, 0.70, 0.10, 0.10],
        [0.20, 0.20, 0.20, 0.20, 0.20],
        [0.10, 0.40, 0.05, 0.05, 0.40],
        [0.02, 0.08, 0.15, 0.50, 0.25],
    ]
)
# A proposer that disagrees: mass where the target has little and none where it has some.
Q1 = torch.tensor([0.05, 0.50, 0.00, 0.30, 0.15])
Q2 = torch.tensor(
    [
        [0.05, 0.40, 0.40, 0.10, 0.05],
        [0.30, 0.30, 0.00, 0.20, 0.20],
        [0.70, 0.10, 0.10, 0.05, 0.05],
        [0.20, 0.00, 0.40, 0.40, 0.00],
        [0.40, 0.30, 0.10, 0.00, 0.20],
    ]
)


def chi_square(observed: torch.Tensor, expected: torch.Tensor) -> tuple[float, int, int]:
    """Pearson's statistic and degrees of freedom over the cells with expected > 0, and the
    number of observations that fell in cells of expected count 0 (impossible outcomes)."""
    observed, expected = observed.double().flatten(), expected.double().flatten()
    live = expected > 0
    stat = ((observed[live] - expected[live]) ** 2 / expected[live]).sum()
    return float(stat), int(live.sum()) - 1, int(observed[~live].sum())


def simulate_pairs(p1, p2, q1, q2, n_pairs: int, seed: int) -> torch.Tensor:
    """Generate n_pairs (t1, t2) by speculative sampling; return counts [V, V].

    Round 1: the proposer drafts d1 ~ q1, d2 ~ q2[d1] (k = 2); the target scores p1, p2[d1]
    and a bonus distribution p2[d2]. If d1 was accepted, t1 = d1 and t2 = out[:, 1]; if
    not, t1 = out[:, 0] and a second round (k = 1, context t1) gives t2. Rows are
    independent, so both rounds run for all rows and t2 picks from the right one.
    """
    g = torch.Generator().manual_seed(seed)
    V = p1.shape[0]
    B = n_pairs
    q_first = q1.expand(B, V)
    d1 = sample(q_first, g)
    d2 = sample(q2[d1], g)
    drafts = torch.stack([d1, d2], dim=1)  # [B, 2]
    q = torch.stack([q_first, q2[d1]], dim=1)  # [B, 2, V]
    p = torch.stack([p1.expand(B, V), p2[d1], p2[d2]], dim=1)  # [B, 3, V]
    n, out = verify_sample(drafts, q, p, g)
    t1 = out[:, 0]
    assert torch.equal(t1[n >= 1], d1[n >= 1])

    d = sample(q2[t1], g)
    uniform = torch.full((B, V), 1.0 / V)
    _, out2 = verify_sample(d.unsqueeze(1), q2[t1].unsqueeze(1), torch.stack([p2[t1], uniform], dim=1), g)
    t2 = torch.where(n >= 1, out[:, 1], out2[:, 0])
    return torch.bincount(t1 * V + t2, minlength=V * V).view(V, V)


def check_exact(p1, p2, q1, q2, seed: int) -> tuple[float, float]:
    """Chi-square of simulated pairs against the target (must pass) and the proposer (must fail)."""
    N = 200_000
    counts = simulate_pairs(p1, p2, q1, q2, N, seed)
    assert int(counts.sum()) == N
    chi_p, df, impossible = chi_square(counts, N * p1[:, None] * p2)
    assert impossible == 0  # never a pair the target cannot produce
    assert chi_p < CHI2_CRIT[df], (chi_p, df)
    chi_q, _, _ = chi_square(counts, N * q1[:, None] * q2)  # over the proposer's possible pairs only
    assert chi_q > 1000, chi_q
    return chi_p, chi_q


# ---------------------------------------------------------------------------- greedy


def test_verify_greedy_batched_outcomes():
    V, k = 6, 3
    # Row r's target argmax at the k+1 positions.
    best = torch.tensor([[1, 2, 3, 4], [5, 0, 1, 2], [2, 2, 4, 0]])
    logits = torch.randn(3, k + 1, V, generator=torch.Generator().manual_seed(0))
    logits.scatter_(-1, best.unsqueeze(-1), 10.0)
    drafts = torch.tensor(
        [
            [1, 2, 3],  # all accepted: out = drafts + bonus 4
            [4, 0, 1],  # first rejected: correction 5
            [2, 2, 0],  # two accepted, then correction 4
        ]
    )
    n, out = greedy_rows(drafts, logits)
    assert n.tolist() == [3, 0, 2]
    assert out.shape == (3, k + 1)
    assert out[0].tolist() == [1, 2, 3, 4]
    assert out[1, :1].tolist() == [5]
    assert out[2, :3].tolist() == [2, 2, 4]
    for r in range(3):
        m = int(n[r])
        assert torch.equal(out[r, :m], drafts[r, :m])
        assert int(out[r, m]) == int(best[r, m])


def test_verify_greedy_later_match_does_not_count():
    logits = torch.zeros(1, 4, 5)
    logits[0, torch.arange(4), torch.tensor([3, 1, 2, 0])] = 1.0
    n, out = greedy_rows(torch.tensor([[3, 4, 2]]), logits)  # position 2 matches but 1 does not
    assert n.tolist() == [1]
    assert out[0, :2].tolist() == [3, 1]


# ------------------------------------------------------------------- sampled: exactness


def test_verify_sample_exact_chi_square():
    chi_p, chi_q = check_exact(P1, P2, Q1, Q2, seed=1234)
    print(f"plain: chi2 vs target {chi_p:.1f}, vs proposer {chi_q:.1f}")


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(0.7, None, None), (1.0, 3, None), (1.3, 4, 0.8)],
)
def test_verify_sample_exact_chi_square_warped(temperature, top_k, top_p):
    lp1, lp2 = P1.log(), P2.log()
    lq1 = torch.tensor([0.05, 0.50, 0.01, 0.30, 0.15]).log()
    lq2 = (Q2 + 0.01).log()
    w = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    p1, p2, q1, q2 = warp(lp1, **w), warp(lp2, **w), warp(lq1, **w), warp(lq2, **w)
    if top_k is not None:
        assert torch.all((p2 > 0).sum(-1) <= top_k)
    chi_p, chi_q = check_exact(p1, p2, q1, q2, seed=99)
    print(f"T={temperature} top_k={top_k} top_p={top_p}: chi2 vs target {chi_p:.1f}, vs proposer {chi_q:.1f}")


@pytest.mark.parametrize("temperature, top_k, min_p", [(1.0, None, 0.3), (1.4, 4, 0.2)])
def test_verify_sample_exact_chi_square_min_p(temperature, top_k, min_p):
    """The target warped with min-p, the proposer without: the output is the min-p target's."""
    lp1, lp2 = P1.log(), P2.log()
    lq1 = torch.tensor([0.05, 0.50, 0.01, 0.30, 0.15]).log()
    lq2 = (Q2 + 0.01).log()
    p1, p2 = warp(lp1, temperature, top_k, min_p=min_p), warp(lp2, temperature, top_k, min_p=min_p)
    # min-p drops tokens the plain warp keeps: a real filter, and the top token always stays
    assert int((p2 == 0).sum()) > int((warp(lp2, temperature, top_k) == 0).sum())
    assert torch.all(p2.gather(-1, lp2.argmax(-1, keepdim=True)) > 0)
    q1, q2 = warp(lq1, temperature), warp(lq2, temperature)
    chi_p, chi_q = check_exact(p1, p2, q1, q2, seed=31)
    print(f"T={temperature} top_k={top_k} min_p={min_p}: chi2 vs target {chi_p:.1f}, vs proposer {chi_q:.1f}")


def penalized_ref(logits: torch.Tensor, context: set[int], penalty: float) -> torch.Tensor:
    """The repetition penalty one position at a time, as the target alone applies it: logits [V]."""
    out = logits.clone()
    for t in context:
        out[t] = out[t] / penalty if out[t] > 0 else out[t] * penalty
    return out


# Logits shifted so that some are positive and some negative: the penalty divides the first, multiplies the second.
L1 = P1.log() + 1.2
L2 = P2.log() + 1.2
PROMPT_SEEN = {2}  # the context before the pass: token 2 in the prompt...
LAST = 0  # ...and `last`, the token the pass starts from


def penalized_target(penalty: float, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The target alone with the penalty: p(t1) [V] and p(t2 | t1) [V, V], the context growing by t1."""
    ctx = PROMPT_SEEN | {LAST}
    p1 = warp(penalized_ref(L1, ctx, penalty), temperature)
    p2 = torch.stack([warp(penalized_ref(L2[t], ctx | {t}, penalty), temperature) for t in range(5)])
    return p1, p2


def simulate_pairs_penalized(penalty: float, temperature: float, q1, q2, n_pairs: int, seed: int) -> torch.Tensor:
    """`simulate_pairs` with the target's rows penalized by `penalize` over the pass [last, d1, d2]: counts [V, V]."""
    g = torch.Generator().manual_seed(seed)
    V, B = 5, n_pairs
    seen = torch.zeros(B, V, dtype=torch.bool)
    seen[:, list(PROMPT_SEEN)] = True
    last = torch.full((B,), LAST)
    d1 = sample(q1.expand(B, V), g)
    d2 = sample(q2[d1], g)
    drafts = torch.stack([d1, d2], dim=1)  # [B, 2]
    q = torch.stack([q1.expand(B, V), q2[d1]], dim=1)  # [B, 2, V]
    # the bonus row (after d2) is never counted: any logits do
    raw = torch.stack([L1.expand(B, V), L2[d1], L2[d2]], dim=1)  # [B, 3, V]
    fed = torch.stack([last, d1, d2], dim=1)  # [B, 3]
    p = warp(penalize(raw, seen, fed, penalty), temperature)
    n, out = verify_sample(drafts, q, p, g)
    t1 = out[:, 0]
    # second round, where d1 was rejected: a pass over [t1], with `last` now in the context
    seen2 = seen.clone()
    seen2[torch.arange(B), last] = True
    d = sample(q2[t1], g)
    raw2 = torch.stack([L2[t1], torch.zeros(B, V)], dim=1)  # [B, 2, V]
    p_2 = warp(penalize(raw2, seen2, torch.stack([t1, d], dim=1), penalty), temperature)
    _, out2 = verify_sample(d.unsqueeze(1), q2[t1].unsqueeze(1), p_2, g)
    t2 = torch.where(n >= 1, out[:, 1], out2[:, 0])
    return torch.bincount(t1 * V + t2, minlength=V * V).view(V, V)


@pytest.mark.parametrize("penalty, temperature", [(1.8, 1.0), (0.6, 0.8)])
def test_verify_sample_exact_chi_square_repetition_penalty(penalty, temperature):
    """With a repetition penalty on the target's rows (a context growing along the pass), the output
    pairs are the penalized target alone's; the proposer guesses without the penalty."""
    N = 200_000
    p1, p2 = penalized_target(penalty, temperature)
    q1 = warp(torch.tensor([0.05, 0.50, 0.01, 0.30, 0.15]).log(), temperature)
    q2 = warp((Q2 + 0.01).log(), temperature)
    counts = simulate_pairs_penalized(penalty, temperature, q1, q2, N, seed=17)
    assert int(counts.sum()) == N
    chi_p, df, impossible = chi_square(counts, N * p1[:, None] * p2)
    assert impossible == 0
    assert chi_p < CHI2_CRIT[df], (chi_p, df)
    # negative controls: the proposer; the target without the penalty; and a penalty whose
    # context ignores the pass (t1 not counted for t2): all far off
    chi_q, _, _ = chi_square(counts, N * q1[:, None] * q2)
    plain = chi_square(counts, N * warp(L1, temperature)[:, None] * warp(L2, temperature))[0]
    ctx = PROMPT_SEEN | {LAST}
    stale2 = torch.stack([warp(penalized_ref(L2[t], ctx, penalty), temperature) for t in range(5)])
    stale = chi_square(counts, N * p1[:, None] * stale2)[0]
    assert chi_q > 1000 and plain > 1000 and stale > 100, (chi_q, plain, stale)
    print(f"penalty={penalty}: chi2 vs target {chi_p:.1f}, proposer {chi_q:.1f}, plain {plain:.1f}, stale {stale:.1f}")


# ------------------------------------------------------------------ sampled: edge cases


def test_verify_sample_identical_distributions_accept_all_and_bonus_from_target():
    # q == p at the drafted positions: every draft is accepted, the bonus comes from p_k alone.
    B, k, V = 20_000, 2, 5
    g = torch.Generator().manual_seed(5)
    a = torch.tensor([0.1, 0.2, 0.3, 0.2, 0.2])
    s = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.1])
    r = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3])  # bonus distribution, not to be mixed with s
    q = torch.stack([a, s]).expand(B, k, V)
    drafts = sample(q, g)
    n, out = verify_sample(drafts, q, torch.stack([a, s, r]).expand(B, k + 1, V), g)
    assert torch.all(n == k)
    assert torch.equal(out[:, :k], drafts)
    chi, df, impossible = chi_square(torch.bincount(out[:, k], minlength=V), B * r)
    assert impossible == 0 and chi < CHI2_CRIT[df], chi


def test_verify_sample_rejects_zero_target_and_corrects():
    # The target gives the draft probability 0: always rejected, correction from the residual.
    B, V = 1000, 4
    g = torch.Generator().manual_seed(6)
    q = torch.tensor([0.1, 0.1, 0.7, 0.1]).expand(B, 1, V)
    p = torch.tensor([[0.4, 0.0, 0.0, 0.6], [0.25, 0.25, 0.25, 0.25]]).expand(B, 2, V)
    n, out = verify_sample(torch.full((B, 1), 2), q, p, g)
    assert torch.all(n == 0)
    assert set(out[:, 0].tolist()) == {0, 3}  # residual (0.3, 0, 0, 0.5): never 1 or 2


def test_verify_sample_zero_residual_falls_back_to_target():
    # q dominates p everywhere (only possible through rounding for real distributions).
    B, V = 500, 3
    g = torch.Generator().manual_seed(7)
    q = torch.tensor([0.5, 0.5, 0.5]).expand(B, 1, V)
    p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]).expand(B, 2, V)
    n, out = verify_sample(torch.full((B, 1), 2), q, p, g)
    assert torch.all(n == 0)
    assert set(out[:, 0].tolist()) == {0, 1}


def test_verify_sample_layout_and_leading_accepts():
    B, k, V = 4096, 3, 5
    g = torch.Generator().manual_seed(8)
    q = torch.softmax(torch.randn(B, k, V, generator=g), dim=-1)
    p = torch.softmax(torch.randn(B, k + 1, V, generator=g), dim=-1)
    drafts = sample(q, g)
    n, out = verify_sample(drafts, q, p, g)
    assert n.dtype == torch.long and out.dtype == torch.long and out.shape == (B, k + 1)
    assert int(n.min()) >= 0 and int(n.max()) <= k
    assert set(n.tolist()) == {0, 1, 2, 3}
    pos = torch.arange(k)
    accepted = pos < n[:, None]  # [B, k]
    assert torch.equal(out[:, :k][accepted], drafts[accepted])
    # The token at position n has positive target probability there.
    p_n = p[torch.arange(B), n]  # [B, V]
    assert torch.all(p_n.gather(1, out.gather(1, n[:, None])) > 0)


# ---------------------------------------------------------------------------- warp


def test_warp_temperature_matches_softmax():
    logits = torch.randn(3, 4, 11, generator=torch.Generator().manual_seed(1)) * 3
    for t in (0.3, 1.0, 2.5):
        probs = warp(logits, t)
        assert probs.dtype == torch.float32 and probs.shape == logits.shape
        torch.testing.assert_close(probs, torch.softmax(logits / t, dim=-1))
        torch.testing.assert_close(probs.sum(-1), torch.ones(3, 4))
    torch.testing.assert_close(warp(logits.double(), 1.0), torch.softmax(logits, -1))


@pytest.mark.parametrize("t", [0.0, -1.0])
def test_warp_rejects_non_positive_temperature(t):
    with pytest.raises(ValueError):
        warp(torch.zeros(3), t)


def test_warp_top_k_keeps_k_largest():
    logits = torch.randn(50, 20, generator=torch.Generator().manual_seed(2))
    for k in (1, 3, 7):
        probs = warp(logits, 0.9, top_k=k)
        assert torch.all((probs > 0).sum(-1) == k)
        kept = torch.topk(logits, k, dim=-1).indices
        assert torch.all(probs.gather(-1, kept) > 0)
        torch.testing.assert_close(probs.sum(-1), torch.ones(50))
        ref = torch.softmax(logits.gather(-1, kept) / 0.9, dim=-1)
        torch.testing.assert_close(probs.gather(-1, kept), ref)
    torch.testing.assert_close(warp(logits, 1.0, top_k=20), torch.softmax(logits, -1))
    torch.testing.assert_close(warp(logits, 1.0, top_k=100), torch.softmax(logits, -1))


def test_warp_top_p_nucleus_hand_example():
    # Vocabulary order is shuffled so the nucleus must be mapped back from sorted order.
    base = torch.tensor([0.05, 0.30, 0.15, 0.50])
    logits = torch.stack([base.log(), base.flip(0).log()])  # [2, 4]
    keep2 = torch.tensor([0.0, 0.375, 0.0, 0.625])
    torch.testing.assert_close(warp(logits, 1.0, top_p=0.75), torch.stack([keep2, keep2.flip(0)]))
    keep3 = torch.tensor([0.0, 0.30, 0.15, 0.50]) / 0.95
    torch.testing.assert_close(warp(logits, 1.0, top_p=0.9), torch.stack([keep3, keep3.flip(0)]))
    top1 = torch.tensor([0.0, 0.0, 0.0, 1.0])
    torch.testing.assert_close(warp(logits, 1.0, top_p=0.3), torch.stack([top1, top1.flip(0)]))
    torch.testing.assert_close(warp(logits, 1.0, top_p=1e-9), torch.stack([top1, top1.flip(0)]))
    torch.testing.assert_close(warp(logits, 1.0, top_p=1.0), torch.softmax(logits, -1))
    # Exactly at the boundary: the top token alone reaches top_p, so nothing else is kept.
    edge = torch.tensor([0.3, 2.0, 1.0, -1.0])
    top_p = float(warp(edge, 1.0).max())
    torch.testing.assert_close(warp(edge, 1.0, top_p=top_p), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    # top-k first, then top-p over the renormalised survivors: (0.375, 0.625) -> only 0.625 >= 0.6
    torch.testing.assert_close(warp(logits[:1], 1.0, top_k=2, top_p=0.6), top1[None])


def test_warp_min_p_hand_example():
    probs = torch.tensor([0.05, 0.30, 0.15, 0.50])
    logits = torch.stack([probs.log(), probs.flip(0).log()])  # [2, 4]
    # min_p 0.35: the threshold is 0.175, so 0.30 and 0.50 stay
    keep = torch.tensor([0.0, 0.375, 0.0, 0.625])
    torch.testing.assert_close(warp(logits, 1.0, min_p=0.35), torch.stack([keep, keep.flip(0)]))
    keep3 = torch.tensor([0.0, 0.30, 0.15, 0.50]) / 0.95  # threshold 0.1: only 0.05 is below it
    torch.testing.assert_close(warp(logits[:1], 1.0, min_p=0.2), keep3[None])
    torch.testing.assert_close(warp(logits, 1.0, min_p=0.0), torch.softmax(logits, -1))
    torch.testing.assert_close(warp(logits, 1.0, min_p=None), torch.softmax(logits, -1))
    top1 = torch.tensor([0.0, 0.0, 0.0, 1.0])
    torch.testing.assert_close(warp(logits[:1], 1.0, min_p=0.99), top1[None])  # the top token always stays
    # after temperature: a higher temperature flattens the distribution and keeps more tokens
    assert int((warp(logits, 3.0, min_p=0.35) > 0).sum()) > int((warp(logits, 1.0, min_p=0.35) > 0).sum())
    # a ratio to the top: after top-k (renormalised) the same tokens pass
    torch.testing.assert_close(warp(logits, 1.0, top_k=3, min_p=0.35), torch.stack([keep, keep.flip(0)]))
    with pytest.raises(ValueError):
        warp(logits, 1.0, min_p=1.5)
    w = Warper(1.0, min_p=0.35)
    torch.testing.assert_close(w(logits), warp(logits, 1.0, min_p=0.35))


def test_penalize_cumulative_mask():
    """Row i counts the context before the pass and the pass's tokens fed[:i+1], no later one."""
    V, T = 7, 5
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(T, V, generator=g) * 3  # positive and negative
    seen = torch.zeros(V, dtype=torch.bool)
    seen[[1, 4]] = True
    fed = torch.tensor([2, 5, 2, 6, 0])
    got = penalize(logits, seen, fed, 1.5)
    for i in range(T):
        ctx = {1, 4} | set(fed[: i + 1].tolist())
        torch.testing.assert_close(got[i], penalized_ref(logits[i], ctx, 1.5))
        untouched = [v for v in range(V) if v not in ctx]
        assert torch.equal(got[i, untouched], logits[i, untouched])
    # by hand: row 0 holds 1, 4 and 2; 5 joins at row 1, 6 at row 3, 0 at row 4
    x = torch.tensor([[2.0, -3.0, 3.0, 1.0, -1.0, 6.0, 0.0]]).expand(T, V)
    y = penalize(x, seen, fed, 2.0)
    assert y[0].tolist() == [2.0, -6.0, 1.5, 1.0, -2.0, 6.0, 0.0]
    assert y[1].tolist() == [2.0, -6.0, 1.5, 1.0, -2.0, 3.0, 0.0]
    assert y[4].tolist() == [1.0, -6.0, 1.5, 1.0, -2.0, 3.0, 0.0]
    # a penalty below 1 favours repeats; 1 changes nothing (and returns the logits as they are)
    assert penalize(x, seen, fed, 0.5)[0, 1] == -1.5 and penalize(x, seen, fed, 0.5)[0, 2] == 6.0
    assert penalize(x, seen, fed, 1.0) is x
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            penalize(x, seen, fed, bad)


def test_penalize_batched_rows_are_independent():
    B, T, V = 3, 4, 9
    g = torch.Generator().manual_seed(22)
    logits = torch.randn(B, T, V, generator=g)
    seen = torch.rand(B, V, generator=g) < 0.3
    fed = torch.randint(0, V, (B, T), generator=g)
    got = penalize(logits, seen, fed, 1.3)
    for b in range(B):
        torch.testing.assert_close(got[b], penalize(logits[b], seen[b], fed[b], 1.3))
    assert got.dtype == logits.dtype
    half = penalize(logits.half(), seen, fed, 1.3)
    assert half.dtype == torch.float16


# ---------------------------------------------------------------------------- sample


def test_sample_frequencies_and_zero_probability():
    probs = torch.tensor([0.5, 0.2, 0.0, 0.25, 0.05, 0.0])
    N = 100_000
    draws = sample(probs.expand(N, 6), torch.Generator().manual_seed(3))
    assert draws.shape == (N,) and draws.dtype == torch.long
    counts = torch.bincount(draws, minlength=6)
    chi, df, impossible = chi_square(counts, N * probs)
    assert impossible == 0
    assert chi < CHI2_CRIT[df], chi
    print(f"sample: chi2 {chi:.1f} (df {df})")


def test_sample_shapes_and_one_hot():
    g = torch.Generator().manual_seed(4)
    probs = torch.zeros(2, 3, 9)
    probs[..., 4] = 1.0
    assert torch.all(sample(probs, g) == 4)
    assert sample(torch.softmax(torch.randn(2, 3, 9, generator=g), -1), g).shape == (2, 3)
    assert sample(torch.tensor([0.0, 1e-30, 0.0]), g).item() == 1  # tiny but positive still wins


# ------------------------------------------------------------------------ determinism


def test_same_seed_same_outputs():
    def run(seed: int):
        g = torch.Generator().manual_seed(seed)
        q = torch.softmax(torch.randn(256, 3, 10, generator=g), -1)
        p = torch.softmax(torch.randn(256, 4, 10, generator=g), -1)
        drafts = sample(q, g)
        return (drafts, *verify_sample(drafts, q, p, g))

    a, b, c = run(11), run(11), run(12)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


# --------------------------------------------------------------------- no host syncs


def test_runs_on_meta_device():
    # Meta tensors have no data: .item(), int(), bool() or a branch on a value would raise,
    # so passing here means no host sync anywhere in warp, sample or verify.
    meta = torch.device("meta")
    logits_q, logits_p = torch.randn(8, 3, 100, device=meta), torch.randn(8, 4, 100, device=meta)
    q, p = warp(logits_q, 0.8, top_k=50, top_p=0.9), warp(logits_p, 0.8, top_k=50, top_p=0.9)
    drafts = sample(q, None)
    n, out = verify_sample(drafts, q, p, None)
    assert n.shape == (8,) and out.shape == (8, 4)
    assert out.device == meta and out.dtype == torch.long
    fed = torch.cat([out[:, :1], drafts], dim=1)  # [8, 4]
    pen = penalize(logits_p, torch.zeros(8, 100, dtype=torch.bool, device=meta), fed, 1.3)
    p_m = warp(pen, 0.8, min_p=0.05)
    assert pen.shape == p_m.shape == (8, 4, 100) and p_m.device == meta


# -------------------------------------------------------------------------------- cuda


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_no_host_sync():
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    logits_q = torch.randn(8, 3, 100, device=dev)
    logits_p = torch.randn(8, 4, 100, device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        q = warp(logits_q, 0.8, top_k=50, top_p=0.9)
        p = warp(logits_p, 0.8, top_k=50, top_p=0.9)
        drafts = sample(q, g)
        n, out = verify_sample(drafts, q, p, g)
        seen = torch.zeros(8, 100, dtype=torch.bool, device=dev)
        pen = penalize(logits_p, seen, torch.cat([out[:, :1], drafts], dim=1), 1.3)
        p_m = warp(pen, 0.8, min_p=0.05)
        seen.index_fill_(1, out[0], True)  # the loop's update of the context: no sync either
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (8, 4) and n.device == dev
    assert p_m.shape == (8, 4, 100) and p_m.device == dev


def test_verify_sample_without_guesses_is_a_draw_from_p():
    """No guess (the target alone, an n-gram round without a match): n = 0 and the token is
    `sample`'s draw from p_0 with the same generator; over many draws, p_0's law."""
    p = torch.tensor([[[0.1, 0.6, 0.3], [0.2, 0.2, 0.6]]]).expand(4000, 2, 3)[:, :1]  # [B, 1, V]
    drafts = torch.zeros(4000, 0, dtype=torch.long)
    n, out = verify_sample(drafts, torch.zeros(4000, 0, 3), p, torch.Generator().manual_seed(5))
    assert n.tolist() == [0] * 4000 and out.shape == (4000, 1)
    assert torch.equal(out[:, 0], sample(p[:, 0], torch.Generator().manual_seed(5)))
    freq = torch.bincount(out[:, 0], minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.1, 0.6, 0.3]), atol=0.03), freq


def test_top_p_among_the_most_probable_is_the_full_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU top-p first looks among the most probable tokens (`TOP_P_HEADS`): it keeps what
    sorting the whole row keeps, bit for bit, whether the first look holds the mass, the second,
    or neither (the sort then)."""
    g = torch.Generator().manual_seed(0)
    heads = verify.TOP_P_HEADS
    tiers = set()
    for t in range(48):
        p = torch.softmax(torch.randn(1 + t % 3, 8192, generator=g) * (0.3, 1.0, 3.0, 8.0)[t % 4], dim=-1)
        for top_p in (1e-9, 0.5, 0.9, 0.99):
            mass = [p.topk(h, dim=-1).values.sum(-1).min().item() for h in heads]
            tiers.add(next((i for i, m in enumerate(mass) if m >= top_p), len(heads)))
            fast = verify._nucleus(p, top_p)
            monkeypatch.setattr(verify, "TOP_P_HEADS", ())
            full = verify._nucleus(p, top_p)
            monkeypatch.setattr(verify, "TOP_P_HEADS", heads)
            assert torch.equal(fast, full), (t, top_p)
    assert tiers == {0, 1, 2}  # every way through was taken


def test_proposals_are_drawn_at_the_temperature_alone() -> None:
    """Top-k, top-p and min-p shape the target's p; a proposer draws at the temperature alone."""
    assert proposal(Warper(0.7, top_k=5, top_p=0.9, min_p=0.1)) == Warper(0.7)
    assert proposal(Warper(1.3)) == Warper(1.3)
    assert torch.equal(proposal(Warper(1.3, min_p=0.0))(torch.arange(4.0)), Warper(1.3)(torch.arange(4.0)))
