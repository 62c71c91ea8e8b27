"""Tests for smallem_cli.spec.tree: tree masks, greedy and sampled token-tree verification.

The exactness tests reuse the seed's χ² setup (tests/test_verify.py): a two-token target
p(t1) p(t2 | t1) and a proposer q over a vocabulary of 5. A proposer builds a tree of width
2 and depth 2 per row (200,000 rows at once), the target verifies it, and the first two
tokens emitted (completed by a fresh target draw when the round emitted one) must follow
the target's joint law: 25 cells, 24 degrees of freedom, χ² < 51.18 (the 0.1% level).
The same counts against the proposer's law must give χ² > 1000, and deliberately wrong
rules run through the same harness must fail the bound: the test can tell.
"""

from __future__ import annotations

import pytest
import torch
from test_verify import CHI2_CRIT, P1, P2, Q1, Q2, chi_square, greedy_rows
from torch import Tensor

from smallem_cli.spec.tree import (
    TreeVerdict,
    _path,
    _shape,
    _walk,
    tree_depth,
    tree_mask,
    verify_tree_greedy,
    verify_tree_sample,
)
from smallem_cli.spec.verify import sample

# ------------------------------------------------------------- helpers on tree structure


def chain_parents(k: int, device: torch.device | str | None = None) -> Tensor:
    """Parents long [k+1] of a chain root -> guess 1 -> ... -> guess k: [-1, 0, 1, ..., k-1]."""
    return torch.arange(-1, k, device=device)  # [k+1]


def check_tree(parents: Tensor) -> None:
    """Raise ValueError unless parents [..., N] is a tree in topological order (host sync)."""
    N = parents.shape[-1]
    if N < 1:
        raise ValueError("a tree needs its root")
    idx = torch.arange(N, device=parents.device)  # [N]
    if not bool((parents[..., 0] == -1).all()):
        raise ValueError("parents[..., 0] must be -1 (node 0 is the root)")
    if N > 1 and not bool(((parents[..., 1:] >= 0) & (parents[..., 1:] < idx[1:])).all()):
        raise ValueError("every node i >= 1 needs a parent in [0, i): topological order")


def tree_bias(parents: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Additive attention bias [..., N, N] of dtype: 0 where `tree_mask` is True, -inf elsewhere."""
    mask = tree_mask(parents)  # [..., N, N]
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def path_to(node: Tensor, parents: Tensor) -> Tensor:
    """Root path long [B, N] to node [B] in parents [B, N] or [N]: [:, j] is its ancestor at depth j,
    then node repeated."""
    mask = tree_mask(parents)  # [(B,) N, N]
    B, N = node.shape[0], parents.shape[-1]
    on = mask.expand(B, N, N).gather(1, node.view(B, 1, 1).expand(B, 1, N)).squeeze(1)  # [B, N] node, ancestors
    return _path(on, tree_depth(parents, mask), node)


def walk_tree(tokens: Tensor, parents: Tensor, nxt: Tensor, stop: Tensor) -> TreeVerdict:
    """The kept path, given every node's decision (the verifiers' last step, `tree._walk`).

    tokens long [B, N], parents long [B, N] or [N]; nxt long [B, N]: the child node that u
    accepts, or -1; stop long [B, N]: the token u emits when the path ends there (read only
    where nxt == -1). From the root, follow nxt until it is -1.
    """
    return _walk(tokens, parents, _shape(parents), nxt, stop)


# A handmade tree:      0
#                     /   \
#                    1     2
#                   / \    |
#                  3   4   5
#                  |
#                  6
HAND = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
HAND_MASK = torch.tensor(
    [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ],
    dtype=torch.bool,
)
# The χ² tree: width 2, depth 2 (root; its children 1, 2; their children 3, 4 and 5, 6).
W2D2 = torch.tensor([-1, 0, 0, 1, 1, 2, 2])
N_PAIRS = 200_000


def random_parents(B: int, N: int, g: torch.Generator) -> torch.Tensor:
    """B random trees of N nodes in topological order: node i's parent uniform in [0, i)."""
    i = torch.arange(1, N)
    parents = (torch.rand(B, N - 1, generator=g) * i).long()  # [B, N-1]
    return torch.cat([torch.full((B, 1), -1), parents], dim=1)


def logits_for(best: torch.Tensor, V: int, g: torch.Generator) -> torch.Tensor:
    """Random logits [..., V] whose argmax is best [...]."""
    logits = torch.randn(*best.shape, V, generator=g)
    return logits.scatter_(-1, best.unsqueeze(-1), 10.0)


