"""Batched proposers: one call guesses for every sequence of the batch that guesses.

The protocol, in the engine's order (`seqs` are `sequence.Seq`, keyed by `seq.uid`):
- `start(seqs, fed, hidden)`: after the prefill; fed[b] the tokens fed, hidden[b] the target's states.
- `propose(seqs, ks)`: up to ks[b] guesses each, as (tokens [m_b], q [m_b, V] or None when greedy).
- `accept(seq, n, emitted, hidden)`: n guesses kept, n+1 tokens emitted, `hidden` [n+1, d] at [last, d_1..d_n];
  every round, also after another proposer guessed (`ngram+P`): the tokens then wait for its next guess.
- `drop(seq)`: the sequence finished or was preempted.
A draft or the MTP module keeps a slab of its own over the pool's page tables."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..backends.engines import Backend
from ..backends.native import MAX_T
from ..model.llama import MTPModule, Transformer, head_matmul
from ..spec.head import Head
from ..spec.ngram import NgramProposer
from ..spec.verify import Penalty, Warper, uniforms
from . import batch as B
from .forward import mtp_pass, slab_for, transformer_pass
from .pool import PagePool
from .sequence import Seq

Guesses = tuple[torch.Tensor, torch.Tensor | None]


class BatchProposer(Protocol):
    name: str

    def start(self, seqs: list[Seq], fed: list[torch.Tensor], hidden: list[torch.Tensor]) -> None: ...

    def propose(self, seqs: list[Seq], ks: list[int]) -> list[Guesses]: ...

    def accept(self, seq: Seq, n: int, emitted: torch.Tensor, hidden: torch.Tensor) -> None: ...

    def drop(self, seq: Seq) -> None: ...


class NoGuess(BatchProposer):
    """No guess: the protocol's own start, accept and drop, which do nothing."""

    name = "none"

    def propose(self, seqs: list[Seq], ks: list[int]) -> list[Guesses]:
        return [no_guess(seqs)] * len(seqs)


def no_guess(seqs: list[Seq]) -> Guesses:
    """No guess, one for the whole batch: a round's host work grows with its sequences."""
    return seqs[0].last[:0], None


def penalty_of(s: Seq) -> Penalty | None:
    """The repetition penalty `s`'s guesses are scored with, as its target rows are (None: none)."""
    return None if s.seen is None else Penalty(s.seen, s.req.sampling.repetition_penalty)


class NgramGuess:
    """The prompt lookup (`ngram.NgramProposer`), one index per sequence: nothing to batch."""

    name = "ngram"

    def __init__(self, vocab_size: int, min_n: int, max_n: int, guess_cost: float) -> None:
        self.args = vocab_size, min_n, max_n, guess_cost
        self.each: dict[int, NgramProposer] = {}

    def start(self, seqs: list[Seq], fed: list[torch.Tensor], hidden: list[torch.Tensor]) -> None:
        for s, f, h in zip(seqs, fed, hidden, strict=True):
            self.each[s.uid] = p = NgramProposer(*self.args)
            p.start(f, s.last, h)

    def propose(self, seqs: list[Seq], ks: list[int]) -> list[Guesses]:
        none = no_guess(seqs)
        return [
            self.each[s.uid].propose(k, s.warp, s.gen, penalty_of(s)) if k else none
            for s, k in zip(seqs, ks, strict=True)
        ]

    def accept(self, seq: Seq, n: int, emitted: torch.Tensor, hidden: torch.Tensor) -> None:
        self.each[seq.uid].accept(n, emitted, hidden)  # (a round it was not asked in waits for its next lookup)

    def drop(self, seq: Seq) -> None:
        self.each.pop(seq.uid, None)


