"""Draft trees from the MTP module (EAGLE-2's dynamic trees; docs/architecture.md#token-trees).

A node scores the sum of the log-probabilities on its path; level by level the `width` best nodes are fed to the module
in one pass over every tree. Greedy: the tree is the `budget` best nodes (a child scores no more than its parent, so
every node's parent is in). Sampled: draws from the module's q, all of them in the tree, verified by SpecInfer's rule:
exact as long as which nodes are expanded never depends on their own children."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..defaults import TREE_DRAWS
from ..kv.step import build_tree
from ..model.llama import head_matmul, unit_rms
from ..spec.verify import Penalty, proposal, sample
from .proposers import MTPProposer, penalty_of
from .sequence import Seq

Scored = tuple[list[list[float]], list[list[int]], list[torch.Tensor | None]]  # per row: children's log p, tokens, q


@dataclass
class DraftTree:
    """One sequence's draft tree below its root (node 0, the last verified token, not a draft token)."""

    tokens: torch.Tensor  # long [N]: nodes 1..N
    parents: list[int]  # [N + 1]: parents[0] == -1, 0 <= parents[i] < i
    depth: int  # the deepest node's depth (0: no draft)
    q: torch.Tensor | None = None  # sampled: [N + 1, V], row u what u's children were drawn from (or zeros)


@dataclass
class _Cand:
    score: float
    token: int
    parent: int  # candidate id of its parent, -1 under the root
    depth: int
    entry: int = -1  # the module's tree entry, once fed
    q: torch.Tensor | None = None  # sampled: [V], what its children were drawn from, once made


@dataclass
class _Growing:  # one sequence's tree while it grows
    cands: list[_Cand] = field(default_factory=list)
    root_q: torch.Tensor | None = None  # sampled: what the root's children were drawn from
    entries: list[int] = field(default_factory=list)  # per module entry, its parent's (-1: the confirmed entries)
    # the candidates whose states the last pass computed: (row in its states, candidate id; -1 the root)
    frontier: list[tuple[int, int]] = field(default_factory=list)

    def extend(self, scored: Scored, level: int) -> None:
        """The frontier's children, scored, become this level's candidates."""
        vals, toks, qs = scored
        for r, cid in self.frontier:
            if cid < 0:
                self.root_q, score = qs[r], 0.0
            else:
                self.cands[cid].q, score = qs[r], self.cands[cid].score
            for v, t in zip(vals[r], toks[r], strict=True):
                self.cands.append(_Cand(score + v, t, cid, level))

    def path(self, i: int) -> list[int]:
        path = []
        while i >= 0:
            path.append(self.cands[i].token)
            i = self.cands[i].parent
        return path[::-1]


class TreeProposer:
    """Draft trees of at most `budget` nodes, seq.k levels deep, over the MTP module's cache (`mtp`): a node's
    `width` best children (sampled: `drawn` draws from q). The protocol's start, accept and drop are `mtp`'s."""

    def __init__(self, mtp: MTPProposer, budget: int, width: int) -> None:
        self.mtp, self.budget = mtp, budget
        self.width, self.drawn = min(width, budget), min(TREE_DRAWS, budget)

    def propose(self, seqs: list[Seq]) -> list[DraftTree]:
        """A tree for each sequence, level by level: one pass and one host sync per level."""
        p = self.mtp
        p.begin(seqs, [1] * len(seqs))  # every sequence's pending entries are fed (its tree may be empty)
        out = p.feed_pending(seqs)  # [G, d]: each one's state after its last confirmed token
        trees = [_Growing(frontier=[(b, -1)] if s.k else []) for b, s in enumerate(seqs)]
        states, scored = out, self._children(out, seqs, [[] for _ in seqs])
        for level in range(1, max((s.k for s in seqs), default=0) + 1):
            for tree in trees:
                tree.extend(scored, level)
            picks = [self._picks(s, tree, level) for s, tree in zip(seqs, trees, strict=True)]
            active = [b for b, pb in enumerate(picks) if pb]
            if not active:
                break
            states = self._feed(seqs, trees, active, picks, states)
            row_seqs = [seqs[b] for b in active for _ in picks[b]]
            scored = self._children(states, row_seqs, [trees[b].path(i) for b in active for i in picks[b]])
            r = 0
            for b, tree in enumerate(trees):
                tree.frontier = [(r + j, i) for j, i in enumerate(picks[b])]
                r += len(picks[b])
        return [_tree(tree.cands, self.budget, tree.root_q, out.device) for tree in trees]

    def _picks(self, s: Seq, tree: _Growing, level: int) -> list[int]:
        """This level's best candidates to feed; a sampled tree expands a node only while all it draws fit."""
        cands = tree.cands
        if level >= s.k:
            return []
        best = sorted((i for i, c in enumerate(cands) if c.depth == level), key=lambda i: -cands[i].score)
        room = self.width if s.warp is None else min(self.width, (self.budget - len(cands)) // self.drawn)
        return best[: max(room, 0)]

    def _feed(
        self, seqs: list[Seq], trees: list[_Growing], active: list[int], picks: list[list[int]], states: torch.Tensor
    ) -> torch.Tensor:
        """The picked candidates fed in one pass over every tree, each on its parent's state -> theirs [F, d]."""
        p = self.mtp
        h, ids, rows = [], [], []
        for b in active:
            tree = trees[b]
            parent_row = {cid: r for r, cid in tree.frontier}
            rows.append([])
            for i in picks[b]:
                c = tree.cands[i]
                c.entry = len(tree.entries)
                tree.entries.append(tree.cands[c.parent].entry if c.parent >= 0 else -1)
                rows[-1].append(c.entry)
                h.append(states[parent_row[c.parent]])
                ids.append(c.token)
        tables = [p.pool.tables[seqs[b].uid] for b in active]
        starts = [p.state[seqs[b].uid].confirmed for b in active]
        step = build_tree(tables, starts, [trees[b].entries for b in active], rows, p.pool.page_size, p.slab.device)
        return p.feed(step, torch.stack(h), torch.tensor(ids, dtype=torch.long, device=states.device))

    def _children(self, h: torch.Tensor, seqs: list[Seq], paths: list[list[int]]) -> Scored:
        """States h [F, d] (row r a node of seqs[r] at the end of `paths[r]`) -> per row its children's
        log-probabilities and tokens (`width` best, or `drawn` draws), in one sync, and their q [V] or None."""
        head, width, drawn = self.mtp.head, self.width, self.drawn
        logits = head_matmul(unit_rms(h, self.mtp.mtp.cfg.norm_eps), head.w, head.rows)  # [F, V or cut]
        logits = _penalised(logits, seqs, paths, head.ids)
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


def _tree(cands: list[_Cand], budget: int, root_q: torch.Tensor | None, device: torch.device) -> DraftTree:
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
    return DraftTree(tokens, parents, max((cands[i].depth for i in order), default=0), q)