# ---------------------------------------------------------------------- tree structure


def test_mask_depth_bias_path_on_a_handmade_tree():
    check_tree(HAND)
    assert torch.equal(tree_mask(HAND), HAND_MASK)
    assert tree_depth(HAND).tolist() == [0, 1, 1, 2, 2, 2, 3]
    bias = tree_bias(HAND, torch.float16)
    assert bias.dtype == torch.float16 and bias.shape == (7, 7)
    assert torch.all(bias[HAND_MASK] == 0) and torch.all(bias[~HAND_MASK] == float("-inf"))
    # path_to: ancestors by depth, then the node repeated.
    paths = path_to(torch.tensor([6, 5, 0, 4]), HAND)
    assert torch.equal(path_to(torch.tensor([6, 5, 0, 4]), HAND.expand(4, 7)), paths)
    assert paths.tolist() == [
        [0, 1, 3, 6, 6, 6, 6],
        [0, 2, 5, 5, 5, 5, 5],
        [0, 0, 0, 0, 0, 0, 0],
        [0, 1, 4, 4, 4, 4, 4],
    ]


def test_mask_matches_a_parent_walk_on_random_batched_trees():
    g = torch.Generator().manual_seed(0)
    for N in (1, 2, 3, 5, 9, 17, 33):
        parents = random_parents(16, N, g)  # [16, N], a different tree per row
        check_tree(parents)
        mask, depth = tree_mask(parents), tree_depth(parents)
        for b in range(16):
            for i in range(N):
                anc, j = {i}, i
                while j > 0:
                    j = int(parents[b, j])
                    anc.add(j)
                assert set(mask[b, i].nonzero().flatten().tolist()) == anc
                assert int(depth[b, i]) == len(anc) - 1
    assert chain_parents(3).tolist() == [-1, 0, 1, 2]
    assert tree_depth(chain_parents(5)).tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("parents", [[0, 0, 1], [-1, 1, 0], [-1, 0, 3, 1], [-1, -1, 0]])
def test_check_tree_refuses_bad_parents(parents):
    with pytest.raises(ValueError):
        check_tree(torch.tensor(parents))


# ---------------------------------------------------------------------------- greedy


def test_greedy_tree_equals_verify_greedy_on_chains():
    g = torch.Generator().manual_seed(1)
    B, V = 2000, 6
    for k in (1, 2, 4, 7):
        logits = torch.randn(B, k + 1, V, generator=g)
        best = logits.argmax(-1)  # [B, k+1]
        # Drafts agree with the target's argmax, each wrong with probability 0.3.
        wrong = torch.rand(B, k, generator=g) < 0.3
        drafts = torch.where(
            wrong, (best[:, :k] + 1 + (torch.rand(B, k, generator=g) * (V - 1)).long()) % V, best[:, :k]
        )
        n, out = greedy_rows(drafts, logits)
        tokens = torch.cat([torch.full((B, 1), 3), drafts], dim=1)  # [B, k+1] root first
        v = verify_tree_greedy(tokens, chain_parents(k), logits)
        assert isinstance(v, TreeVerdict) and v.out.shape == v.nodes.shape == (B, k + 1)
        assert torch.equal(v.n, n)
        assert set(n.tolist()) == set(range(k + 1))  # every outcome occurs
        valid = torch.arange(k + 1) <= n[:, None]  # [B, k+1]
        assert torch.equal(v.out[valid], out[valid])
        assert torch.equal(v.nodes[valid], torch.arange(k + 1).expand(B, k + 1)[valid])  # a chain keeps its prefix


def test_greedy_tree_picks_the_right_branch():
    V = 10
    g = torch.Generator().manual_seed(2)
    tokens = torch.tensor([9, 4, 7, 1, 2, 4, 8])  # node tokens of HAND; node 0 is the root
    # Target argmax after each node, and the expected (n, out[:n+1], nodes[:n+1]).
    cases = [
        ([7, 0, 4, 0, 0, 5, 0], 2, [7, 4, 5], [0, 2, 5]),  # second child, then its only child, then a correction
        ([4, 2, 0, 8, 0, 0, 6], 2, [4, 2, 0], [0, 1, 4]),  # first child, then its second child
        ([4, 1, 0, 8, 0, 0, 6], 3, [4, 1, 8, 6], [0, 1, 3, 6]),  # the deepest leaf, then a bonus
        ([3, 1, 4, 8, 0, 0, 6], 0, [3], [0]),  # no child matches: correction at the root
        ([4, 5, 0, 0, 0, 0, 0], 1, [4, 5], [0, 1]),
    ]
    for best, n, out, nodes in cases:
        v = verify_tree_greedy(tokens[None], HAND, logits_for(torch.tensor(best), V, g)[None])
        assert int(v.n[0]) == n
        assert v.out[0, : n + 1].tolist() == out
        assert v.nodes[0, : n + 1].tolist() == nodes
        assert torch.all(v.nodes[0, n + 1 :] == nodes[-1])