def pick(
    head: Head, h: torch.Tensor, seqs: list[Seq], penalties: list[Penalty | None]
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Final states h [B, d] -> a guess per sequence [B] and its q [1, V] or None, penalised as its target row."""
    logits = head_matmul(h, head.w, head.rows)  # [B, N]: the final norm scales a row, the argmax needs none
    for i, (s, pen) in enumerate(zip(seqs, penalties, strict=True)):
        if pen is not None and s.warp is None:
            logits[i : i + 1] = pen.apply(logits[i : i + 1], head.ids)
    best = logits.argmax(-1)  # [B]
    tokens = best if head.ids is None else head.ids[best]
    qs: list[torch.Tensor | None] = [None] * len(seqs)
    for i, s in enumerate(seqs):
        if s.warp is not None:
            x, q = head.pick(h[i : i + 1], s.warp, s.gen, penalties[i])
            tokens = tokens.index_copy(0, torch.tensor([i], device=tokens.device), x.view(1))
            qs[i] = q
    return tokens, qs


@dataclass
class _State:
    length: int = 0  # positions in the proposer's cache
    pending: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))  # tokens not yet fed
    pending_h: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # MTP: target states not yet fed
    fed_guesses: int = 0  # draft: guesses fed to its cache this round
    true_len: int = 0  # MTP: entries computed from the target's own states
    proposed: bool = False
    # rounds without guesses (k 0 under load): their tokens (and MTP: states), joined to the pending ones when
    # next fed, not a copy of the whole backlog every round
    backlog: list[torch.Tensor] = field(default_factory=list)
    backlog_h: list[torch.Tensor] = field(default_factory=list)

    def wait(self, emitted: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        self.backlog.append(emitted)
        if hidden is not None:
            self.backlog_h.append(hidden)

    def settle(self) -> _State:
        """The backlog joined to `pending` and `pending_h` -> self."""
        if self.backlog:
            self.pending = torch.cat([self.pending, *self.backlog])
            self.backlog.clear()
        if self.backlog_h:
            self.pending_h = torch.cat([self.pending_h, *self.backlog_h])
            self.backlog_h.clear()
        return self


class _ModelGuess:
    """What a draft and the MTP module share: the state per sequence, the slab, the guess loop."""

    name = "model"

    def __init__(self, model: Transformer | MTPModule, pool: PagePool, head: Head, backend: Backend) -> None:
        self.pool, self.head = pool, head
        self.slab = slab_for(model, pool.n_pages * pool.page_size, head.w.device)
        self.steps = backend.steps(model)  # None: eager
        self.state: dict[int, _State] = {}

    def _step(self, seqs: list[Seq], counts: list[int]) -> B.BatchStep:
        starts = [self.state[s.uid].length for s in seqs]
        for s, n in zip(seqs, counts, strict=True):
            self.state[s.uid].length += n
        return B.build([self.pool.tables[s.uid] for s in seqs], starts, counts, self.pool.page_size, self.slab.device)

    # each subclass's: the pending entries fed -> [G, d]; then one guess each, fed on the states `out`
    _feed_pending: Callable[[list[Seq]], torch.Tensor]
    _feed_guess: Callable[[list[Seq], torch.Tensor, torch.Tensor], torch.Tensor]

    def _chain(self, s: Seq, k: int) -> Guesses | None:
        """k guesses for `s` alone in one native call, its pending entries fed first; None where it cannot
        serve (no native steps, a backlog longer than a pass, pages out of order, filters beside the temperature)."""
        st, steps = self.state[s.uid].settle(), self.steps
        if steps is None or not (s.warp is None or isinstance(s.warp, Warper)):
            return None
        L, m = st.length, st.pending.shape[0]
        end = L + m + k - 1  # the catch-up's m entries, then the chain's k - 1
        table = self.pool.tables[s.uid]
        n_pages = self.pool.pages_for(end)
        if not 0 < m <= MAX_T or end > steps.positions or len(table) < n_pages:
            return None
        if (first := B.in_order(table, n_pages)) is None:
            return None
        base = first * self.pool.page_size
        view = self.slab[:, :, :, base : base + end]
        h = st.pending_h if isinstance(self, MTPGuess) else None
        sampled = () if s.warp is None else (1.0 / s.warp.temperature, uniforms((k,), s.gen, self.head.w))
        tokens, q = steps.chain(self.head.ids, k, view, L, (st.pending, h), *sampled, penalty=penalty_of(s))
        st.true_len, st.length = L + m, end
        return tokens, None if s.warp is None else self.head.expand(q)

    def propose(self, seqs: list[Seq], ks: list[int]) -> list[Guesses]:
        for s, k in zip(seqs, ks, strict=True):
            st = self.state[s.uid]
            st.proposed, st.fed_guesses = k > 0, max(0, k - 1)
        if len(seqs) == 1 and ks[0] > 0 and (got := self._chain(seqs[0], ks[0])) is not None:
            return [got]
        live = [i for i, k in enumerate(ks) if k > 0]
        tokens: list[list[torch.Tensor]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor | None]] = [[] for _ in seqs]
        if live:
            group = [seqs[i] for i in live]
            # each sequence's penalty, on a copy that takes in its guesses as the next one's context
            pens = [None if k == 0 or (p := penalty_of(s)) is None else p.copy() for s, k in zip(seqs, ks, strict=True)]
            out = self._feed_pending(group)  # [G, d]: the state after each one's last true token
            x = out.new_empty(0, dtype=torch.long)  # the previous depth's guesses
            for depth in range(max(ks)):
                if depth:
                    keep = [j for j, i in enumerate(live) if ks[i] > depth]
                    live = [live[j] for j in keep]
                    group = [seqs[i] for i in live]
                    idx = torch.tensor(keep, device=out.device)
                    out = self._feed_guess(group, out.index_select(0, idx), x.index_select(0, idx))
                x, q = pick(self.head, out, group, [pens[i] for i in live])
                for j, i in enumerate(live):
                    tokens[i].append(x[j : j + 1])
                    qs[i].append(q[j])
                    if (pen := pens[i]) is not None:
                        pen.take(x[j : j + 1])
        none = no_guess(seqs)
        return [
            (torch.cat(t), None if q[0] is None else torch.cat(q)) if t else none  # type: ignore[arg-type]
            for t, q in zip(tokens, qs, strict=True)
        ]

    def drop(self, seq: Seq) -> None:
        self.state.pop(seq.uid, None)


class DraftGuess(_ModelGuess):
    def __init__(self, model: Transformer, pool: PagePool, head: Head, name: str, backend: Backend) -> None:
        super().__init__(model, pool, head, backend)
        self.model, self.name = model, name

    def start(self, seqs: list[Seq], fed: list[torch.Tensor], hidden: list[torch.Tensor]) -> None:
        for s in seqs:
            self.state[s.uid] = _State(pending=s.last.view(1))
        b = self._step(seqs, [f.shape[0] for f in fed])
        transformer_pass(self.model, self.slab, torch.cat(fed), b, "none", self.steps)

    def _feed_pending(self, seqs: list[Seq]) -> torch.Tensor:
        pend = [self.state[s.uid].settle().pending for s in seqs]
        b = self._step(seqs, [p.shape[0] for p in pend])
        _, x = transformer_pass(self.model, self.slab, torch.cat(pend), b, "none", self.steps)
        return x[b.last]

    def _feed_guess(self, seqs: list[Seq], out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        b = self._step(seqs, [1] * len(seqs))
        return transformer_pass(self.model, self.slab, x, b, "none", self.steps)[1]

    def accept(self, seq: Seq, n: int, emitted: torch.Tensor, hidden: torch.Tensor) -> None:
        st = self.state[seq.uid]
        if not st.proposed:  # another proposer guessed, or none did: these tokens wait to be fed
            st.wait(emitted)
            return
        st.proposed = False
        kept = min(n, st.fed_guesses)  # the cache holds [.., last, d_1 .. d_fed]: keep what was confirmed
        st.length -= st.fed_guesses - kept
        st.pending = emitted[kept:]


class MTPGuess(_ModelGuess):
    """The MTP module: pairs (target state h_j, token j+1) in, the target's head out."""

    name = "mtp"

    def __init__(self, target: Transformer, mtp: MTPModule, pool: PagePool, head: Head, backend: Backend) -> None:
        super().__init__(mtp, pool, head, backend)
        self.target, self.mtp = target, mtp

    def start(self, seqs: list[Seq], fed: list[torch.Tensor], hidden: list[torch.Tensor]) -> None:
        for s, f, h in zip(seqs, fed, hidden, strict=True):
            self.state[s.uid] = _State(pending=torch.cat([f[1:], s.last.view(1)]), pending_h=h)

    def _pass(self, seqs: list[Seq], h: list[torch.Tensor], x: list[torch.Tensor]) -> torch.Tensor:
        b = self._step(seqs, [t.shape[0] for t in x])
        return mtp_pass(self.mtp, self.target, self.slab, torch.cat(h), torch.cat(x), b, self.steps)[b.last]

    def _feed_pending(self, seqs: list[Seq]) -> torch.Tensor:
        sts = [self.state[s.uid].settle() for s in seqs]
        out = self._pass(seqs, [st.pending_h for st in sts], [st.pending for st in sts])
        for st in sts:
            st.true_len = st.length
        return out

    def _feed_guess(self, seqs: list[Seq], out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self._pass(seqs, list(out.split(1)), list(x.split(1)))  # chain on the module's own state

    def accept(self, seq: Seq, n: int, emitted: torch.Tensor, hidden: torch.Tensor) -> None:
        st = self.state[seq.uid]
        if not st.proposed:
            st.wait(emitted, hidden)
            return
        st.proposed = False
        st.length = st.true_len  # drop the chained guesses
        st.pending_h, st.pending = hidden, emitted


class FallbackGuess:
    """The n-gram lookup where it matches, the model proposer for the other sequences."""

    def __init__(self, first: NgramGuess, other: _ModelGuess) -> None:
        self.first, self.other = first, other
        self.name = f"ngram+{other.name}"

    def start(self, seqs: list[Seq], fed: list[torch.Tensor], hidden: list[torch.Tensor]) -> None:
        self.first.start(seqs, fed, hidden)
        self.other.start(seqs, fed, hidden)

    def propose(self, seqs: list[Seq], ks: list[int]) -> list[Guesses]:
        mine = self.first.propose(seqs, ks)
        rest = [k if g[0].shape[0] == 0 else 0 for g, k in zip(mine, ks, strict=True)]
        theirs = self.other.propose(seqs, rest)
        return [t if r else g for g, t, r in zip(mine, theirs, rest, strict=True)]

    def accept(self, seq: Seq, n: int, emitted: torch.Tensor, hidden: torch.Tensor) -> None:
        self.first.accept(seq, n, emitted, hidden)
        self.other.accept(seq, n, emitted, hidden)

    def drop(self, seq: Seq) -> None:
        self.first.drop(seq)
        self.other.drop(seq)
