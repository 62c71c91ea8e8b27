"""One round of speculative decoding over a batch, in four steps:

1. draft: the proposer drafts up to k tokens d_1..d_m for each sequence (sampled: with the q they were drawn from);
2. verify: one target pass over every sequence's [last, d_1..d_m] (ragged, flattened), then each one's verdict by
   `spec.verify`'s rules (greedy: the drafts equal to the target's argmax are accepted; sampled: Leviathan et al.'s),
   read back in one host sync for the whole batch;
3. accept/rollback (`rollback`): the target's cache keeps [last, d_1..d_n], the n accepted; the positions past them
   and their pages go back; the proposer rolls its own state back to the same point;
4. commit (`commit`): the n accepted tokens and the target's own (the bonus token when n == m, else the correction)
   join the sequence.
`tree_round` drafts a tree instead (`tree_proposer`, verified by `spec.tree`'s rules) and shares steps 3 and 4."""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
from torch import Tensor

from ..spec.sampling import finite_flag
from ..spec.tree import tree_mask, verify_tree_greedy, verify_tree_sample
from ..spec.verify import penalize, verify_greedy
from .proposers import Draft, Proposer
from .sequence import Seq
from .target import TargetRunner, read_back
from .tree_proposer import TreeProposer


class RoundResult(NamedTuple):
    """One sequence's round (a tuple: made for every sequence every round, as cheap as one)."""

    drafted: int  # m, the draft tokens verified
    accepted: int  # n <= m
    tokens: list[int]  # emitted: the n accepted, then the target's own (the bonus token when n == m)


def decode_round(t: TargetRunner, proposer: Proposer, seqs: list[Seq]) -> list[RoundResult]:
    """One round over `seqs`: draft -> verify -> accept/rollback -> commit."""
    t0 = time.perf_counter()
    drafts = proposer.propose(seqs, [s.k for s in seqs])
    drafted_s = time.perf_counter() - t0
    results, states = verify(t, seqs, drafts)
    _finish(t, proposer, seqs, results, states, t0, drafted_s)
    return results


def verify(t: TargetRunner, seqs: list[Seq], drafts: list[Draft]) -> tuple[list[RoundResult], list[Tensor]]:
    """Step 2 for every sequence (its rows penalised first where its request asks) -> the results, and the target's
    states [n+1, d] at [last, d_1..d_n] of each."""
    counts = [d[0].shape[0] + 1 for d in drafts]
    if len(seqs) > 1 and max(counts) == 1:  # no draft (the target alone, or k capped under load): from the host
        ids = torch.tensor([s.tokens[-1] for s in seqs], device=t.slab.device)  # (`last` is its last token)
    else:
        each = zip(seqs, drafts, counts, strict=True)
        fed = [torch.cat([s.last.view(1), d[0]]) if c > 1 else s.last.view(1) for s, d, c in each]
        ids = fed[0] if len(seqs) == 1 else torch.cat(fed)  # [N]
    logits, hidden, top = t.verify_pass(seqs, ids, counts)  # [N, V], [N, d], [N + 1] or None
    if top is None:  # [N] and the finite flag (no greedy sequence: no argmax wanted, the ids stand in)
        top = torch.cat([logits.argmax(-1) if any(s.warp is None for s in seqs) else ids, finite_flag(logits)])
    sampled = []  # each sampled sequence's [m + 2]: n, then its m + 1 tokens
    first = 0
    for s, (d, q), c in zip(seqs, drafts, counts, strict=True):
        if s.seen is not None or s.warp is not None:  # (a greedy one without a penalty: `top` has its argmaxes)
            rows = logits[first : first + c]  # [m+1, V]
            if s.seen is not None:  # each row scored with the context up to its own position
                rows, best = t.penalize(rows, s, ids[first : first + c])
                if s.warp is None:
                    top[first : first + c] = best
            if s.warp is not None:
                sampled.append(t.verify_sample(rows, s.warp, d, q, s.gen))
        first += c
    N = sum(counts)
    values = read_back([ids, top, *sampled], flag=2 * N)  # fed [N], argmaxes [N], finite, verdicts
    fed_ids, best, at = values[:N], values[N : 2 * N], 2 * N + 1
    results = []
    first = 0
    for s, c in zip(seqs, counts, strict=True):
        if s.warp is None:
            n = verify_greedy(fed_ids[first + 1 : first + c], best[first : first + c])
            results.append(RoundResult(c - 1, n, best[first : first + n + 1]))
        else:
            n = values[at]
            results.append(RoundResult(c - 1, n, values[at + 1 : at + n + 2]))
            at += c + 1
        first += c
    each = zip(results, hidden.split(counts), strict=True)
    return results, [h if r.accepted == r.drafted else h[: r.accepted + 1] for r, h in each]