def test_greedy_tree_batched_rows_with_repeated_siblings():
    V = 10
    g = torch.Generator().manual_seed(3)
    # Rows share HAND; row 1's two root children carry the same token 4: the first is kept.
    tokens = torch.tensor([[9, 4, 7, 1, 2, 4, 8], [9, 4, 4, 1, 2, 5, 8]])
    best = torch.tensor([[4, 1, 0, 8, 0, 0, 6], [4, 1, 5, 8, 0, 0, 6]])
    logits = logits_for(best, V, g)
    v = verify_tree_greedy(tokens, HAND, logits)
    assert v.n.tolist() == [3, 3]
    assert v.nodes.tolist() == [[0, 1, 3, 6, 6, 6, 6]] * 2
    # A shared tree [N] and the same tree per row [B, N] give the same verdict.
    assert all(torch.equal(a, b) for a, b in zip(v, verify_tree_greedy(tokens, HAND.expand(2, 7), logits), strict=True))


def test_sampling_a_one_hot_target_is_greedy():
    # Temperature 0 as a limit: a point-mass target makes the rule the greedy walk.
    g = torch.Generator().manual_seed(4)
    B, N, V = 3000, 12, 5
    parents = random_parents(B, N, g)
    tokens = (torch.rand(B, N, generator=g) * V).long()
    logits = torch.randn(B, N, V, generator=g)
    p = torch.nn.functional.one_hot(logits.argmax(-1), V).float()  # [B, N, V]
    q = torch.softmax(torch.randn(B, N, V, generator=g), -1)
    want, got = verify_tree_greedy(tokens, parents, logits), verify_tree_sample(tokens, parents, p, q, g)
    assert torch.equal(want.n, got.n) and int(want.n.max()) >= 3
    valid = torch.arange(N) <= want.n[:, None]
    assert torch.equal(want.out[valid], got.out[valid]) and torch.equal(want.nodes, got.nodes)


# ------------------------------------------------------------------- sampled: exactness


def build_trees(pick: str, q1, q2, B: int, g: torch.Generator):
    """Width-2, depth-2 trees (W2D2) from the proposer, per row -> tokens [B, 7], p [B, 7, V], q [B, 7, V].

    pick: "gumbel" (two distinct tokens drawn without replacement from q), "iid" (two independent
    draws from q, maybe equal).
    Node u's rows: p = the target after u's path, q = what u's children were drawn from;
    the depth-2 rows only serve a third token, which the test ignores (uniform).
    """
    V = q1.shape[0]

    def two(q):  # q [B, V] -> long [B, 2]
        if pick == "gumbel":
            return (q / torch.empty_like(q).exponential_(generator=g)).topk(2, dim=-1).indices
        return sample(q.unsqueeze(1).expand(B, 2, V), g)

    a = two(q1.expand(B, V))  # [B, 2] children of the root
    b0, b1 = two(q2[a[:, 0]]), two(q2[a[:, 1]])  # [B, 2] each
    tokens = torch.cat([torch.zeros(B, 1, dtype=torch.long), a, b0, b1], dim=1)  # [B, 7]
    uni = torch.full((B, 4, V), 1.0 / V)
    p = torch.cat([P1.expand(B, 1, V), P2[a], uni], dim=1)  # [B, 7, V]
    q = torch.cat([q1.expand(B, 1, V), q2[a], uni], dim=1)  # [B, 7, V]
    return tokens, p, q


