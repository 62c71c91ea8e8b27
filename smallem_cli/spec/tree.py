"""Token-tree verification: pure tensor functions, batched over B rows, no host sync.

A chain checks one guess per position; a tree offers several candidates per position, so
one target pass can keep the longest of many paths (SpecInfer, Medusa, EAGLE-2). This
module decides, from the target's scores at every node, which path is kept and which token
comes after it. It knows nothing about models: the engine builds the tree, runs the target
over it (each node seeing its ancestors, `tree_mask`, at position start + its depth), then calls
`verify_tree_greedy` or `verify_tree_sample` and moves the kept path's K/V into place.

The tree, per row (shared trees broadcast: parents may be [N] while tokens are [B, N]):
  tokens  long [B, N]  node i's token; node 0 is the root: the last verified token, not a guess;
  parents long [B, N]  parents[:, 0] == -1 and 0 <= parents[:, i] < i for i >= 1, so node order
                       is topological (each node after its parent) and siblings are tried in
                       index order.
Row u of the target's output (logits / p) is its distribution for the token after node u,
given the root's context and u's path: the children of u are guesses for that token.

Every function decides all nodes at once: each node's outcome (which child it accepts,
else the token it emits) depends only on its own row of p / q, its children and its own
random draws, so nodes are decided in parallel and the kept path is read off from the
ancestor mask. Draws at nodes off the path are discarded, which does not bias the path:
they are independent of it. Exactness then reduces to one node u: the token that follows
it (the accepted child's, or the one it emits) must be distributed as r = the target's
(warped) distribution after u, using nothing but u's own draws.

  kind="topk": children fixed given the prefix (the proposer's top candidates, or any tree
    built without looking at the target's draws). Issue #12's rule: try each child c in
    turn, accept it with probability r(c) / sum(r), else set r(c) = 0; if none is
    accepted, draw from r. That law equals drawing x ~ r once and following the child
    whose token is x (the first such, if siblings repeat a token), which is what runs.
  kind="iid": the children of u are i.i.d. draws from the proposer's q[u] (SpecInfer's
    multi-round rule): accept child c with probability min(1, r(c) / q(c)), else
    r <- norm(max(r - q, 0)); if none is accepted, draw from r. Do not merge duplicate
    draws into one child: the rule needs all of them, independent. On such trees it keeps
    more than "topk" (tests/test_tree.py, width 2: 0.88 against 0.18 of rounds keep both
    levels), as rejecting a child also moves r away from q.

Greedy (`verify_tree_greedy`) is the temperature-0 limit: x = argmax of the logits.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from .verify import sample


class TreeVerdict(NamedTuple):
    """What a verified tree yields, per row; L = max_depth + 1 (default N).

    n     long [B]     accepted guesses (nodes below the root on the kept path), 0 <= n <= L - 1.
    out   long [B, L]  out[:, :n+1] are the tokens this pass yields: the n accepted guesses, then
                       the target's token after the last kept node (a correction, or a bonus at a
                       leaf). out[:, n+1:] is filler to ignore.
    nodes long [B, L]  nodes[:, :n+1] is the kept path from the root: nodes[:, 0] == 0 and
                       nodes[:, j] is the kept node at depth j. nodes[:, n] is the last kept node:
                       its hidden state feeds the proposer next. With node i written at slot
                       start + i (the root at start), the kept guesses' K/V go from start + nodes[:, j]
                       to start + j (j = 1..n), and every other slot is rolled back.
                       nodes[:, n+1:] repeats nodes[:, n], so gathers stay safe.
    """

    n: Tensor
    out: Tensor
    nodes: Tensor


def tree_mask(parents: Tensor) -> Tensor:
    """Ancestor mask bool [..., N, N] from parents [..., N]: [i, j] iff j is i or an ancestor of i.

    Row i is what node i may attend to among the tree's nodes (it also sees the whole
    verified prefix). Built by pointer doubling: ceil(log2(N - 1)) gathers, no host sync.
    """
    N = parents.shape[-1]
    up = parents.clamp_min(0)  # [..., N] the root is its own parent: harmless, it is everyone's ancestor
    eye = torch.eye(N, dtype=torch.bool, device=parents.device)  # [N, N]
    mask = eye | (up.unsqueeze(-1) == torch.arange(N, device=parents.device))  # [..., N, N] self, parent
    jump = up  # [..., N] the 2^s-th ancestor (clamped at the root)
    for _ in range(max(N - 2, 0).bit_length()):  # after s rounds the mask reaches distance 2^s >= N - 1
        mask = mask | mask.gather(-2, jump.unsqueeze(-1).expand_as(mask))  # [..., N, N]
        jump = jump.gather(-1, jump)  # [..., N]
    return mask


def tree_depth(parents: Tensor, mask: Tensor | None = None) -> Tensor:
    """Depth long [..., N] of each node (root 0); its position is start + depth."""
    mask = tree_mask(parents) if mask is None else mask  # [..., N, N]
    return mask.sum(dim=-1) - 1


def _path(on: Tensor, depth: Tensor, last: Tensor, length: int) -> Tensor:
    """Nodes long [B, length] of a root path given as a node set on [B, N], ending at last [B].

    depth: long [(B,) N]. Slot j gets the path's node at depth j; later slots repeat last.
    """
    B, N = on.shape
    slot = torch.where(on, depth, N)  # [B, N] nodes off the path go to a dump slot N
    buf = last.unsqueeze(1).expand(B, N + 1).clone()  # [B, N+1]
    buf.scatter_(1, slot, torch.arange(N, device=on.device).expand(B, N))  # the dump slot takes many writes
    return buf[:, :length]  # [B, length]


class _Shape(NamedTuple):
    """A tree's structure, computed once; leading dim B only if parents has one."""

    mask: Tensor  # bool [(B,) N, N] ancestors
    depth: Tensor  # long [(B,) N]
    child: Tensor  # bool [(B,) N, N]: [u, c] iff c is a child of u, no deeper than max_depth
    length: int  # L, the verdict's width


