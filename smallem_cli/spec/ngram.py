"""Prompt lookup: drafting by copying what followed the text's last n tokens before, as deep as the measured acceptance
is worth (`best_depth`). Under sampling a draft token is a point mass (q one-hot): accepted with probability p(x),
exactly."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .verify import Penalty, Warp

DECAY = 0.8  # the acceptance rate's memory, per round: it follows the text from region to region


class NgramIndex:
    """gram -> the position of its last token, where each n-gram last occurred and was followed by something."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n}..{max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            # the grams ending at the current last token now have a follower
            end = len(self.tokens) - 1
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self.last[tuple(self.tokens[end - n + 1 : end + 1])] = end
            self.tokens.append(t)

    def match(self, k: int) -> tuple[int, list[int]]:
        """(n, up to k tokens that followed the longest suffix seen before, n tokens, at its latest occurrence);
        (0, []) where none."""
        toks, size = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            if (end := self.last.get(tuple(toks[size - n :]))) is not None:
                # past the end of the text, copy the copy: a repeat shorter than k goes on repeating
                out: list[int] = []
                for j in range(end + 1, end + 1 + k):
                    out.append(toks[j] if j < size else out[j - size])
                return n, out
        return 0, []


def best_depth(first: float, then: float, k: int, draft_cost: float) -> int:
    """The m in 0..k with the most tokens, 1 + first·(1 + then + ... + then^(m−1)), per pass cost
    1 + draft_cost·m (a lookup is a copy or wrong from its first token: its first rate differs)."""
    return max(range(k + 1), key=lambda m: (1 + first * sum(then**i for i in range(m))) / (1 + draft_cost * m))


class NgramLookup:
    """One sequence's prompt lookup: its index, its acceptance rates, its depth."""

    def __init__(self, vocab_size: int, min_n: int, max_n: int, draft_cost: float = 0.0) -> None:
        self.vocab_size, self.draft_cost = vocab_size, draft_cost
        self.index = NgramIndex(min_n, max_n)
        self.device = torch.device("cpu")
        self.looked: list[int] = []  # what this round's lookup found, offered or not
        # decayed counts of draft tokens accepted and in play: [first ones, later ones]
        self.accepted, self.reached = [0.0, 0.0], [0.0, 0.0]
        self.asked = False  # whether this round's accept follows a lookup
        # rounds it was not asked in (k 0 under load): their tokens, taken in at once when it next is
        self.backlog: list[torch.Tensor] = []

    def start(self, prompt: torch.Tensor, first: torch.Tensor) -> None:
        self.device = prompt.device
        self.index.extend(prompt.tolist() + first.view(-1).tolist())

    @property
    def rates(self) -> tuple[float, float]:
        """Rates at which a first draft token, and a later one in play, are accepted (a prior of one in two)."""
        return (self.accepted[0] + 1) / (self.reached[0] + 2), (self.accepted[1] + 1) / (self.reached[1] + 2)

    def propose(
        self, k: int, warp: Warp | None, generator: torch.Generator | None, penalty: Penalty | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.backlog:  # `accept`'s work for each round it was not asked in: a lookup of nothing (the rates decay)
            for _ in range(len(self.backlog)):
                for j in range(2):
                    self.accepted[j], self.reached[j] = DECAY * self.accepted[j], DECAY * self.reached[j]
            self.index.extend(torch.cat(self.backlog).tolist())
            self.backlog.clear()
        self.asked = True
        self.looked = self.find(k)
        tokens = torch.tensor(self.looked[: self.depth(k)], dtype=torch.long, device=self.device)  # [m]
        return tokens, None if warp is None or not tokens.shape[0] else F.one_hot(tokens, self.vocab_size).float()

    def depth(self, k: int) -> int:
        """How many of the draft tokens found to offer: as deep as the measured acceptance is worth."""
        return best_depth(*self.rates, k, self.draft_cost) if self.draft_cost else k

    def find(self, k: int) -> list[int]:
        """Up to k draft tokens: what followed the longest suffix of the text seen before."""
        return self.index.match(k)[1]

    def accept(self, emitted: torch.Tensor) -> None:
        """A round's tokens taken in, and what the lookup would have had accepted counted."""
        if not self.asked:  # no lookup this round: taken in at the next one
            self.backlog.append(emitted)
            return
        self.asked = False
        out = emitted.tolist()
        # what the lookup would have had accepted, offered or not (a draft token past the emitted ones cannot be told)
        hits, told = 0, min(len(self.looked), len(out))
        while hits < told and self.looked[hits] == out[hits]:
            hits += 1
        in_play = hits + (hits < told)
        first = (min(hits, 1), min(in_play, 1))  # the first draft token; then the later ones in play
        for j, (accepted, played) in enumerate((first, (hits - first[0], in_play - first[1]))):
            self.accepted[j] = DECAY * self.accepted[j] + accepted
            self.reached[j] = DECAY * self.reached[j] + played
        self.looked = []
        self.index.extend(out)
