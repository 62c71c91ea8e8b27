"""A proposer without a model: guess by copying what followed the same words before.

Prompt lookup (suffix matching): the last n tokens of the text so far (prompt and
generated alike) are looked up among its earlier positions, longest n first; where they
occurred before, the tokens that followed them then are the guesses now. Text that
restates itself (a list quoted again, a refrain, a genealogy's "and he begat") is guessed
for free; elsewhere the lookup finds nothing, or a guess the target rejects.

- No cache, no model: a guess costs a dictionary lookup. A round whose lookup finds
  nothing offers no guess, and the target's pass is then a plain one-token pass.
- No q: the guesses are not drawn from a distribution. Under sampling each is a point
  mass, q = one-hot, which the min(1, p/q) rule handles exactly: the guess is kept with
  probability p(x), and a rejection draws from p with x taken out.
- `Fallback(ngram, other)`: the n-gram's guesses when its lookup matches, the other
  proposer's otherwise (`--proposer ngram+mtp`). The other one is told every round's
  outcome and catches up on what it did not guess at its next turn.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .proposers import Fused, Pass, Proposer, Warp


class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of a token list last occurred and was followed
    by something: gram -> the position of its last token. Updated as tokens arrive, O(max_n) each."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n}..{max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            # The grams ending at the current last token now have a follower: index them.
            end = len(self.tokens) - 1
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self.last[tuple(self.tokens[end - n + 1 : end + 1])] = end
            self.tokens.append(t)

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix seen before (its latest occurrence)."""
        toks, size = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            end = self.last.get(tuple(toks[size - n :]))
            if end is not None:
                # Copy what followed; past the end of the text, copy the copy (a repeat whose
                # period is shorter than k goes on repeating).
                out: list[int] = []
                for j in range(end + 1, end + 1 + k):
                    out.append(toks[j] if j < size else out[j - size])
                return out
        return []


class NgramProposer:
    """Guesses by prompt lookup (see the module's docstring). Satisfies `proposers.Proposer`."""

    name = "ngram"

    def __init__(self, vocab_size: int, min_n: int, max_n: int) -> None:
        self.vocab_size = vocab_size
        self.index = NgramIndex(min_n, max_n)
        self.device = torch.device("cpu")

    def start(self, prompt: torch.Tensor, first: torch.Tensor, hidden: torch.Tensor) -> None:
        self.device = prompt.device
        self.index = NgramIndex(self.index.min_n, self.index.max_n)
        self.index.extend(prompt.tolist() + first.view(-1).tolist())

    def propose(
        self, k: int, warp: Warp | None, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        found = self.index.lookup(k)
        tokens = torch.tensor(found, dtype=torch.long, device=self.device)  # [m]
        if warp is None or not found:
            return tokens, None
        return tokens, F.one_hot(tokens, self.vocab_size).float()  # [m, V]: each guess a point mass

    def accept(self, n: int, emitted: torch.Tensor, hidden: torch.Tensor) -> None:
        self.index.extend(emitted.tolist())

    def release(self) -> None:
        pass

    def cost_step(self) -> object:
        return self.index.lookup(1)

    def passes(self, k: int) -> list[Pass]:
        return []

    def counts(self, k: int) -> list[int]:
        return list(range(k + 1))

    def fused(self, k: int, greedy: bool) -> list[tuple[nn.Module, Fused]]:
        return []


class Fallback:
    """The n-gram lookup's guesses when it matches, else another proposer's."""

    def __init__(self, first: NgramProposer, other: Proposer) -> None:
        self.first, self.other = first, other
        self.name = f"{first.name}+{other.name}"

    def start(self, prompt: torch.Tensor, first: torch.Tensor, hidden: torch.Tensor) -> None:
        self.first.start(prompt, first, hidden)
        self.other.start(prompt, first, hidden)

    def propose(
        self, k: int, warp: Warp | None, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        tokens, q = self.first.propose(k, warp, generator)
        if tokens.shape[0]:
            return tokens, q
        return self.other.propose(k, warp, generator)

    def accept(self, n: int, emitted: torch.Tensor, hidden: torch.Tensor) -> None:
        self.first.accept(n, emitted, hidden)
        self.other.accept(n, emitted, hidden)

    def release(self) -> None:
        self.other.release()

    def cost_step(self) -> object:
        return self.other.cost_step()

    def passes(self, k: int) -> list[Pass]:
        return self.other.passes(k)

    def counts(self, k: int) -> list[int]:
        return sorted({*self.first.counts(k), *self.other.counts(k)})

    def fused(self, k: int, greedy: bool) -> list[tuple[nn.Module, Fused]]:
        return self.other.fused(k, greedy)
