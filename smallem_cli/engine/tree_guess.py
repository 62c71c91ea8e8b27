"""Token trees from the MTP module (EAGLE-2's dynamic trees, on the module's own chain).

A chain offers one guess per position; a tree offers several, and one target pass keeps
the longest path the target agrees with (`tree.py` decides which). The tree grows where
the module is sure: every node it reaches gets a score, the sum of the log-probabilities
of the guesses on its path, and

    depth 1     the module's state after the last true token gives the root's candidates;
    depth j+1   the `width` best candidates of depth j (by score) are fed to the module, each
                as (its parent's state, its token), in one pass over every sequence's tree
                (each node attends to the true entries, its ancestors and itself); each
                one's `width` best tokens are candidates of depth j+1;
    the tree    the `budget` best candidates of all depths. A child scores no more than its
                parent and is made after it, so the best set holds every node's parent.

The children of a node are the module's top tokens, fixed given the prefix, so
verification uses the "topk" rule under sampling (`verify_tree_sample`), exact for any q.
The module's tree entries are dropped after the round, as a chain's guesses are
(`MTPGuess.accept`): its cache keeps the true entries alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..decode_ops import head_matmul
from ..model import unit_rms
from ..proposers import Head
from . import batch as B
from .forward import mtp_pass
from .proposers import MTPGuess
from .sequence import Seq


@dataclass
class TreeGuess:
    """One sequence's tree below its root (node 0, the last verified token, not a guess)."""

    tokens: torch.Tensor  # long [N]: nodes 1..N
    parents: list[int]  # [N + 1]: parents[0] == -1, 0 <= parents[i] < i
    depth: int  # the deepest node's depth (0: no guess)


@dataclass
class _Cand:
    score: float
    token: int
    parent: int  # candidate id of its parent, -1 under the root
    depth: int
    entry: int = -1  # the module's tree entry, once fed


def _top(head: Head, h: torch.Tensor, eps: float, width: int) -> tuple[list[list[float]], list[list[int]]]:
    """States h [F, d] -> (log-probabilities [F, w], tokens [F, w]) of each one's `width` best, on the host."""
    ids = head.ids
    logp = torch.log_softmax(head_matmul(unit_rms(h, eps), head.w, head.rows), dim=-1)  # [F, V or cut]
    vals, idx = logp.topk(min(width, logp.shape[-1]), dim=-1)  # [F, w]
    toks = idx if ids is None else ids[idx]
    return vals.tolist(), toks.tolist()


def grow(p: MTPGuess, seqs: list[Seq], budget: int, width: int) -> list[TreeGuess]:
    """A tree of at most `budget` guesses and seq.k levels for each sequence (one host sync per level)."""
    st = [p.state[s.uid] for s in seqs]
    for x in st:
        x.proposed, x.fed_guesses = True, 0
    depth = [s.k for s in seqs]
    out = p._feed_pending(seqs)  # [G, d]: each one's state after its last true token
    head, eps = p.head, p.mtp.cfg.norm_eps
    cands: list[list[_Cand]] = [[] for _ in seqs]
    entries: list[list[int]] = [[] for _ in seqs]  # parent entry (-1: the true entries) per tree entry
    states = out
    vals, toks = _top(head, out, eps, width)
    # per sequence, the candidates whose states were just computed: (row in `states`, cand id)
    frontier: list[list[tuple[int, int]]] = [[(b, -1)] if depth[b] else [] for b in range(len(seqs))]
    for level in range(1, max(depth, default=0) + 1):
        for b, fb in enumerate(frontier):
            for r, cid in fb:
                score = cands[b][cid].score if cid >= 0 else 0.0
                for v, t in zip(vals[r], toks[r], strict=True):
                    cands[b].append(_Cand(score + v, t, cid, level))
        # the `width` best candidates of this level, fed to the module (their parent's state, their
        # token), for the sequences whose trees go deeper
        picks = [
            sorted((i for i, c in enumerate(cb) if c.depth == level), key=lambda i, cb=cb: -cb[i].score)[:width]
            if level < depth[b]
            else []
            for b, cb in enumerate(cands)
        ]
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
        step = B.build_tree(
            [p.pool.tables[seqs[b].uid] for b in active],
            [st[b].true_len for b in active],
            [entries[b] for b in active],
            rows,
            p.pool.page_size,
            p.slab.device,
        )
        tok = torch.tensor(ids, dtype=torch.long, device=out.device)
        states = mtp_pass(p.mtp, p.target, p.slab, torch.stack(h), tok, step)  # [F, d]
        vals, toks = _top(head, states, eps, width)
        frontier, r = [[] for _ in seqs], 0
        for b in active:
            frontier[b] = [(r + j, i) for j, i in enumerate(picks[b])]
            r += len(picks[b])
    return [_tree(cb, budget, out.device) for cb in cands]


def _tree(cands: list[_Cand], budget: int, device: torch.device) -> TreeGuess:
    """The `budget` best candidates, in topological order (by depth, then as they were made)."""
    best = sorted(range(len(cands)), key=lambda i: (-cands[i].score, i))[:budget]
    order = sorted(best, key=lambda i: (cands[i].depth, i))
    node = {cid: n + 1 for n, cid in enumerate(order)}
    parents = [-1] + [0 if cands[i].parent < 0 else node[cands[i].parent] for i in order]
    tokens = torch.tensor([cands[i].token for i in order], dtype=torch.long, device=device)
    return TreeGuess(tokens, parents, max((cands[i].depth for i in order), default=0))
