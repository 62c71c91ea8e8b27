"""Prefill, and one round: one target pass over every sequence's last token and guesses (ragged,
0..k), each sequence verified on its own rows and rolled back to what it kept; one host sync."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import defaults as D
from ..backends import native
from ..model.llama import Transformer
from ..spec.sampling import NonFiniteError, context_mask, finite_flag, first_token
from ..spec.tree import tree_mask, verify_tree_greedy, verify_tree_sample
from ..spec.verify import Warper, penalize, verify_sample
from . import batch as B
from .forward import transformer_pass
from .pool import PagePool
from .proposers import BatchProposer, MTPGuess
from .sequence import Seq
from .tree_guess import grow


@dataclass
class TargetRunner:
    """The target, the slab its K/V live in (over the pool's pages), its native steps (None: eager)."""

    model: Transformer
    slab: Tensor
    pool: PagePool
    steps: native.NativeSteps | None = None

    def step(self, seqs: list[Seq], counts: list[int]) -> B.BatchStep:
        tables = [self.pool.tables[s.uid] for s in seqs]
        return B.build(tables, [s.cached for s in seqs], counts, self.pool.page_size, self.slab.device)

    def verify_pass(self, seqs: list[Seq], ids: Tensor, counts: list[int]) -> tuple[Tensor, Tensor, Tensor | None]:
        """ids [N] (counts[b] new tokens of seqs[b], from its cached length) -> logits [N, V], hidden
        [N, d], and from a native step each row's argmax and the finite flag [N + 1] (else None)."""
        got = self.one_pass(seqs, ids, counts, head=True)
        if got is not None:
            return got
        if self.steps is not None:  # the argmaxes and the finite flag computed in the pass
            top = torch.empty(int(ids.shape[0]) + 1, dtype=torch.long)
            logits, hidden = self.steps.batch(ids, None, self.slab, self.step(seqs, counts), "all", top)
            return logits, hidden, top
        return *transformer_pass(self.model, self.slab, ids, self.step(seqs, counts), "all"), None

    def one_pass(
        self, seqs: list[Seq], ids: Tensor, counts: list[int], head: bool
    ) -> tuple[Tensor, Tensor, Tensor | None] | None:
        """`verify_pass` through the native step, for a sequence alone whose pages lie in order; else None."""
        if len(seqs) != 1 or self.steps is None:
            return None
        s, T = seqs[0], counts[0]
        table = self.pool.tables[s.uid]
        page = B.in_order(table, len(table))
        if page is None or not self.steps.serves(s.cached, s.cached + T):
            return None
        base = page * self.pool.page_size
        past = self.slab[:, :, :, base : base + s.cached]  # [L, K or V, Hkv, start, D]: a view
        logits, hidden, _, top = self.steps.step(ids.contiguous(), past, head)
        return logits, hidden, top


def prefill(t: TargetRunner, proposer: BatchProposer, seqs: list[Seq]) -> list[int | None]:
    """Fill the target's cache for `seqs` -> each one's first new token (None if recomputed: already emitted)."""
    dev = t.slab.device
    fresh = [s.n_generated == 0 for s in seqs]
    fed = [
        torch.tensor(s.tokens[s.cached :] if f else s.tokens[s.cached : -1], dtype=torch.long, device=dev)
        for s, f in zip(seqs, fresh, strict=True)
    ]
    counts = [x.shape[0] for x in fed]
    got = t.one_pass(seqs, torch.cat(fed), counts, head=False)  # a prompt alone: the model's step
    if got is not None:
        hidden = got[1]  # [N, d]
        logits = t.model.logits(hidden[-1:])  # [1, V]: the last position's alone
    else:  # logits [B, V] of each sequence's last position, hidden [N, d]
        logits, hidden = transformer_pass(t.model, t.slab, torch.cat(fed), t.step(seqs, counts), "last", t.steps)
    firsts = []
    states = list(hidden.split(counts))
    for i, (s, f) in enumerate(zip(seqs, fresh, strict=True)):
        s.cached += counts[i]
        if s.req.session is not None:  # its proposer starts over the whole conversation, not this part
            s.states = [*(s.states or []), states[i].clone()]
            states[i] = torch.cat(s.states)
            fed[i] = torch.tensor(s.tokens[: s.cached], dtype=torch.long, device=dev)
        if f:  # drawn from the prompt's last logits
            s.last, s.seen = first_token(logits[i : i + 1], fed[i], s.warp, s.gen, s.req.sampling.repetition_penalty)
        else:  # recomputed: its next token was emitted before the preemption
            s.last = torch.tensor(s.tokens[-1:], dtype=torch.long, device=dev)
            if s.req.sampling.penalized:
                s.seen = context_mask(torch.tensor(s.tokens, device=dev), logits.shape[-1])
        firsts.append(s.last.view(1))
    values = torch.cat([*firsts, finite_flag(logits)]).tolist()  # one sync
    if values[-1] != 1:
        raise NonFiniteError("the target's logits are not finite (NaN or inf)")
    proposer.start(seqs, fed, states)
    return [v if f else None for v, f in zip(values[:-1], fresh, strict=True)]


def decode_round(t: TargetRunner, proposer: BatchProposer, seqs: list[Seq]) -> list[tuple[int, int, list[int]]]:
    """One round over `seqs` -> per sequence (guesses offered m, kept n, the tokens emitted)."""
    t0 = time.perf_counter()
    guesses = proposer.propose(seqs, [s.k for s in seqs])
    guessed_s = time.perf_counter() - t0
    counts = [g[0].shape[0] + 1 for g in guesses]
    if len(seqs) > 1 and max(counts) == 1:  # no guesses (the target alone, or k capped under load): from the host
        ids = torch.tensor([s.tokens[-1] for s in seqs], device=t.slab.device)  # (a running `last` is its last token)
    else:
        fed_each = [
            torch.cat([s.last.view(1), g[0]]) if c > 1 else s.last.view(1)
            for s, g, c in zip(seqs, guesses, counts, strict=True)
        ]
        ids = fed_each[0] if len(seqs) == 1 else torch.cat(fed_each)  # [N]
    logits, hidden, top = t.verify_pass(seqs, ids, counts)  # [N, V], [N, d], [N + 1] or None
    if top is None:  # [N]: greedy sequences are verified on the host from these (none to verify: no argmax)
        top = torch.cat([logits.argmax(-1) if any(s.warp is None for s in seqs) else ids, finite_flag(logits)])
    sampled = []  # top: each row's argmax [N], then the finite flag
    first = 0
    fast = t.steps is not None  # native steps: a sequence's penalty, and its sampled verdict, in one call each
    for s, g, c in zip(seqs, guesses, counts, strict=True):
        if s.seen is None and s.warp is None:  # greedy: `top` holds its verdict
            first += c
            continue
        rows = logits[first : first + c]  # [m+1, V]
        if s.seen is not None:  # each row scored with the context up to its own position
            fed, penalty = ids[first : first + c], s.req.sampling.repetition_penalty
            if fast:  # in place, with the argmaxes
                best = native.penalize_argmax(rows, s.seen, fed, penalty)
            else:
                rows = penalize(rows, s.seen, fed, penalty)
                best = rows.argmax(-1)
            if s.warp is None:
                top[first : first + c] = best
        if fast and isinstance(s.warp, Warper):  # the rule below
            sampled.append(native.verify_sample(rows, s.warp, *g, s.gen))
        elif s.warp is not None:
            drafts, q = g
            p = s.warp(rows)  # [m+1, V]
            n, out = verify_sample(drafts[None], (p[:0] if q is None else q)[None], p[None], s.gen)
            sampled.append(torch.cat([n, out[0]]))
        first += c
    N = sum(counts)
    values = torch.cat([ids, top, *sampled]).tolist()  # the one sync: fed [N], argmaxes [N], finite, verdicts
    if values[2 * N] != 1:
        raise NonFiniteError("the target's logits are not finite (NaN or inf)")
    fed, top, rest = values[:N], values[N : 2 * N], values[2 * N + 1 :]
    verdicts: list[tuple[int, int, list[int]]] = []
    first = 0
    for s, c in zip(seqs, counts, strict=True):
        m = c - 1
        if s.warp is None:
            n = 0
            while n < m and fed[first + 1 + n] == top[first + n]:
                n += 1
            emitted = top[first : first + n + 1]
        else:
            n, emitted = rest[0], rest[1 : 2 + rest[0]]
            rest = rest[m + 2 :]
        verdicts.append((m, n, emitted))
        first += c
    outs = torch.tensor([x for v in verdicts for x in v[2]], device=hidden.device).split([v[1] + 1 for v in verdicts])
    for s, (m, n, _), out, h in zip(seqs, verdicts, outs, hidden.split(counts), strict=True):
        commit(t, proposer, s, m, n, out, h if n == m else h[: n + 1])
    _clock(seqs, t0, guessed_s)
    return verdicts


def _clock(seqs: list[Seq], t0: float, guessed_s: float) -> None:
    spent = time.perf_counter() - t0
    for s in seqs:
        s.stats.propose_s += guessed_s
        s.stats.round_s += spent


def commit(t: TargetRunner, proposer: BatchProposer, s: Seq, m: int, n: int, out: Tensor, hidden: Tensor) -> None:
    """Keep what a round verified for `s`: `out` [n+1] the tokens emitted, `hidden` [n+1, d] the target's
    states of [last, d_1..d_n]."""
    s.cached += n + 1  # rollback: [last, d_1..d_n] stay, the rest is past the length
    proposer.accept(s, n, out, hidden)
    t.pool.trim(s.uid, s.cached)  # pages past the kept positions go back
    s.last = out if n == 0 else out[n : n + 1]
    if s.seen is not None:
        s.seen.index_fill_(0, out, True)
    if s.states is not None:
        s.states.append(hidden.clone())
    st = s.stats
    st.passes += 1
    st.proposed += m
    st.accepted += n
    st.guessed[m] += 1
    for i in range(n):
        st.accepted_at[i] += 1


def tree_round(
    t: TargetRunner, proposer: MTPGuess, seqs: list[Seq], budget: int, width: int
) -> list[tuple[int, int, list[int]]]:
    """`decode_round` with token trees, m the tree's depth; the kept path's K/V move to follow the cache."""
    width, drawn = min(width, budget), min(D.TREE_DRAWS, budget)
    t0 = time.perf_counter()
    trees = grow(proposer, seqs, budget, width, drawn)
    guessed_s = time.perf_counter() - t0
    dev = t.slab.device
    fed = [torch.cat([s.last.view(1), tr.tokens]) for s, tr in zip(seqs, trees, strict=True)]
    ids = torch.cat(fed)  # [N]
    tables = [t.pool.tables[s.uid] for s in seqs]
    every = [list(range(len(tr.parents))) for tr in trees]
    b = B.build_tree(tables, [s.cached for s in seqs], [tr.parents for tr in trees], every, t.pool.page_size, dev)
    logits, hidden = transformer_pass(t.model, t.slab, ids, b, "all", t.steps)  # [N, V], [N, d]
    verdicts_t = []
    first = 0
    for s, tr, f in zip(seqs, trees, fed, strict=True):
        c = f.shape[0]
        parents = torch.tensor(tr.parents, device=dev)  # [c]
        rows = logits[first : first + c]  # [c, V]
        if s.seen is not None:  # each node scored with the context of its own path
            rows = penalize(rows, s.seen, f, s.req.sampling.repetition_penalty, tree_mask(parents))
        if s.warp is None:
            v = verify_tree_greedy(f[None], parents, rows[None])
        else:  # children drawn from q: SpecInfer's rule
            p = s.warp(rows)  # [c, V]
            q = tr.q if tr.q is not None else torch.zeros_like(p)  # no guess: nothing was drawn
            v = verify_tree_sample(f[None], parents, p[None], q[None], s.gen, width=drawn)
        verdicts_t.append(torch.cat([v.n, v.out[0], v.nodes[0]]))
        first += c
    values = torch.cat([*verdicts_t, finite_flag(logits)]).tolist()  # the one sync
    if values[-1] != 1:
        raise NonFiniteError("the target's logits are not finite (NaN or inf)")
    verdicts: list[tuple[int, int, list[int]]] = []
    first = at = 0
    for s, tr, f in zip(seqs, trees, fed, strict=True):
        c = f.shape[0]
        n = values[at]
        emitted, nodes = values[at + 1 : at + 2 + n], values[at + 1 + c : at + 2 + c + n]  # out, the kept path
        at += 1 + 2 * c
        if nodes[1:] != list(range(1, n + 1)):  # the kept guesses' K/V, from their nodes' slots to after `last`
            src = [t.pool.slot(s.uid, s.cached + i) for i in nodes[1:]]
            dst = [t.pool.slot(s.uid, s.cached + j) for j in range(1, n + 1)]
            moved = t.slab.index_select(3, torch.tensor(src, device=dev))
            t.slab.index_copy_(3, torch.tensor(dst, device=dev), moved)
        path = torch.tensor([first + i for i in nodes], device=dev)
        out = torch.tensor(emitted, dtype=torch.long, device=dev)
        commit(t, proposer, s, tr.depth, n, out, hidden.index_select(0, path))
        verdicts.append((tr.depth, n, emitted))
        first += c
    _clock(seqs, t0, guessed_s)
    return verdicts