def tree_round(t: TargetRunner, trees: TreeProposer, seqs: list[Seq]) -> list[RoundResult]:
    """`decode_round` with draft trees (m: a tree's depth): the accepted path's K/V move to follow the cache."""
    t0 = time.perf_counter()
    drafts = trees.propose(seqs)
    drafted_s = time.perf_counter() - t0
    fed = [torch.cat([s.last.view(1), tr.tokens]) for s, tr in zip(seqs, drafts, strict=True)]
    logits, hidden = t.tree_pass(seqs, torch.cat(fed), [tr.parents for tr in drafts])  # [N, V], [N, d]
    verdicts = []
    first = 0
    for s, tr, f in zip(seqs, drafts, fed, strict=True):
        parents, rows = torch.tensor(tr.parents, device=f.device), logits[first : first + f.shape[0]]  # [c], [c, V]
        if s.seen is not None:  # each node scored with the context of its own path
            rows = penalize(rows, s.seen, f, s.req.sampling.repetition_penalty, tree_mask(parents))
        if s.warp is None:
            v = verify_tree_greedy(f[None], parents, rows[None])
        else:  # children drawn from q: SpecInfer's rule
            p = s.warp(rows)  # [c, V]
            q = tr.q if tr.q is not None else torch.zeros_like(p)  # no draft: nothing was drawn
            v = verify_tree_sample(f[None], parents, p[None], q[None], s.gen, width=trees.drawn)
        verdicts.append(torch.cat([v.n, v.out[0], v.nodes[0]]))
        first += f.shape[0]
    values = read_back([*verdicts, finite_flag(logits)], flag=-1)
    results, states = [], []
    first = at = 0
    for s, tr, f in zip(seqs, drafts, fed, strict=True):
        c, n = f.shape[0], values[at]
        nodes = values[at + 1 + c : at + 2 + c + n]  # the accepted path
        if nodes[1:] != list(range(1, n + 1)):  # its draft tokens' K/V, from their nodes' slots to after `last`
            t.move(s, nodes[1:], list(range(1, n + 1)))
        states.append(hidden.index_select(0, torch.tensor([first + i for i in nodes], device=hidden.device)))
        results.append(RoundResult(tr.depth, n, values[at + 1 : at + 2 + n]))
        first, at = first + c, at + 1 + 2 * c
    _finish(t, trees.mtp, seqs, results, states, t0, drafted_s)
    return results


def _finish(
    t: TargetRunner, proposer: Proposer, seqs: list[Seq], results: list[RoundResult], states: list[Tensor],
    t0: float, drafted_s: float,
) -> None:  # fmt: skip
    """Steps 3 and 4 for each sequence (`states` [n+1, d]: the target's at [last, d_1..d_n]); the round's clock."""
    flat = [x for r in results for x in r.tokens]
    emitted = torch.tensor(flat, device=t.slab.device).split([r.accepted + 1 for r in results])
    for s, r, tokens, h in zip(seqs, results, emitted, states, strict=True):
        rollback(t, proposer, s, r.accepted, tokens, h)
        commit(s, r, tokens, h)
    spent = time.perf_counter() - t0
    for s in seqs:
        s.stats.propose_s += drafted_s
        s.stats.round_s += spent


def rollback(t: TargetRunner, proposer: Proposer, s: Seq, n: int, tokens: Tensor, states: Tensor) -> None:
    """The round's one rollback: the target's cache keeps [last, d_1..d_n] (stale K/V past its length are never
    read) and the pages past them go back to the pool; then the proposer rolls its own state back to match."""
    s.cached += n + 1
    t.pool.trim(s.uid, s.cached)
    proposer.accept(s, n, tokens, states)


def commit(s: Seq, r: RoundResult, tokens: Tensor, states: Tensor) -> None:
    """The emitted `tokens` [n+1] join `s`: the last one is fed next round; its counters count the round."""
    n = r.accepted
    s.last = tokens if n == 0 else tokens[n : n + 1]
    if s.seen is not None:
        s.seen.index_fill_(0, tokens, True)
    if s.states is not None:
        s.states.append(states.clone())
    st = s.stats
    st.passes += 1
    st.proposed += r.drafted
    st.accepted += n
    st.rounds_by_drafted[r.drafted] += 1
    for i in range(n):
        st.accepted_at[i] += 1
