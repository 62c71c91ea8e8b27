"""Batched proposers: one call drafts for every sequence of the batch that drafts.

The protocol, in a round's order (`seqs` are `sequence.Seq`, keyed by `seq.uid`):
- `start(seqs, fed, hidden)`: after the prefill; fed[b] the tokens fed, hidden[b] the target's states.
- `propose(seqs, ks)`: up to ks[b] draft tokens each, as a `Draft` (tokens [m_b], q [m_b, V] or None when greedy).
- `accept(seq, n, tokens, hidden)`: the verdict (`round.rollback`): n draft tokens accepted, the n+1 `tokens`
  emitted, `hidden` [n+1, d] the target's states at [last, d_1..d_n]; the proposer rolls its own state back to
  match. Every round, also one it did not draft in (`ngram+P`, k 0): the tokens then wait for its next draft.
- `drop(seq)`: the sequence finished or was preempted.
`taps` names the target layers whose outputs are the states it reads (an EAGLE head's), () the last layer's.
A draft, the MTP module or an EAGLE head keeps a slab of its own over the pool's page tables."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from .. import defaults
from ..backends.engines import Backend
from ..backends.native import MAX_T
from ..kv.pool import PagePool
from ..kv.step import BatchStep, build, in_order
from ..model.eagle import EagleHead
from ..model.llama import MTPModule, Transformer, head_matmul, unit_rms
from ..spec.head import Head
from ..spec.ngram import NgramLookup
from ..spec.suffix import SuffixCache, SuffixLookup
from ..spec.verify import Penalty, Warper, uniforms
from .forward import mtp_pass, slab_for, transformer_pass
from .sequence import Seq

Draft = tuple[Tensor, Tensor | None]  # a sequence's draft tokens [m], and q [m, V] (None: greedy)


class Proposer(Protocol):
    name: str
    taps: tuple[int, ...]

    def start(self, seqs: list[Seq], fed: list[Tensor], hidden: list[Tensor]) -> None: ...
    def propose(self, seqs: list[Seq], ks: list[int]) -> list[Draft]: ...
    def accept(self, seq: Seq, n: int, tokens: Tensor, hidden: Tensor) -> None: ...
    def drop(self, seq: Seq) -> None: ...


class NoProposer(Proposer):
    """No draft: the target alone; the protocol's own start, accept and drop, which do nothing."""

    name = "none"
    taps: tuple[int, ...] = ()

    def propose(self, seqs: list[Seq], ks: list[int]) -> list[Draft]:
        return [no_draft(seqs)] * len(seqs)


def no_draft(seqs: list[Seq]) -> Draft:
    """No draft token, one for the whole batch: a round's host work grows with its sequences."""
    return seqs[0].last[:0], None


def penalty_of(s: Seq) -> Penalty | None:
    """The repetition penalty `s`'s draft tokens are scored with, as its target rows are (None: none)."""
    return None if s.seen is None else Penalty(s.seen, s.req.sampling.repetition_penalty)


class NgramProposer:
    """The prompt lookup (`ngram.NgramLookup`), one per sequence: nothing to batch. With a `cache`, the suffix lookup
    (`suffix.SuffixLookup`) over every text written into it, each sequence's as it grows; without `share`, each
    sequence's over a cache of its own (its text alone)."""

    def __init__(
        self, vocab_size: int, min_n: int, max_n: int, draft_cost: float, cache: SuffixCache | None = None,
        share: bool = True,
    ) -> None:  # fmt: skip
        self.args = vocab_size, min_n, max_n, draft_cost
        self.cache, self.share = cache, share
        self.name = "ngram" if cache is None else "suffix"
        self.taps: tuple[int, ...] = ()
        self.each: dict[int, NgramLookup] = {}

    def start(self, seqs: list[Seq], fed: list[Tensor], hidden: list[Tensor]) -> None:
        for s, f in zip(seqs, fed, strict=True):
            if self.cache is None:
                lookup = NgramLookup(*self.args)
            else:
                lookup = SuffixLookup(self.cache if self.share else SuffixCache(self.cache.max_tokens), *self.args)
            self.each[s.uid] = lookup
            lookup.start(f, s.last)

    def propose(self, seqs: list[Seq], ks: list[int]) -> list[Draft]:
        none = no_draft(seqs)
        return [
            self.each[s.uid].propose(k, s.warp, s.gen, penalty_of(s)) if k else none
            for s, k in zip(seqs, ks, strict=True)
        ]

    def accept(self, seq: Seq, n: int, tokens: Tensor, hidden: Tensor) -> None:
        self.each[seq.uid].accept(tokens)  # (a round it was not asked in waits for its next lookup)

    def drop(self, seq: Seq) -> None:
        self.each.pop(seq.uid, None)


