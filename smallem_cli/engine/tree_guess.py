"""Token trees from the MTP module (EAGLE-2's dynamic trees; docs/architecture.md#token-trees).

A node scores the sum of the log-probabilities on its path; level by level the `width` best nodes are fed to the module
in one pass over every tree. Greedy: the tree is the `budget` best nodes (a child scores no more than its parent, so
every node's parent is in). Sampled: draws from the module's q, all kept, verified by SpecInfer's rule: exact as long as
which nodes are expanded never depends on their own children."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.llama import head_matmul, unit_rms
from ..spec.head import Head
from ..spec.verify import Penalty, proposal, sample
from . import batch as B
from .forward import mtp_pass
from .proposers import MTPGuess, penalty_of
from .sequence import Seq


@dataclass
class TreeGuess:
    """One sequence's tree below its root (node 0, the last verified token, not a guess)."""

    tokens: torch.Tensor  # long [N]: nodes 1..N
    parents: list[int]  # [N + 1]: parents[0] == -1, 0 <= parents[i] < i
    depth: int  # the deepest node's depth (0: no guess)
    q: torch.Tensor | None = None  # sampled: [N + 1, V], row u what u's children were drawn from (or zeros)


@dataclass
class _Cand:
    score: float
    token: int
    parent: int  # candidate id of its parent, -1 under the root
    depth: int
    entry: int = -1  # the module's tree entry, once fed
    q: torch.Tensor | None = None  # sampled: [V], what its children were drawn from, once made


def _children(
    head: Head, h: torch.Tensor, eps: float, width: int, drawn: int, seqs: list[Seq], paths: list[list[int]]
) -> tuple[list[list[float]], list[list[int]], list[torch.Tensor | None]]:
    """States h [F, d] (row r a node of seqs[r] at the end of `paths[r]`) -> per row its children's
    log-probabilities and tokens (`width` best, or `drawn` draws), in one sync, and their q [V] or None."""
    logits = _penalised(head_matmul(unit_rms(h, eps), head.w, head.rows), seqs, paths, head.ids)  # [F, V or cut]
    vals, idx = torch.log_softmax(logits, dim=-1).topk(min(width, logits.shape[-1]), dim=-1)  # [F, w]
    sampled = [r for r, s in enumerate(seqs) if s.warp is not None]
    qs: list[torch.Tensor | None] = [None] * len(seqs)
    ids = head.ids  # a cut head's indices -> tokens, on the device
    parts = [vals, idx if ids is None else ids[idx]]
    for r in sampled:  # `drawn` independent draws from q, in the head's own indices
        s = seqs[r]
        assert s.warp is not None
        q = proposal(s.warp)(logits[r : r + 1])  # [1, V or cut]: the temperature alone
        draws = sample(q.expand(drawn, -1).contiguous(), s.gen)  # [drawn]
        parts += [q[0, draws].log(), draws if ids is None else ids[draws]]
        qs[r] = head.expand(q)[0]  # [V]
    host = torch.cat([x.flatten().double() for x in parts]).tolist()  # the one sync (ids are exact)
    F, w = vals.shape
    out_vals = [host[r * w : (r + 1) * w] for r in range(F)]
    toks = [host[(F + r) * w : (F + r + 1) * w] for r in range(F)]
    at = 2 * F * w
    for r in sampled:
        out_vals[r], toks[r] = host[at : at + drawn], host[at + drawn : at + 2 * drawn]
        at += 2 * drawn
    return out_vals, [[int(t) for t in row] for row in toks], qs


