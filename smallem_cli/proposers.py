"""Proposers: whatever guesses the next k tokens. Verification never knows which one it got.

The protocol, in the loop's order:
- `start(prompt, first, hidden)`: after the target's prefill. `first` is the token the
  prefill produced; `hidden` are the target's hidden states over the prompt.
- `propose(k, warp, generator)`: k guesses that continue the sequence, as a long [k]
  tensor, plus (when sampling) the distributions q [k, V] they were drawn from.
- `accept(n, emitted, hidden)`: the round kept n guesses and emitted n+1 tokens
  (`emitted`, [n+1]: the kept guesses, then the target's own token); `hidden` [n+1, d]
  are the target's states at the positions that were fed, [last, d_1 .. d_n].
  The proposer rolls its own cache back to what is still true.
- `cost_step()`: one guess from the current state, which it leaves as it was: what
  `bench` times as the proposer's cost c.
- `passes(k)`: the decode passes a round with k guesses may run, as (model, T, head,
  last), so that compiled steps can be built before anything is timed (`aot.prepare`).

Nothing here synchronises with the device: guesses stay tensors and feed the next step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from .model import MTPModule, Transformer, unit_rms
from .verify import sample

Warp = Callable[[torch.Tensor], torch.Tensor]  # logits [..., V] -> probabilities [..., V]


class Proposer(Protocol):
    name: str

    def start(self, prompt: torch.Tensor, first: torch.Tensor, hidden: torch.Tensor) -> None: ...

    def propose(
        self, k: int, warp: Warp | None, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def accept(self, n: int, emitted: torch.Tensor, hidden: torch.Tensor) -> None: ...

    def release(self) -> None: ...

    def cost_step(self) -> object: ...

    def passes(self, k: int) -> list[Pass]: ...


Pass = tuple[nn.Module, int, bool, bool]  # (model, tokens in the pass, head, last position only)


class Head:
    """The output head a proposer guesses with: the model's own, or only its rows for the
    `vocab` most frequent tokens (FR-Spec's trick). On a small model the head is the
    biggest matrix a step reads, and a guess needs no exactness: verification makes the
    output exact whatever the proposer computes, so a cut head trades a few rejected
    guesses for a cheaper step. The distribution q is then zero outside the cut.
    """

    def __init__(self, model: Transformer, vocab: torch.Tensor | None = None) -> None:
        assert model.head_t is not None, "pack() the model first"
        self.eps, self.size = model.cfg.norm_eps, model.cfg.vocab_size
        self.ids = vocab
        self.w = model.head_t if vocab is None else model.head_t[:, vocab].contiguous()  # [d, V or N]

    def pick(
        self, h: torch.Tensor, warp: Warp | None, gen: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final hidden state h [1, d] -> (token [1], q [1, V] or None when greedy)."""
        if warp is None:
            # The final norm scales a row by a positive number: the argmax needs no norm.
            i = (h @ self.w).argmax(-1)
            return (i if self.ids is None else self.ids[i]), None
        q = warp(unit_rms(h, self.eps) @ self.w)  # [1, V or N]
        i = sample(q, gen)
        if self.ids is None:
            return i, q
        return self.ids[i], q.new_zeros(1, self.size).index_copy_(1, self.ids, q)


def _collect(tokens: list[torch.Tensor], qs: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
    q = None if qs[0] is None else torch.cat(qs)  # type: ignore[arg-type]
    return torch.cat(tokens), q


class NoProposer:
    """The target alone, through the same loop: zero guesses, one token per pass."""

    name = "none"

    def start(self, prompt: torch.Tensor, first: torch.Tensor, hidden: torch.Tensor) -> None:
        self._empty = prompt[:0]

    def propose(
        self, k: int, warp: Warp | None, generator: torch.Generator | None
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


class DraftProposer:
    """A small model with the target's tokenizer, its own paged cache and rollback."""

    def __init__(
        self, model: Transformer, max_tokens: int, name: str = "draft", head: Head | None = None, page_size: int = 16
    ) -> None:
        self.model, self.name = model, name
        self.head = head or Head(model)
        self.cache = model.new_cache(-(-max_tokens // page_size) + 1, page_size)
        self.seq = self.cache.new_sequence()
        self.pending = torch.empty(0, dtype=torch.long)  # sequence tokens not yet fed to the draft
        self.fed_guesses = 0

    def start(self, prompt: torch.Tensor, first: torch.Tensor, hidden: torch.Tensor) -> None:
        self.model(prompt, self.cache, self.seq, head=False, last=True)  # prefill the draft's cache: K/V only
        self.pending = first

    def propose(
        self, k: int, warp: Warp | None, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        tokens, qs = [], []
        x = self.pending  # catch up (1 or 2 tokens), then one guess at a time
        for _ in range(k):
            _, h = self.model(x, self.cache, self.seq, head=False, last=True)  # [1, d]
            x, q = self.head.pick(h, warp, generator)
            tokens.append(x)
            qs.append(q)
        self.fed_guesses = k - 1  # the last guess was never fed
        return _collect(tokens, qs)

    def accept(self, n: int, emitted: torch.Tensor, hidden: torch.Tensor) -> None:
        # The cache holds [.., last, d_1 .. d_{k-1}]; keep what the target confirmed:
        # the seed's draft.keep(min(len(draft), start + accepted)).
        kept = min(n, self.fed_guesses)
        self.cache.keep(self.seq, self.cache.length(self.seq) - self.fed_guesses + kept)
        self.pending = emitted[kept:]  # d_k if all k were kept, then the target's token

    def release(self) -> None:
        self.cache.release(self.seq)

    def cost_step(self) -> object:
        n = self.cache.length(self.seq)
        _, h = self.model(self.pending[-1:], self.cache, self.seq, head=False, last=True)
        out = self.head.pick(h, None, None)
        self.cache.keep(self.seq, n)
        return out

    def passes(self, k: int) -> list[Pass]:
        return [(self.model, t, False, True) for t in (1, 2)]  # a guess; a catch-up on 2 tokens


class MTPProposer:
    """DeepSeek-V3's MTP module as proposer: from the target's h_i and token i+1, guess i+2.

    Its block has a one-layer cache of its own. Guesses past the first chain on the
    module's own output state instead of the target's; those cache entries are dropped
    once the target has computed the real states for their positions.
    """

    name = "mtp"

    def __init__(
        self, target: Transformer, mtp: MTPModule, max_tokens: int, head: Head | None = None, page_size: int = 16
    ) -> None:
        self.target, self.mtp = target, mtp
        self.head = head or Head(target)  # the target's head, shared
        self.cache = mtp.new_cache(-(-max_tokens // page_size) + 1, page_size)
        self.seq = self.cache.new_sequence()
        self.true_len = 0  # cache entries computed from the target's own states
        self.pending_h = torch.empty(0)  # [m, d] target states not yet fed
        self.pending_next = torch.empty(0, dtype=torch.long)  # [m] the token after each

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
        self, k: int, warp: Warp | None, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = self.step(self.pending_h, self.pending_next, last=True)  # [1, d]: catch up on the true states
        self.true_len = self.cache.length(self.seq)
        tokens, qs = [], []
        for i in range(k):
            if i:
                out = self.step(out, tokens[-1])  # chain on the module's own state
            x, q = self.head.pick(out, warp, generator)
            tokens.append(x)
            qs.append(q)
        return _collect(tokens, qs)

    def accept(self, n: int, emitted: torch.Tensor, hidden: torch.Tensor) -> None:
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