def pick(
    head: Head, h: Tensor, seqs: list[Seq], penalties: list[Penalty | None], tops: bool = False
) -> tuple[Tensor, list[Tensor | None], Tensor | None]:
    """Final states h [B, d] -> a draft token per sequence [B], its q [1, V] or None, penalised as its target row,
    and with `tops` each one's top probability [B] (greedy: the head's softmax's; sampled: q's)."""
    # [B, N]: the final norm scales a row by a positive number, which the argmax (and the penalty) need not see;
    # the probabilities do
    logits = head_matmul(unit_rms(h, head.eps) if tops else h, head.w, head.rows)
    for i, (s, pen) in enumerate(zip(seqs, penalties, strict=True)):
        if pen is not None and s.warp is None:
            logits[i : i + 1] = pen.apply(logits[i : i + 1], head.ids)
    best = logits.argmax(-1)  # [B]
    tokens = best if head.ids is None else head.ids[best]
    top = torch.softmax(logits, -1).gather(1, best[:, None])[:, 0] if tops else None
    qs: list[Tensor | None] = [None] * len(seqs)
    for i, s in enumerate(seqs):
        if s.warp is not None:
            x, q = head.pick(h[i : i + 1], s.warp, s.gen, penalties[i])
            tokens = tokens.index_copy(0, torch.tensor([i], device=tokens.device), x.view(1))
            qs[i] = q
            if top is not None:  # q's own confidence, not the drawn token's: a stop that read the draw would
                top[i] = q.max()  # bias the law of the draft tokens kept
    return tokens, qs, top


@dataclass
class _State:
    """A sequence in a model proposer's cache: its length, what waits to be fed, and what a round's rollback needs."""

    length: int = 0  # positions in the proposer's cache
    pending: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))  # tokens not yet fed
    pending_h: Tensor = field(default_factory=lambda: torch.empty(0))  # MTP: target states not yet fed
    drafting: bool = False  # whether this round drafts
    confirmed: int = 0  # its cache's length once the pending entries are fed
    fed: int = 0  # the draft tokens fed after them (k - 1: the last one is verified, never fed)
    # rounds without a draft (k 0 under load): their tokens (and MTP: states), joined to the pending ones when
    # next fed, not a copy of the whole backlog every round
    backlog: list[Tensor] = field(default_factory=list)
    backlog_h: list[Tensor] = field(default_factory=list)

    def begin(self, k: int) -> None:
        """A round asks for k draft tokens: what its rollback needs, recorded once."""
        self.drafting = k > 0
        if k:
            if self.backlog:  # joined to the pending entries, fed first
                self.pending = torch.cat([self.pending, *self.backlog])
                self.backlog.clear()
            if self.backlog_h:
                self.pending_h = torch.cat([self.pending_h, *self.backlog_h])
                self.backlog_h.clear()
            self.confirmed, self.fed = self.length + self.pending.shape[0], k - 1

    def rollback(self, n: int, tokens: Tensor, hidden: Tensor | None) -> None:
        """The verdict: the cache keeps its confirmed entries, and a draft's the fed draft tokens accepted (their K/V
        are its own); the MTP module's (`hidden` given) none of its chained ones. The rest waits to be fed."""
        if not self.drafting:  # another proposer's draft, or none: these wait whole
            self.backlog.append(tokens)
            if hidden is not None:
                self.backlog_h.append(hidden)
            return
        self.drafting = False
        stay = 0 if hidden is not None else min(n, self.fed)
        self.length = self.confirmed + stay
        self.pending = tokens[stay:]
        if hidden is not None:
            self.pending_h = hidden


