"""What a request samples with, and the first token a prefill draws. Every option changes the
target's distribution before verification, so the output stays exact for it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .verify import Warp, Warper, penalize, sample


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 means greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    min_p: float | None = None  # after temperature: drop tokens below min_p x the top probability
    repetition_penalty: float = 1.0  # CTRL's: a token of the context has its logit scaled down; 1 is off

    @property
    def greedy(self) -> bool:  # top-k, top-p and min-p then change nothing, the penalty does
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0

    def warp(self) -> Warp | None:
        """logits -> the distribution target and proposer both draw from; None when greedy."""
        return None if self.greedy else Warper(self.temperature, self.top_k, self.top_p, self.min_p)


def context_mask(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.zeros(vocab_size, dtype=torch.bool, device=tokens.device).index_fill_(0, tokens, True)


def first_token(
    raw: torch.Tensor, prompt: torch.Tensor, w: Warp | None, gen: torch.Generator | None, penalty: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The prefill's last logits [1, V] -> (the first new token [1], the penalty's context or None)."""
    seen = None if penalty == 1.0 else context_mask(prompt, raw.shape[-1])
    logits = raw if seen is None else penalize(raw, seen, prompt[-1:], penalty)
    last = logits.argmax(dim=-1) if w is None else sample(w(logits), gen)
    return last, None if seen is None else seen.index_fill_(0, last.view(-1), True)


class NonFiniteError(RuntimeError):
    """The target's logits hold NaN or inf: broken weights or an overflow, never a silent answer."""


def finite_flag(x: torch.Tensor) -> torch.Tensor:
    """[1] long: 1 if every value of x is finite, read off its min and max: two reductions, not a whole mask."""
    return torch.stack(torch.aminmax(x)).isfinite().all().long().view(1)
