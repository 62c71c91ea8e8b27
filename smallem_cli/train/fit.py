"""What a proposer is fitted to: the target's distribution, as the proposer will be judged.

A greedy guess is kept when it is the target's argmax; a sampled guess x ~ q with probability
min(1, p(x)/q(x)), so with probability sum_x min(p(x), q(x)) = 1 - TV(p, q), p and q *warped*
(softmax(logits / T) at the user's temperature), q zero outside the proposer's cut head if it has
one (`proposers.Head`: the `vocab` most frequent tokens). Plain distillation (the default) fits q to
p at T = 1 over the whole vocabulary; `Fit` fits it as it runs:
- KL(p_T || q_T) at each of `temperatures`, averaged; over a cut head, p renormalised over the cut
  (the best q there is p's restriction, renormalised);
- plus `tv` x (1 - sum_cut min(p_T, q_T)), the rejection probability itself: its gradient is zero
  wherever q >= p, so it refines a fit that KL has brought close.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..model.llama import Transformer

# A training loss: a batch [B, T+2] -> (the loss, what it reads as 0-dim tensors: an `.item()` inside
# would break a compiled loss's graph, so the training loop reads them on the host)
LossFn = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
# The target's side of a fit, one pair per temperature: log p_T on the cut (what acceptance
# reads) and renormalised over it (what the KL fits; the same tensor over the whole vocabulary).
Teacher = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Fit:
    temperatures: tuple[float, ...] = (1.0,)
    tv: float = 0.0  # weight of the rejection probability beside the KL
    vocab: int = 0  # > 0: q over the `vocab` most frequent training tokens (the cut head)

    def __post_init__(self) -> None:
        if not self.temperatures or min(self.temperatures) <= 0:
            raise ValueError(f"fit temperatures must be > 0, got {self.temperatures}")
        if self.tv < 0 or self.vocab < 0:
            raise ValueError(f"the fit's TV weight and vocabulary must be >= 0, got {self.tv}, {self.vocab}")

    @property
    def plain(self) -> bool:
        return self.temperatures == (1.0,) and not self.tv and not self.vocab


def student_logits(model: Transformer, h: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """A proposer's logits through `model`'s final norm and head, cut to `ids`: [..., d] -> [..., V or N]."""
    w = model.head_weight  # [V, d]; a cut head's rows in `ids` order
    return F.linear(model.norm(h), w if ids is None else w[ids]).float()  # float32 under bf16 autocast


def acceptance(teacher: torch.Tensor, student: torch.Tensor, ids: torch.Tensor | None, T: float) -> torch.Tensor:
    """The probability that a guess drawn from q_T is kept, sum_x min(p_T(x), q_T(x)), per position:
    teacher logits [..., V], student logits [..., V] or [..., N] over the cut `ids` -> [...]."""
    return _kept(_log_p(teacher, ids, T), F.log_softmax(student / T, dim=-1))


def _kept(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    return torch.minimum(lp, lq).exp().sum(-1)


def _log_p(teacher: torch.Tensor, ids: torch.Tensor | None, T: float) -> torch.Tensor:
    """log p_T over the vocabulary, on the cut's tokens (p's mass outside it cannot be proposed)."""
    lp = F.log_softmax(teacher / T, dim=-1)
    return lp if ids is None else lp[..., ids]


@torch.no_grad()
def teacher_log_p(fit: Fit, teacher: torch.Tensor, ids: torch.Tensor | None) -> Teacher:
    """The target's logits [..., V] -> its side of the fit, computed once per batch (a chain's steps
    each read a slice of it)."""
    out = []
    for T in fit.temperatures:
        lp = _log_p(teacher, ids, T)
        out.append((lp, lp - torch.logsumexp(lp, dim=-1, keepdim=True) if ids is not None else lp))
    return out


def fit_loss(fit: Fit, teacher: Teacher, student: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """teacher: `teacher_log_p`'s; student: the proposer's logits [..., V], or [..., N] over the cut ->
    (the loss, and what it reads: "kl@T" and "accept@T" = mean sum min(p_T, q_T))."""
    total = student.new_zeros(())
    extra: dict[str, torch.Tensor] = {}
    for T, (lp, lp_fit) in zip(fit.temperatures, teacher, strict=True):
        lq = F.log_softmax(student / T, dim=-1)
        kl = F.kl_div(lq.flatten(0, -2), lp_fit.flatten(0, -2), log_target=True, reduction="batchmean")
        if fit.tv:
            accept = _kept(lp, lq).mean()
            total = total + kl + fit.tv * (1 - accept)
        else:  # read, not fitted: no gradient to carry
            total = total + kl
            with torch.no_grad():
                accept = _kept(lp, lq).mean()
        extra[f"kl@{T:g}"], extra[f"accept@{T:g}"] = kl.detach(), accept.detach()
    return total / len(fit.temperatures), extra