def grow(p: MTPGuess, seqs: list[Seq], budget: int, width: int, drawn: int) -> list[TreeGuess]:
    """A tree of at most `budget` guesses, seq.k levels deep, for each sequence: one host sync per level."""
    st = [p.state[s.uid] for s in seqs]
    for x in st:
        x.proposed = True  # `MTPGuess.accept` then drops the tree's entries
    depth = [s.k for s in seqs]
    out = p._feed_pending(seqs)  # [G, d]: each one's state after its last true token
    head, eps = p.head, p.mtp.cfg.norm_eps
    cands: list[list[_Cand]] = [[] for _ in seqs]
    roots: list[torch.Tensor | None] = [None] * len(seqs)  # sampled: what the root's children were drawn from
    entries: list[list[int]] = [[] for _ in seqs]  # parent entry (-1: the true entries) per tree entry
    states = out
    vals, toks, qs = _children(head, out, eps, width, drawn, seqs, [[] for _ in seqs])
    # per sequence, the candidates whose states were just computed: (row in `states`, cand id)
    frontier: list[list[tuple[int, int]]] = [[(b, -1)] if depth[b] else [] for b in range(len(seqs))]
    for level in range(1, max(depth, default=0) + 1):
        for b, fb in enumerate(frontier):
            for r, cid in fb:
                if cid < 0:
                    roots[b], score = qs[r], 0.0
                else:
                    cands[b][cid].q, score = qs[r], cands[b][cid].score
                for v, t in zip(vals[r], toks[r], strict=True):
                    cands[b].append(_Cand(score + v, t, cid, level))
        # this level's best, to be fed to the module; a sampled tree expands a node only while
        # every child it will draw fits the budget
        picks = []
        for b, cb in enumerate(cands):
            best = sorted((i for i, c in enumerate(cb) if c.depth == level), key=lambda i, cb=cb: -cb[i].score)
            room = width if seqs[b].warp is None else min(width, (budget - len(cb)) // drawn)
            picks.append(best[: max(room, 0)] if level < depth[b] else [])
        active = [b for b, pb in enumerate(picks) if pb]
        if not active:
            break
        h, ids = [], []
        rows: list[list[int]] = []
        for b in active:
            parent_row = {cid: r for r, cid in frontier[b]}
            rows.append([])
            for i in picks[b]:
                c = cands[b][i]
                c.entry = len(entries[b])
                entries[b].append(cands[b][c.parent].entry if c.parent >= 0 else -1)
                rows[-1].append(c.entry)
                h.append(states[parent_row[c.parent]])
                ids.append(c.token)
        tables = [p.pool.tables[seqs[b].uid] for b in active]
        starts = [st[b].true_len for b in active]
        step = B.build_tree(tables, starts, [entries[b] for b in active], rows, p.pool.page_size, p.slab.device)
        tok = torch.tensor(ids, dtype=torch.long, device=out.device)
        states = mtp_pass(p.mtp, p.target, p.slab, torch.stack(h), tok, step, p.steps)  # [F, d]
        row_seqs = [seqs[b] for b in active for _ in picks[b]]
        paths = [_path(cands[b], i) for b in active for i in picks[b]]
        vals, toks, qs = _children(head, states, eps, width, drawn, row_seqs, paths)
        frontier, r = [[] for _ in seqs], 0
        for b in active:
            frontier[b] = [(r + j, i) for j, i in enumerate(picks[b])]
            r += len(picks[b])
    return [_tree(cb, budget, root, out.device) for cb, root in zip(cands, roots, strict=True)]


def _penalised(logits: torch.Tensor, seqs: list[Seq], paths: list[list[int]], ids: torch.Tensor | None) -> torch.Tensor:
    """logits [F, N] (row r a node of seqs[r]) penalised over each row's context and path, in place."""
    rows: dict[int, list[int]] = {}
    for r, s in enumerate(seqs):
        if s.seen is not None:
            rows.setdefault(s.uid, []).append(r)
    for mine in rows.values():
        pen = penalty_of(seqs[mine[0]])
        assert pen is not None
        seen = pen.seen.expand(len(mine), -1).clone()  # [R, V]: each row its own context
        at = [(j, t) for j, r in enumerate(mine) for t in paths[r]]
        if at:
            seen[tuple(torch.tensor(at, device=seen.device).t())] = True
        idx = torch.tensor(mine, device=logits.device)
        logits[idx] = Penalty(seen, pen.factor).apply(logits[idx], ids)
    return logits


def _path(cands: list[_Cand], i: int) -> list[int]:
    path = []
    while i >= 0:
        path.append(cands[i].token)
        i = cands[i].parent
    return path[::-1]


def _tree(cands: list[_Cand], budget: int, root_q: torch.Tensor | None, device: torch.device) -> TreeGuess:
    """Greedy: the `budget` best candidates; sampled (root_q given): every one, as drawn. In
    topological order: by depth, then as they were made (a node's children as they were drawn)."""
    chosen = list(range(len(cands)))
    if root_q is None:
        chosen = sorted(chosen, key=lambda i: (-cands[i].score, i))[:budget]
    order = sorted(chosen, key=lambda i: (cands[i].depth, i))
    node = {cid: n + 1 for n, cid in enumerate(order)}
    parents = [-1] + [0 if cands[i].parent < 0 else node[cands[i].parent] for i in order]
    tokens = torch.tensor([cands[i].token for i in order], dtype=torch.long, device=device)
    q = None
    if root_q is not None:  # [N+1, V]: what each node's children were drawn from (zeros: none)
        zero = root_q.new_zeros(root_q.shape)
        q = torch.stack([root_q] + [q if (q := cands[i].q) is not None else zero for i in order])
    return TreeGuess(tokens, parents, max((cands[i].depth for i in order), default=0), q)
