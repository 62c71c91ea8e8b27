"""The output head a proposer drafts with, and one draft token from a final state."""

from __future__ import annotations

import torch

from ..model.eagle import EagleHead
from ..model.llama import Transformer, unit_rms
from .verify import Penalty, Warp, proposal, sample


class Head:
    """The model's output head, or its rows for the `vocab` most frequent tokens alone (FR-Spec): a small model's
    biggest matrix, and verification keeps the output exact whatever the proposer computes."""

    def __init__(self, model: Transformer | EagleHead, vocab: torch.Tensor | None = None) -> None:
        self.model, self.device = model, model.device
        self.eps, self.size = model.cfg.norm_eps, model.cfg.vocab_size
        self.ids = None if vocab is None or vocab.numel() == self.size else vocab  # all: no cut (q in token order)
        self._w: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def w(self) -> torch.Tensor:
        """The rows in float32 [d, V or N], the final norm folded in: built when the eager path first picks (a
        native chain reads its own), from the model's `head_t`."""
        if self._w is None:
            head_t = self.model.eager().head_t
            assert head_t is not None, "pack() the model first"
            whole = self.ids is None or head_t.shape[1] == self.ids.numel()  # an EAGLE head's are its own rows
            w = head_t if whole else head_t[:, self.ids].contiguous()
            self._w = w, w.t().contiguous()  # and [V or N, d]: for a few rows at once (`model.head_matmul`)
        return self._w[0]

    @property
    def rows(self) -> torch.Tensor:
        """`w` as [V or N, d], contiguous: for a few rows at once."""
        self.w  # noqa: B018 (builds both on first use)
        assert self._w is not None
        return self._w[1]

    def pick(
        self, h: torch.Tensor, warp: Warp | None, gen: torch.Generator | None, penalty: Penalty | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final hidden state h [1, d] -> (token [1], q [1, V] or None when greedy), penalised first."""
        # the final norm scales a row by a positive number: the argmax (and the penalty) need no norm
        logits = (h if warp is None else unit_rms(h, self.eps)) @ self.w  # [1, V or N]
        if penalty is not None:
            logits = penalty.apply(logits, self.ids)
        q = None if warp is None else proposal(warp)(logits)  # the temperature alone, as a chain draws
        i = logits.argmax(-1) if q is None else sample(q, gen)
        return (i if self.ids is None else self.ids[i]), None if q is None else self.expand(q)

    def expand(self, q: torch.Tensor) -> torch.Tensor:
        """q over the head's tokens [m, N] -> over the vocabulary [m, V] (a native chain's already is)."""
        if self.ids is None or q.shape[-1] == self.size:
            return q
        return q.new_zeros(q.shape[0], self.size).index_copy_(1, self.ids, q)
