"""What a proposer is fitted to, and how a sampled draft token is judged.

Distillation fits q to the target's p, KL(p || q) at T = 1 over the whole vocabulary. A sampled draft token x ~ q_T is
accepted with probability min(1, p_T(x)/q_T(x)), so with probability sum_x min(p_T(x), q_T(x)) = 1 - TV(p_T, q_T), q
zero outside the proposer's cut head if it has one (`proposers.Head`): `smallem eval` reads it at its temperatures,
training at T = 1 beside the KL."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.llama import Transformer


def student_logits(model: Transformer, h: torch.Tensor) -> torch.Tensor:
    """A proposer's logits through `model`'s final norm and head, never its packed inference head:
    [..., d] -> [..., V]."""
    return F.linear(model.norm(h), model.head_weight).float()  # float32 under bf16 autocast


def acceptance(teacher: torch.Tensor, student: torch.Tensor, ids: torch.Tensor | None, T: float) -> torch.Tensor:
    """The probability that a draft token drawn from q_T is accepted, sum_x min(p_T(x), q_T(x)), per position:
    teacher logits [..., V], student logits [..., V] or [..., N] over the cut `ids` -> [...]."""
    lp = F.log_softmax(teacher / T, dim=-1)  # over the vocabulary: p's mass outside the cut cannot be proposed
    return _kept(lp if ids is None else lp[..., ids], F.log_softmax(student / T, dim=-1))


def _kept(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    return torch.minimum(lp, lq).exp().sum(-1)


def fit_loss(teacher: torch.Tensor, student: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """teacher: the target's log p [..., V] (no gradient); student: the proposer's logits [..., V] ->
    (KL(p || q), and what it reads: "kl@1" and "accept@1" = mean sum min(p, q))."""
    lq = F.log_softmax(student, dim=-1)
    kl = F.kl_div(lq.flatten(0, -2), teacher.flatten(0, -2), log_target=True, reduction="batchmean")
    with torch.no_grad():  # read, not fitted
        accept = _kept(teacher, lq).mean()
    return kl, {"kl@1": kl.detach(), "accept@1": accept}
