"""The output head a proposer guesses with, and one guess from a final state."""

from __future__ import annotations

import torch

from ..model.llama import Transformer, unit_rms
from .verify import Penalty, Warp, proposal, sample


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
        if vocab is not None and vocab.numel() == self.size:  # every token: no cut (q's columns in token order)
            vocab = None
        self.ids = vocab
        self.w = model.head_t if vocab is None else model.head_t[:, vocab].contiguous()  # [d, V or N]
        self.rows = self.w.t().contiguous()  # [V or N, d]: for a few rows at once (`model.head_matmul`)

    def pick(
        self,
        h: torch.Tensor,
        warp: Warp | None,
        gen: torch.Generator | None,
        penalty: Penalty | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final hidden state h [1, d] -> (token [1], q [1, V] or None when greedy); with a
        `penalty`, the logits penalised first, as the target's row."""
        if warp is None:
            # The final norm scales a row by a positive number: the argmax needs no norm (nor
            # does the penalty: it scales each logit by a factor of its sign's).
            i = self._penalised(h @ self.w, penalty).argmax(-1)
            return (i if self.ids is None else self.ids[i]), None
        logits = self._penalised(unit_rms(h, self.eps) @ self.w, penalty)  # [1, V or N]
        q = proposal(warp)(logits)  # the temperature alone, as a chain draws
        i = sample(q, gen)
        return (i if self.ids is None else self.ids[i]), self.expand(q)

    def _penalised(self, logits: torch.Tensor, penalty: Penalty | None) -> torch.Tensor:
        return logits if penalty is None else penalty.apply(logits, self.ids)

    def expand(self, q: torch.Tensor) -> torch.Tensor:
        """q over the head's tokens [m, N] -> over the vocabulary [m, V] (zero outside a cut head);
        a q already over the vocabulary (a native chain's) as it is."""
        if self.ids is None or q.shape[-1] == self.size:
            return q
        return q.new_zeros(q.shape[0], self.size).index_copy_(1, self.ids, q)

    def pick_sure(
        self, h: torch.Tensor, warp: Warp | None, gen: torch.Generator | None, penalty: Penalty | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """As `pick`, plus the proposer's top probability (the greedy guess's, or the top of q
        when sampling): how sure it is of this position. One host sync."""
        if warp is None:
            logits = self._penalised(unit_rms(h, self.eps) @ self.w, penalty)  # [1, V or N]
            i = logits.argmax(-1)
            top = torch.softmax(logits, dim=-1).amax()
            return (i if self.ids is None else self.ids[i]), None, float(top)
        x, q = self.pick(h, warp, gen, penalty)
        assert q is not None
        return x, q, float(q.amax())


def guess(
    head: Head,
    h: torch.Tensor,
    warp: Warp | None,
    gen: torch.Generator | None,
    p_min: float,
    penalty: Penalty | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One guess from the final state h [1, d], or None when the proposer is less sure of it than
    p_min; with a `penalty` (the proposer's own copy), scored with it, which then takes the guess in."""
    if not p_min:
        got: tuple[torch.Tensor, torch.Tensor | None] | None = head.pick(h, warp, gen, penalty)
    else:
        x, q, top = head.pick_sure(h, warp, gen, penalty)
        got = None if top < p_min else (x, q)
    if got is not None and penalty is not None:
        penalty.take(got[0])
    return got


def collect(
    tokens: list[torch.Tensor], qs: list[torch.Tensor | None], empty: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The round's guesses [m] and their q [m, V] (None when greedy, or when there is none)."""
    if not tokens:
        return empty, None
    q = None if qs[0] is None else torch.cat(qs)  # type: ignore[arg-type]
    return torch.cat(tokens), q
