"""Token-tree verification (SpecInfer, EAGLE-2): pure tensor functions, batched over B rows, no host sync.

tokens long [B, N], node 0 the root (the last verified token, not a draft token); parents long [B, N] or
[N], parents[..., 0] == -1 and 0 <= parents[..., i] < i (siblings tried in index order).

A node's outcome (the child it accepts, else the token it emits) depends only on its own row of
p / q, its children and its own draws, so all are decided at once and the accepted path is read off the
ancestor mask; draws off the path bias nothing. Exactness reduces to one node u whose children are
i.i.d. from q[u] (SpecInfer's multi-round rule): accept child c with probability min(1, r(c) / q(c)),
else r <- norm(max(r - q, 0)); none accepted: draw from r. Greedy is the temperature-0 limit."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .verify import sample


class TreeVerdict(NamedTuple):
    n: Tensor  # long [B]: accepted draft tokens (nodes below the root on the accepted path)
    out: Tensor  # long [B, N]: the n accepted draft tokens, then the target's token; filler after
    nodes: Tensor  # long [B, N]: the accepted path, nodes[:, j] at depth j, then nodes[:, n] repeated


def tree_mask(parents: Tensor) -> Tensor:
    """Ancestor mask bool [..., N, N] from parents [..., N]: [i, j] iff j is i or an ancestor of i (what
    node i attends to in the tree). Pointer doubling: ceil(log2(N - 1)) gathers, no host sync."""
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
    return (tree_mask(parents) if mask is None else mask).sum(dim=-1) - 1


def _path(on: Tensor, depth: Tensor, last: Tensor) -> Tensor:
    """Nodes long [B, N] of the root path `on` [B, N] ending at last [B]: slot j its node at depth j, then last."""
    B, N = on.shape
    slot = torch.where(on, depth, N)  # [B, N] nodes off the path go to a dump slot N
    buf = last.unsqueeze(1).expand(B, N + 1).clone()  # [B, N+1]
    buf.scatter_(1, slot, torch.arange(N, device=on.device).expand(B, N))  # the dump slot takes many writes
    return buf[:, :N]  # [B, N]


class _Shape(NamedTuple):
    """A tree's structure, computed once; leading dim B only if parents has one."""

    mask: Tensor  # bool [(B,) N, N] ancestors
    depth: Tensor  # long [(B,) N]
    child: Tensor  # bool [(B,) N, N]: [u, c] iff c is a child of u


def _shape(parents: Tensor) -> _Shape:
    mask = tree_mask(parents)  # [(B,) N, N]
    child = parents.unsqueeze(-2) == torch.arange(parents.shape[-1], device=parents.device).unsqueeze(-1)
    return _Shape(mask, tree_depth(parents, mask), child)


def _follow(tokens: Tensor, child: Tensor, x: Tensor) -> Tensor:
    """Per node, the first child whose token is x[u], else -1: long [B, N]."""
    match = child & (tokens.unsqueeze(1) == x.unsqueeze(2))  # [B, N, N]
    first = match.long().argmax(dim=-1)  # [B, N] first True (0 when none)
    return torch.where(match.any(dim=-1), first, -1)


def _walk(tokens: Tensor, parents: Tensor, shape: _Shape, nxt: Tensor, stop: Tensor) -> TreeVerdict:
    B, N = tokens.shape
    arange = torch.arange(N, device=tokens.device)  # [N]
    taken = nxt.gather(1, parents.clamp_min(0).expand(B, N)) == arange  # [B, N] its parent accepted it
    taken = taken | (arange == 0)  # [B, N] the root always
    on = ~(shape.mask & ~taken.unsqueeze(1)).any(dim=-1)  # [B, N] every node from the root to it was taken
    n = on.sum(dim=-1) - 1  # [B]
    # On a path, later nodes are deeper (topological order): the last accepted node has the largest index.
    last = (on * arange).argmax(dim=-1)  # [B]
    nodes = _path(on, shape.depth, last)  # [B, N]
    out = torch.cat([tokens.gather(1, nodes[:, 1:]), nodes[:, :1]], dim=1)  # [B, N] draft tokens after the root
    out.scatter_(1, n.unsqueeze(1), stop.gather(1, last.unsqueeze(1)))  # out[:, n] = the target's token
    return TreeVerdict(n, out, nodes)


def verify_tree_greedy(tokens: Tensor, parents: Tensor, logits: Tensor) -> TreeVerdict:
    """From the root, move to the (first) child whose token is the argmax at the node, until none is."""
    shape = _shape(parents)
    x = logits.argmax(dim=-1)  # [B, N] the target's token after each node
    return _walk(tokens, parents, shape, _follow(tokens, shape.child, x), x)


def verify_tree_sample(
    tokens: Tensor, parents: Tensor, p: Tensor, q: Tensor, generator: torch.Generator | None, width: int | None = None
) -> TreeVerdict:
    """The module docstring's rule at every node at once: p [B, N, V] the target's (warped) probabilities after
    each node, q [B, N, V] what its children were drawn from; width: the most children a node has."""
    shape = _shape(parents)
    B, N, _ = p.shape
    r = p.float() / p.float().sum(dim=-1, keepdim=True)  # [B, N, V]
    q = q.float()  # [B, N, V]
    rank = shape.child.long().cumsum(dim=-1) * shape.child  # [(B,) N, N] 1 + sibling rank at each child
    nxt = torch.full((B, N), -1, dtype=torch.long, device=p.device)  # [B, N]
    for j in range(1, (N - 1 if width is None else width) + 1):  # the j-th child of every node
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
    return _walk(tokens, parents, shape, nxt, sample(r, generator))