class ModelProposer:
    """What a draft and the MTP module share: the state per sequence, the slab, the draft loop, the rollback."""

    name = "model"
    reads_states = False  # the MTP module reads the target's states (and keeps none of its chained entries)
    taps: tuple[int, ...] = ()
    min_top = 0.0  # a draft token less likely than this (to the proposer) ends its draft, dropped (EAGLE-2)

    def __init__(self, model: Transformer | MTPModule, pool: PagePool, head: Head, backend: Backend) -> None:
        self.pool, self.head = pool, head
        self.slab = slab_for(model, pool.n_pages * pool.page_size, head.device)
        self.steps = backend.steps(model)  # None: eager
        self.state: dict[int, _State] = {}

    def _step(self, seqs: list[Seq], counts: list[int]) -> BatchStep:
        """The pass over counts[b] new entries of each sequence, after its cache's: their lengths advance."""
        starts = [self.state[s.uid].length for s in seqs]
        for s, n in zip(seqs, counts, strict=True):
            self.state[s.uid].length += n
        return build([self.pool.tables[s.uid] for s in seqs], starts, counts, self.pool.page_size, self.slab.device)

    feed_pending: Callable[[list[Seq]], Tensor]  # each subclass's: pending entries in -> states after each last [G, d]
    _feed_draft: Callable[[list[Seq], Tensor, Tensor], Tensor]  # then a draft token each, fed on the states `out`

    def begin(self, seqs: list[Seq], ks: list[int]) -> None:
        for s, k in zip(seqs, ks, strict=True):
            self.state[s.uid].begin(k)

    def propose(self, seqs: list[Seq], ks: list[int]) -> list[Draft]:
        self.begin(seqs, ks)
        if len(seqs) == 1 and ks[0] > 0 and (got := self._chain(seqs[0], ks[0])) is not None:
            return [got]
        return self._draft(seqs, ks)

    def _draft(self, seqs: list[Seq], ks: list[int]) -> list[Draft]:
        """The batch's draft tokens depth by depth: one pass over every sequence still drafting, each depth."""
        live = [i for i, k in enumerate(ks) if k > 0]
        tokens: list[list[Tensor]] = [[] for _ in seqs]
        qs: list[list[Tensor | None]] = [[] for _ in seqs]
        if live:
            ks = list(ks)  # a sequence's, cut where its draft stops early
            group = [seqs[i] for i in live]
            # each sequence's penalty, on a copy that takes in its draft tokens as the next one's context
            pens = [None if k == 0 or (p := penalty_of(s)) is None else p.copy() for s, k in zip(seqs, ks, strict=True)]
            out = self.feed_pending(group)  # [G, d]: the state after each one's last confirmed token
            x = out.new_empty(0, dtype=torch.long)  # the previous depth's draft tokens
            for depth in range(max(ks)):
                if depth:
                    still = [j for j, i in enumerate(live) if ks[i] > depth]
                    if not still:  # every draft stopped early
                        break
                    live = [live[j] for j in still]
                    group = [seqs[i] for i in live]
                    idx = torch.tensor(still, device=out.device)
                    out = self._feed_draft(group, out.index_select(0, idx), x.index_select(0, idx))
                x, q, top = pick(self.head, out, group, [pens[i] for i in live], self.min_top > 0)
                low = [] if top is None else (top < self.min_top).tolist()
                for j, i in enumerate(live):
                    if low and low[j]:
                        ks[i] = depth  # this token dropped, the draft ends
                        continue
                    tokens[i].append(x[j : j + 1])
                    qs[i].append(q[j])
                    if (pen := pens[i]) is not None:
                        pen.take(x[j : j + 1])
        none = no_draft(seqs)
        return [
            (torch.cat(t), None if q[0] is None else torch.cat(q)) if t else none  # type: ignore[arg-type]
            for t, q in zip(tokens, qs, strict=True)
        ]

    def _chain(self, s: Seq, k: int) -> Draft | None:
        """k draft tokens for `s` alone in one native call, its pending entries fed first; None where it cannot
        serve (no native steps, a backlog longer than a pass, pages out of order, filters beside the temperature)."""
        st, steps = self.state[s.uid], self.steps
        if steps is None or not (s.warp is None or isinstance(s.warp, Warper)):
            return None
        L, m = st.length, st.pending.shape[0]
        end = L + m + k - 1  # the catch-up's m entries, then the chain's k - 1
        table = self.pool.tables[s.uid]
        n_pages = self.pool.pages_for(end)
        if not 0 < m <= MAX_T or end > steps.positions or len(table) < n_pages:
            return None
        if (first := in_order(table, n_pages)) is None:
            return None
        base = first * self.pool.page_size
        view = self.slab[:, :, :, base : base + end]
        h = st.pending_h if self.reads_states else None
        sampled = () if s.warp is None else (1.0 / s.warp.temperature, uniforms((k,), s.gen, self.slab))
        tokens, q = steps.chain(
            self.head.ids, k, view, L, (st.pending, h), *sampled, penalty=penalty_of(s), min_top=self.min_top
        )
        st.length = end
        made = int((tokens >= 0).sum()) if self.min_top else k
        return tokens[:made], None if s.warp is None else self.head.expand(q[:made])

    def accept(self, seq: Seq, n: int, tokens: Tensor, hidden: Tensor) -> None:
        self.state[seq.uid].rollback(n, tokens, hidden if self.reads_states else None)

    def drop(self, seq: Seq) -> None:
        self.state.pop(seq.uid, None)


