"""Proposers: whatever guesses the next k tokens. Verification never knows which one it got.

The protocol, in the loop's order:
- `start(prompt, first, hidden)`: after the target's prefill. `first` is the token the
  prefill produced; `hidden` are the target's hidden states over the prompt.
- `propose(k, warp, generator)`: up to k guesses that continue the sequence, as a long [m]
  tensor (m <= k: a proposer that is unsure may stop early, even at 0), plus (when
  sampling) the distributions q [m, V] they were drawn from (a point mass for a guess
  that was not drawn, as an n-gram lookup's).
- `accept(n, emitted, hidden)`: the round kept n guesses and emitted n+1 tokens
  (`emitted`, [n+1]: the kept guesses, then the target's own token); `hidden` [n+1, d]
  are the target's states at the positions that were fed, [last, d_1 .. d_n].
  The proposer rolls its own cache back to what is still true. It is called every round,
  also after a round in which another proposer guessed (`ngram.Fallback`): the tokens
  then wait to be fed at its next guess.
- `cost_step()`: one guess from the current state, which it leaves as it was: what
  `bench` times as the proposer's cost c.
- `passes(k)`: the decode passes a round with k guesses may run, as (model, T, head,
  last), so that the native engine can load each model's steps before anything is timed.
- `counts(k)`: how many guesses a round with k may offer (the target's verify pass is
  over one more token): [k] for a fixed depth, 0..k when the proposer may stop early.

Adaptive depth (`p_min`, llama.cpp's `--draft-p-min`): a model proposer stops guessing in
a round as soon as the probability of its next guess under its own distribution falls
below p_min; a guess it doubts would likely be rejected, and would lengthen the verify
pass for nothing. The test costs a host sync per guess, so it is off (0) by default.

Nothing here synchronises with the device: guesses stay tensors and feed the next step.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from ..defaults import PAGE_SIZE
from ..model.cache import pages_for
from ..model.llama import MTPModule, Transformer
from .chain import chains, native_chain, run_chain
from .head import Head, collect, guess
from .verify import Penalty, Warp


class Proposer(Protocol):
    name: str

    def start(self, prompt: torch.Tensor, first: torch.Tensor, hidden: torch.Tensor) -> None: ...

    def propose(
        self, k: int, warp: Warp | None, generator: torch.Generator | None, penalty: Penalty | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def accept(self, n: int, emitted: torch.Tensor, hidden: torch.Tensor) -> None: ...

    def release(self) -> None: ...

    def cost_step(self) -> object: ...

    def passes(self, k: int) -> list[Pass]: ...

    def counts(self, k: int) -> list[int]: ...


Pass = tuple[nn.Module, int, bool, bool]  # (model, tokens in the pass, head, last position only)


class NoProposer:
    """The target alone, through the same loop: zero guesses, one token per pass."""

    name = "none"

    def start(self, prompt: torch.Tensor, first: torch.Tensor, hidden: torch.Tensor) -> None:
        self._empty = prompt[:0]

    def propose(
        self, k: int, warp: Warp | None, generator: torch.Generator | None, penalty: Penalty | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._empty, None

    def accept(self, n: int, emitted: torch.Tensor, hidden: torch.Tensor) -> None:
        pass

    def release(self) -> None:
        pass

    def cost_step(self) -> object:
        return None

    def passes(self, k: int) -> list[Pass]:
        return []

    def counts(self, k: int) -> list[int]:
        return [0]


class DraftProposer:
    """A small model with the target's tokenizer, its own paged cache and rollback."""

    CHUNK = 2  # tokens per catch-up pass (the pass sizes a draft has compiled steps for)

    def __init__(
        self,
        model: Transformer,
        max_tokens: int,
        name: str = "draft",
        head: Head | None = None,
        page_size: int = PAGE_SIZE,
        p_min: float = 0.0,
    ) -> None:
        self.model, self.name, self.p_min = model, name, p_min
        self.head = head or Head(model)
        self.cache = model.new_cache(pages_for(max_tokens, page_size) + 1, page_size)
        self.seq = self.cache.new_sequence()
        self.pending = torch.empty(0, dtype=torch.long)  # sequence tokens not yet fed to the draft
        self.fed_guesses = 0
        self.proposed = False  # whether this round's guesses are the draft's

    def start(self, prompt: torch.Tensor, first: torch.Tensor, hidden: torch.Tensor) -> None:
        self.model(prompt, self.cache, self.seq, head=False, last=True)  # prefill the draft's cache: K/V only
        self.pending = first

    def _feed(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens x [T] into the draft's cache -> the final state of the last one [1, d].
        A long catch-up (after rounds another proposer guessed) goes in passes of CHUNK tokens."""
        while x.shape[0] > self.CHUNK:
            self.model(x[: self.CHUNK], self.cache, self.seq, head=False, last=True)
            x = x[self.CHUNK :]
        return self.model(x, self.cache, self.seq, head=False, last=True)[1]

    def propose(
        self, k: int, warp: Warp | None, generator: torch.Generator | None, penalty: Penalty | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        tokens, qs = [], []
        self.fed_guesses = k - 1  # the last guess is never fed
        self.proposed = True
        # one native call: the catch-up (1 or 2 tokens), then the guesses, k-1 of them fed
        if chains(warp, self.p_min) and (
            chain := native_chain(self.model, self.cache, self.seq, self.head, k, (self.pending, None), penalty)
        ):
            return run_chain(chain, self.head, k, warp, generator, self.p_min)
        h = self._feed(self.pending)  # catch up, then one guess at a time
        penalty = None if penalty is None else penalty.copy()  # each guess added to its context
        for i in range(k):
            if i:
                h = self._feed(tokens[-1])
            got = guess(self.head, h, warp, generator, self.p_min, penalty)
            if got is None:  # unsure: stop here; the guesses so far were all fed
                self.fed_guesses = i
                break
            tokens.append(got[0])
            qs.append(got[1])
        return collect(tokens, qs, self.pending[:0])

    def accept(self, n: int, emitted: torch.Tensor, hidden: torch.Tensor) -> None:
        if not self.proposed:  # another proposer guessed: these tokens wait to be fed
            self.pending = torch.cat([self.pending, emitted])
            return
        self.proposed = False
        # The cache holds [.., last, d_1 .. d_fed]; keep what the target confirmed:
        # the seed's draft.keep(min(len(draft), start + accepted)).
        kept = min(n, self.fed_guesses)
        self.cache.keep(self.seq, self.cache.length(self.seq) - self.fed_guesses + kept)
        self.pending = emitted[kept:]  # d_k if all k were kept and d_k never fed, then the target's token

    def release(self) -> None:
        self.cache.release(self.seq)

    def cost_step(self) -> object:
        n = self.cache.length(self.seq)
        _, h = self.model(self.pending[-1:], self.cache, self.seq, head=False, last=True)
        out = self.head.pick(h, None, None)
        self.cache.keep(self.seq, n)
        return out

    def passes(self, k: int) -> list[Pass]:
        return [(self.model, t, False, True) for t in (1, self.CHUNK)]  # a guess; a catch-up on 2 tokens

    def counts(self, k: int) -> list[int]:
        return list(range(k + 1)) if self.p_min else [k]


class MTPProposer:
    """DeepSeek-V3's MTP module as proposer: from the target's h_i and token i+1, guess i+2.

    Its block has a one-layer cache of its own. Guesses past the first chain on the
    module's own output state instead of the target's; those cache entries are dropped
    once the target has computed the real states for their positions.
    """

    name = "mtp"

    def __init__(
        self,
        target: Transformer,
        mtp: MTPModule,
        max_tokens: int,
        head: Head | None = None,
        page_size: int = PAGE_SIZE,
        p_min: float = 0.0,
        tree: tuple[int, int] | None = None,
    ) -> None:
        self.target, self.mtp, self.p_min = target, mtp, p_min
        # (guesses, width): the engine grows token trees from this module (`engine.tree_guess`)
        # instead of running this chain; None keeps the chain
        self.tree = tree
        self.head = head or Head(target)  # the target's head, shared
        self.cache = mtp.new_cache(pages_for(max_tokens, page_size) + 1, page_size)
        self.seq = self.cache.new_sequence()
        self.true_len = 0  # cache entries computed from the target's own states
        self.pending_h = torch.empty(0)  # [m, d] target states not yet fed
        self.pending_next = torch.empty(0, dtype=torch.long)  # [m] the token after each
        self.proposed = False  # whether this round's guesses are the module's

    def start(self, prompt: torch.Tensor, first: torch.Tensor, hidden: torch.Tensor) -> None:
        self.pending_h = hidden  # h_0 .. h_{P-1}
        self.pending_next = torch.cat([prompt[1:], first])  # x_1 .. x_P

    def step(self, h: torch.Tensor, nxt: torch.Tensor, last: bool = False) -> torch.Tensor:
        """Feed pairs (h_j, x_{j+1}) [T, d], [T] through the module -> its states [T, d] ([1, d] if `last`)."""
        step = self.cache.append(self.seq, h.shape[0])
        assert self.target.rope_packed is not None
        rope = self.target.rope_packed[step.start : step.length]
        return self.mtp.decode(h, nxt, self.target.embed_tokens.weight, rope, self.cache, step, last)  # [T or 1, d]

    def propose(
        self, k: int, warp: Warp | None, generator: torch.Generator | None, penalty: Penalty | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h, nxt = self.pending_h, self.pending_next
        self.proposed = True
        # one native call: the catch-up on the true states, then the chain (its k-1 positions
        # after the true states, which `accept` drops)
        if chains(warp, self.p_min) and (
            chain := native_chain(self.mtp, self.cache, self.seq, self.head, k, (nxt, h), penalty)
        ):
            self.true_len = self.cache.length(self.seq) - (k - 1)
            return run_chain(chain, self.head, k, warp, generator, self.p_min)
        # The prompt, at the first round, in one pass; later, a backlog (rounds another proposer
        # guessed) in passes of k+1 pairs.
        chunk = k + 1 if self.true_len else h.shape[0]
        while h.shape[0] > chunk:
            self.step(h[:chunk], nxt[:chunk], last=True)
            h, nxt = h[chunk:], nxt[chunk:]
        out = self.step(h, nxt, last=True)  # [1, d]: catch up on the true states
        self.true_len = self.cache.length(self.seq)
        if chains(warp, self.p_min):  # from the caught-up state, natively (after a long backlog)
            chain = native_chain(self.mtp, self.cache, self.seq, self.head, k, out, penalty)
            if chain is not None:
                return run_chain(chain, self.head, k, warp, generator, self.p_min)
        tokens, qs = [], []
        penalty = None if penalty is None else penalty.copy()  # each guess added to its context
        for i in range(k):
            if i:
                out = self.step(out, tokens[-1])  # chain on the module's own state
            got = guess(self.head, out, warp, generator, self.p_min, penalty)
            if got is None:  # unsure: stop guessing this round
                break
            tokens.append(got[0])
            qs.append(got[1])
        return collect(tokens, qs, self.pending_next[:0])

    def accept(self, n: int, emitted: torch.Tensor, hidden: torch.Tensor) -> None:
        if not self.proposed:  # another proposer guessed: these pairs wait to be fed
            self.pending_h = torch.cat([self.pending_h, hidden])
            self.pending_next = torch.cat([self.pending_next, emitted])
            return
        self.proposed = False
        self.cache.keep(self.seq, self.true_len)  # drop the chained guesses
        self.pending_h, self.pending_next = hidden, emitted  # pairs (h_j, x_{j+1})

    def release(self) -> None:
        self.cache.release(self.seq)

    def cost_step(self) -> object:
        n = self.cache.length(self.seq)
        out = self.head.pick(self.step(self.pending_h[-1:], self.pending_next[-1:]), None, None)
        self.cache.keep(self.seq, n)
        return out

    def passes(self, k: int) -> list[Pass]:
        return [(self.mtp, t, True, t > 1) for t in range(1, k + 2)]  # catch-ups on 1..k+1 pairs; chained guesses

    def counts(self, k: int) -> list[int]:
        return list(range(k + 1)) if self.p_min else [k]