def _shape(parents: Tensor, max_depth: int | None) -> _Shape:
    N = parents.shape[-1]
    mask = tree_mask(parents)  # [(B,) N, N]
    depth = tree_depth(parents, mask)  # [(B,) N]
    child = parents.unsqueeze(-2) == torch.arange(N, device=parents.device).unsqueeze(-1)  # [(B,) N, N]
    if max_depth is not None:
        child = child & (depth <= max_depth).unsqueeze(-2)  # [(B,) N, N]
    return _Shape(mask, depth, child, N if max_depth is None else min(max(max_depth, 0), N - 1) + 1)


def _follow(tokens: Tensor, child: Tensor, x: Tensor) -> Tensor:
    """Per node, the first child whose token is x[u], else -1: long [B, N]."""
    match = child & (tokens.unsqueeze(1) == x.unsqueeze(2))  # [B, N, N]
    first = match.long().argmax(dim=-1)  # [B, N] first True (0 when none)
    return torch.where(match.any(dim=-1), first, -1)


def _walk(tokens: Tensor, parents: Tensor, shape: _Shape, nxt: Tensor, stop: Tensor) -> TreeVerdict:
    B, N = tokens.shape
    arange = torch.arange(N, device=tokens.device)  # [N]
    taken = nxt.gather(1, parents.clamp_min(0).expand(B, N)) == arange  # [B, N] its parent accepted it
    taken = (taken | (arange == 0)) & (shape.depth < shape.length)  # [B, N] the root always; none too deep
    on = ~(shape.mask & ~taken.unsqueeze(1)).any(dim=-1)  # [B, N] every node from the root to it was taken
    n = on.sum(dim=-1) - 1  # [B]
    # On a path, later nodes are deeper (topological order): the last kept node has the largest index.
    last = (on * arange).argmax(dim=-1)  # [B]
    nodes = _path(on, shape.depth, last, shape.length)  # [B, L]
    out = torch.cat([tokens.gather(1, nodes[:, 1:]), nodes[:, :1]], dim=1)  # [B, L] guesses after the root
    out.scatter_(1, n.unsqueeze(1), stop.gather(1, last.unsqueeze(1)))  # out[:, n] = the target's token
    return TreeVerdict(n, out, nodes)