class DraftProposer(ModelProposer):
    def __init__(self, model: Transformer, pool: PagePool, head: Head, name: str, backend: Backend) -> None:
        super().__init__(model, pool, head, backend)
        self.model, self.name = model, name

    def start(self, seqs: list[Seq], fed: list[Tensor], hidden: list[Tensor]) -> None:
        for s in seqs:
            self.state[s.uid] = _State(pending=s.last.view(1))
        b = self._step(seqs, [f.shape[0] for f in fed])
        transformer_pass(self.model, self.slab, torch.cat(fed), b, "none", self.steps)

    def feed_pending(self, seqs: list[Seq]) -> Tensor:
        pend = [self.state[s.uid].pending for s in seqs]
        b = self._step(seqs, [p.shape[0] for p in pend])
        _, x = transformer_pass(self.model, self.slab, torch.cat(pend), b, "none", self.steps)
        return x[b.last]

    def _feed_draft(self, seqs: list[Seq], out: Tensor, x: Tensor) -> Tensor:
        b = self._step(seqs, [1] * len(seqs))
        return transformer_pass(self.model, self.slab, x, b, "none", self.steps)[1]


class MTPProposer(ModelProposer):
    """The MTP module: pairs (target state h_j, token j+1) in, the target's head out. An EAGLE head: the same, its
    state h_j fused from the target's `taps`, its own head out."""

    name = "mtp"
    reads_states = True

    def __init__(self, target: Transformer, mtp: MTPModule, pool: PagePool, head: Head, backend: Backend) -> None:
        super().__init__(mtp, pool, head, backend)
        self.target, self.mtp = target, mtp
        self.eagle = mtp if isinstance(mtp, EagleHead) else None
        if self.eagle is not None:
            self.name, self.taps, self.min_top = "eagle", self.eagle.taps, defaults.EAGLE_MIN_TOP

    def states(self, hidden: Tensor) -> Tensor:
        """The target's states as handed on (an EAGLE head's taps: fused) -> the module's h [n, d]."""
        return hidden if self.eagle is None else self.eagle.fuse(hidden)

    def start(self, seqs: list[Seq], fed: list[Tensor], hidden: list[Tensor]) -> None:
        for s, f, h in zip(seqs, fed, hidden, strict=True):
            self.state[s.uid] = _State(pending=torch.cat([f[1:], s.last.view(1)]), pending_h=self.states(h))

    def accept(self, seq: Seq, n: int, tokens: Tensor, hidden: Tensor) -> None:
        self.state[seq.uid].rollback(n, tokens, self.states(hidden))

    def feed(self, b: BatchStep, h: Tensor, x: Tensor) -> Tensor:
        """Pairs (h [N, d], x [N]) through the module at `b` -> its states [N, d]."""
        return mtp_pass(self.mtp, self.target, self.slab, h, x, b, self.steps)

    def feed_pending(self, seqs: list[Seq]) -> Tensor:
        sts = [self.state[s.uid] for s in seqs]
        b = self._step(seqs, [st.pending.shape[0] for st in sts])
        return self.feed(b, torch.cat([st.pending_h for st in sts]), torch.cat([st.pending for st in sts]))[b.last]

    def _feed_draft(self, seqs: list[Seq], out: Tensor, x: Tensor) -> Tensor:
        return self.feed(self._step(seqs, [1] * len(seqs)), out, x)  # chained on the module's own state


class FallbackProposer:
    """The n-gram (or suffix) lookup where it matches, the model proposer for the other sequences."""

    def __init__(self, first: NgramProposer, other: ModelProposer) -> None:
        self.first, self.other = first, other
        self.name, self.taps = f"{first.name}+{other.name}", other.taps

    def start(self, seqs: list[Seq], fed: list[Tensor], hidden: list[Tensor]) -> None:
        self.first.start(seqs, fed, hidden)
        self.other.start(seqs, fed, hidden)

    def propose(self, seqs: list[Seq], ks: list[int]) -> list[Draft]:
        mine = self.first.propose(seqs, ks)
        rest = [k if d[0].shape[0] == 0 else 0 for d, k in zip(mine, ks, strict=True)]
        theirs = self.other.propose(seqs, rest)
        return [t if r else d for d, t, r in zip(mine, theirs, rest, strict=True)]

    def accept(self, seq: Seq, n: int, tokens: Tensor, hidden: Tensor) -> None:
        self.first.accept(seq, n, tokens, hidden)
        self.other.accept(seq, n, tokens, hidden)

    def drop(self, seq: Seq) -> None:
        self.first.drop(seq)
        self.other.drop(seq)