def pair_counts(verify, pick: str, q1, q2, seed: int):
    """Counts [V, V] of the first two tokens that verify(tokens, p, q, g) -> TreeVerdict emits,
    the second drawn from the target after t1 when the round emitted only t1; and the share
    of rows that kept both depths."""
    g = torch.Generator().manual_seed(seed)
    V = P1.shape[0]
    tokens, p, q = build_trees(pick, q1, q2, N_PAIRS, g)
    v = verify(tokens, p, q, g)
    t1 = v.out[:, 0]
    t2 = torch.where(v.n >= 1, v.out[:, 1], sample(P2[t1], g))
    return torch.bincount(t1 * V + t2, minlength=V * V).view(V, V), float((v.n == 2).float().mean())


def chi2_against(counts, a1, a2) -> tuple[float, int, int]:
    return chi_square(counts, N_PAIRS * a1[:, None] * a2)


# The seed's proposer, and one nearer the target so that deep paths are kept more often
# (the seed's top two tokens at the root carry only 0.2 of the target's mass).
NEAR1, NEAR2 = (3 * P1 + Q1) / 4, (3 * P2 + Q2) / 4


@pytest.mark.parametrize("near", [False, True])
def test_tree_sample_exact_chi_square(near):
    q1, q2 = (NEAR1, NEAR2) if near else (Q1, Q2)
    rule = lambda t, p, q, g: verify_tree_sample(t, W2D2, p, q, g, width=2)  # noqa: E731
    counts, deep = pair_counts(rule, "iid", q1, q2, seed=1234)
    chi_p, df, impossible = chi2_against(counts, P1, P2)
    chi_q, _, _ = chi2_against(counts, q1, q2)
    print(f"iid trees (near={near}): chi2 vs target {chi_p:.1f}, vs proposer {chi_q:.1f}, deep {deep:.3f}")
    assert df == 24 and impossible == 0
    assert chi_p < CHI2_CRIT[df], chi_p
    assert chi_q > 1000, chi_q
    assert deep > 0.04  # the walk goes two levels down often enough to be tested there


# A literal and two wrong versions of the rules, as per-node decisions for walk_tree. W2D2's
# inner nodes 0, 1, 2 have children (1, 2), (3, 4), (5, 6); its leaves emit a target draw.


def per_node(tokens, p, q, g, decide):
    B, N, _ = p.shape
    nxt = torch.full((B, N), -1, dtype=torch.long)
    stop = sample(p, g)  # [B, N]
    for u in (0, 1, 2):
        kids = (2 * u + 1, 2 * u + 2)
        acc, stop[:, u] = decide(p[:, u] / p[:, u].sum(-1, keepdim=True), q[:, u], tokens[:, kids], g)
        nxt[:, u] = torch.where(acc >= 0, torch.tensor(kids)[acc.clamp_min(0)], -1)
    return walk_tree(tokens, W2D2, nxt, stop)


def draw(w, g):
    return torch.rand(w.shape[0], generator=g)


def literal_topk(r, q, kids, g, renormalise=True, zero=True):
    """Issue #12's rule (a) step by step: child j accepted with r(c_j) / sum(r), else r(c_j) = 0."""
    acc = torch.full((r.shape[0],), -1)
    for j in range(kids.shape[1]):
        t = kids[:, j : j + 1]
        r_t = r.gather(1, t).squeeze(1) / (r.sum(-1) if renormalise else 1.0)
        ok = (acc < 0) & (draw(r, g) < r_t)
        acc = torch.where(ok, j, acc)
        if zero:
            r = r.scatter(1, t, 0.0)
    return acc, sample(r, g)


def literal_iid(r, q, kids, g, update=True):
    """SpecInfer's rule: child j accepted with min(1, r/q), else r <- norm(max(r - q, 0))."""
    acc = torch.full((r.shape[0],), -1)
    r0 = r
    for j in range(kids.shape[1]):
        t = kids[:, j : j + 1]
        ok = (acc < 0) & (draw(r, g) * q.gather(1, t).squeeze(1) < r.gather(1, t).squeeze(1))
        acc = torch.where(ok, j, acc)
        res = (r - q).clamp_min(0)
        if update:
            r = torch.where((acc < 0)[:, None], res / res.sum(-1, keepdim=True), r)
    return acc, sample(r if update else (r0 - q).clamp_min(0), g)