def verify_tree_greedy(tokens: Tensor, parents: Tensor, logits: Tensor, max_depth: int | None = None) -> TreeVerdict:
    """Greedy tree verification: tokens long [B, N], parents long [B, N] or [N], logits [B, N, V].

    From the root, move to the child whose token is the target's argmax at the current
    node (the first such child if siblings repeat it); stop where none is: on a chain, the
    leading guesses equal to the argmax, then the argmax. max_depth (optional) ignores deeper nodes and sets
    L = max_depth + 1, the width of the verdict; default L = N.
    """
    shape = _shape(parents, max_depth)
    x = logits.argmax(dim=-1)  # [B, N] the target's token after each node
    return _walk(tokens, parents, shape, _follow(tokens, shape.child, x), x)


def _iid_decisions(
    tokens: Tensor, child: Tensor, p: Tensor, q: Tensor, generator: torch.Generator | None, width: int
) -> tuple[Tensor, Tensor]:
    """SpecInfer's multi-round rule at every node at once -> (nxt [B, N], stop [B, N])."""
    B, N, _ = p.shape
    r = p.float() / p.float().sum(dim=-1, keepdim=True)  # [B, N, V]
    q = q.float()  # [B, N, V]
    rank = child.long().cumsum(dim=-1) * child  # [(B,) N, N] 1 + sibling rank at each child, 0 elsewhere
    nxt = torch.full((B, N), -1, dtype=torch.long, device=p.device)  # [B, N]
    for j in range(1, width + 1):  # the j-th child of every node
        at = rank == j  # [(B,) N, N]
        has = at.any(dim=-1) & (nxt < 0)  # [B, N] a j-th child, and nothing accepted yet
        c = at.long().argmax(dim=-1).expand(B, N)  # [B, N]
        t = tokens.gather(1, c).unsqueeze(-1)  # [B, N, 1]
        r_t, q_t = r.gather(-1, t).squeeze(-1), q.gather(-1, t).squeeze(-1)  # [B, N] each
        u = torch.rand(B, N, generator=generator, device=p.device)  # [B, N] in [0, 1)
        accept = has & (u * q_t < r_t)  # [B, N] probability min(1, r/q)
        nxt = torch.where(accept, c, nxt)
        residual = (r - q).clamp_min(0.0)  # [B, N, V]
        mass = residual.sum(dim=-1, keepdim=True)  # [B, N, 1]
        # A zero residual means r == q up to rounding: then rejection was (nearly) impossible; keep r.
        moved = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(r.dtype).tiny), r)  # [B, N, V]
        r = torch.where((has & ~accept).unsqueeze(-1), moved, r)  # [B, N, V]
    return nxt, sample(r, generator)


def verify_tree_sample(
    tokens: Tensor,
    parents: Tensor,
    p: Tensor,
    q: Tensor | None,
    generator: torch.Generator | None,
    kind: Literal["topk", "iid"] = "topk",
    max_depth: int | None = None,
    width: int | None = None,
) -> TreeVerdict:
    """Exact sampled tree verification -> `TreeVerdict`; the module docstring gives both rules.

    tokens long [B, N], parents long [B, N] or [N]; p [B, N, V]: the target's (warped)
    probabilities after each node, rows need not be normalised. kind="topk" ignores q.
    kind="iid" needs q [B, N, V]: q[:, u] is the proposer's (equally warped) distribution
    that u's children were drawn from, rows of leaves are unused. width (iid only) is the
    most children any node has; children past it are never tried, which stays exact;
    default N - 1, always enough. max_depth as in `verify_tree_greedy`.
    """
    if kind not in ("topk", "iid"):
        raise ValueError(f'kind must be "topk" or "iid", got {kind!r}')
    if kind == "iid" and q is None:
        raise ValueError('kind="iid" needs q, the distributions the children were drawn from')
    shape = _shape(parents, max_depth)
    if kind == "topk":
        x = sample(p, generator)  # [B, N] one target draw per node
        return _walk(tokens, parents, shape, _follow(tokens, shape.child, x), x)
    assert q is not None
    N = tokens.shape[1]
    nxt, stop = _iid_decisions(tokens, shape.child, p, q, generator, N - 1 if width is None else width)
    return _walk(tokens, parents, shape, nxt, stop)