@pytest.mark.parametrize(
    "name, pick, decide, exact",
    [
        ("literal topk", "gumbel", literal_topk, True),
        ("topk without renormalising", "gumbel", lambda r, q, k, g: literal_topk(r, q, k, g, renormalise=False), False),
        ("topk without zeroing", "gumbel", lambda r, q, k, g: literal_topk(r, q, k, g, zero=False), False),
        ("literal iid", "iid", literal_iid, True),
        ("iid without the residual update", "iid", lambda r, q, k, g: literal_iid(r, q, k, g, update=False), False),
    ],
)
def test_chi_square_tells_right_rules_from_wrong_ones(name, pick, decide, exact):
    q1, q2 = (NEAR1, NEAR2) if pick == "gumbel" else (Q1, Q2)
    counts, _ = pair_counts(lambda t, p, q, g: per_node(t, p, q, g, decide), pick, q1, q2, seed=77)
    chi_p, df, _ = chi2_against(counts, P1, P2)
    print(f"{name}: chi2 vs target {chi_p:.1f}")
    if exact:
        assert chi_p < CHI2_CRIT[df], chi_p
    else:
        assert chi_p > 2 * CHI2_CRIT[df], chi_p


# ------------------------------------------------------------------ sampled: edge cases


def test_tree_sample_layout_on_random_trees():
    g = torch.Generator().manual_seed(5)
    B, N, V = 4000, 10, 4
    parents = random_parents(B, N, g)
    tokens = (torch.rand(B, N, generator=g) * V).long()
    p = torch.softmax(2 * torch.randn(B, N, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, N, V, generator=g), -1)
    depth = tree_depth(parents)
    v = verify_tree_sample(tokens, parents, p, q, g)
    assert v.n.dtype == v.out.dtype == v.nodes.dtype == torch.long and v.out.shape == (B, N)
    assert int(v.n.max()) >= 3
    for b in range(0, B, 97):
        n, nodes = int(v.n[b]), v.nodes[b].tolist()
        assert nodes[0] == 0 and all(parents[b, nodes[j]] == nodes[j - 1] for j in range(1, n + 1))
        assert all(int(depth[b, nodes[j]]) == j for j in range(n + 1)) and set(nodes[n + 1 :]) <= {nodes[n]}
        assert v.out[b, :n].tolist() == tokens[b, nodes[1 : n + 1]].tolist()
        assert float(p[b, nodes[n], v.out[b, n]]) > 0  # a token the target can give there


def test_iid_width_limit_stays_exact_and_same_seed_same_verdict():
    def run(seed, width=None):
        return verify_tree_sample(tokens, W2D2, p, q, torch.Generator().manual_seed(seed), width=width)

    tokens, p, q = build_trees("iid", Q1, Q2, 1000, torch.Generator().manual_seed(6))
    a, b, c = run(11), run(11), run(12)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))
    assert torch.equal(run(11, width=2).n, a.n)  # width 2 is all this tree has
    counts, _ = pair_counts(lambda t, p, q, g: verify_tree_sample(t, W2D2, p, q, g, width=1), "iid", Q1, Q2, seed=9)
    chi_p, df, _ = chi2_against(counts, P1, P2)  # only each node's first child is tried: still exact
    assert chi_p < CHI2_CRIT[df], chi_p


# --------------------------------------------------------------------- no host syncs


def test_runs_on_meta_device():
    # Meta tensors hold no data: .item(), int(), bool() or a branch on a value would raise.
    meta = torch.device("meta")
    B, N, V = 4, 9, 100
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 3, 5], device=meta)
    tokens = torch.zeros(B, N, dtype=torch.long, device=meta)
    logits = torch.randn(B, N, V, device=meta)
    p = q = torch.softmax(logits, -1)
    assert tree_mask(parents).device == meta and tree_bias(parents).shape == (N, N)
    assert path_to(torch.zeros(B, dtype=torch.long, device=meta), parents).shape == (B, N)
    for v in (verify_tree_greedy(tokens, parents, logits), verify_tree_sample(tokens, parents, p, q, None, width=2)):
        assert v.n.shape == (B,) and v.out.shape == v.nodes.shape == (B, N) and v.out.device == meta


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_no_host_sync():
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    B, N, V = 4, 16, 1000
    parents = random_parents(B, N, torch.Generator().manual_seed(0)).to(dev)
    tokens = torch.randint(0, V, (B, N), device=dev)
    logits = torch.randn(B, N, V, device=dev)
    p = q = torch.softmax(logits, -1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        bias = tree_bias(parents, torch.bfloat16)
        v1 = verify_tree_greedy(tokens, parents, logits)
        v2 = verify_tree_sample(tokens, parents, p, q, g, width=4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert bias.shape == (B, N, N) and all(v.out.device.type == "cuda" for v in (v1, v2))
