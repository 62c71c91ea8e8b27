"""Speculative-decoding verification: the rules that decide how many draft tokens the target accepts.

The greedy rule (`verify_greedy`) reads host lists, after the round's one sync. The sampled rule
(`verify_sample`) and what it needs are pure tensor functions, batched over B rows: everything stays on the
device (no `.item()`, no branch on a tensor value) and every draw goes through the caller's `torch.Generator`,
so a CUDA loop queues a whole step without waiting, and a seeded run replays exactly."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

Warp = Callable[[Tensor], Tensor]  # logits [..., V] -> probabilities [..., V]


def warp(
    logits: Tensor, temperature: float, top_k: int | None = None, top_p: float | None = None, min_p: float | None = None
) -> Tensor:
    """Sampling distribution [..., V] float32 from logits, in HF's order: temperature, top-k, top-p, min-p."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (use greedy decoding for 0), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if min_p is not None and not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    x = logits.float() / temperature  # [..., V]
    if top_k is not None and top_k < x.shape[-1]:
        top = torch.topk(x, top_k, dim=-1).indices  # [..., top_k]
        keep = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, top, True)  # [..., V]
        x = x.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(x, dim=-1)  # [..., V]
    if top_p is not None and top_p < 1.0:
        probs = _nucleus(probs, top_p)
    if min_p:
        # the top token always stays: its probability is max >= min_p * max
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


TOP_P_HEADS = (256, 2048)  # on the CPU, top-p first looks for its tokens among this many (`_nucleus`)


def _nucleus(probs: Tensor, top_p: float) -> Tensor:
    """Top-p over probabilities [..., V], renormalised. On the CPU (a look costs no sync) the H most
    probable serve when they hold top_p in every row, sparing a full sort (far slower)."""
    heads = TOP_P_HEADS if probs.device.type == "cpu" else ()
    for head in [*(h for h in heads if h < probs.shape[-1]), None]:
        top, order = probs.sort(dim=-1, descending=True) if head is None else probs.topk(head, dim=-1)
        sums = top.cumsum(dim=-1)  # [..., V or head]
        if head is None or bool((sums[..., -1] >= top_p).all()):
            break
    # mass of the more probable tokens (an exclusive cumsum, no cancellation)
    keep_sorted = F.pad(sums[..., :-1], (1, 0)) < top_p
    keep_sorted[..., 0] = True  # the top token always stays
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, keep_sorted)  # [..., V] vocabulary order
    probs = probs.masked_fill(~keep, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _repeated(logits: Tensor, hit: Tensor, factor: float) -> Tensor:
    """CTRL's penalty where `hit` (bool, broadcast): a logit divided by the factor if positive, else multiplied."""
    return torch.where(hit, torch.where(logits > 0, logits / factor, logits * factor), logits)


def penalize(logits: Tensor, seen: Tensor, fed: Tensor, penalty: float, ancestors: Tensor | None = None) -> Tensor:
    """The repetition penalty (CTRL's, HF's) over logits [..., T, V] of a pass over fed [..., T]: row i's context
    is seen [..., V] plus fed[:i+1], as the target alone would see it (a tree's: seen plus its `ancestors`)."""
    if not (math.isfinite(penalty) and penalty > 0):
        raise ValueError(f"repetition penalty must be > 0 and finite, got {penalty}")
    if penalty == 1.0:
        return logits
    # [..., T, V]: fed[:i+1] as a running count per token, then or-ed with the context before
    hits = torch.zeros(logits.shape, dtype=torch.int32, device=logits.device).scatter_(-1, fed.unsqueeze(-1), 1)
    if ancestors is None:
        repeated = hits.cumsum(dim=-2, dtype=torch.int32).bool() | seen.unsqueeze(-2)
    else:  # [T, V]: the tokens on each row's path
        repeated = (ancestors.to(torch.float32) @ hits.to(torch.float32)).bool() | seen.unsqueeze(-2)
    return _repeated(logits, repeated, penalty)


@dataclass(frozen=True)
class Warper:
    temperature: float
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def __call__(self, logits: Tensor) -> Tensor:
        return warp(logits, self.temperature, self.top_k, self.top_p, self.min_p)


@dataclass(frozen=True)
class Penalty:
    """The penalty a round's draft tokens are scored with, as the target's rows; a proposer `take`s each one."""

    seen: Tensor
    factor: float

    def copy(self) -> Penalty:
        return Penalty(self.seen.clone(), self.factor)

    def apply(self, logits: Tensor, ids: Tensor | None = None) -> Tensor:
        """`penalize` on rows of logits [R, N] (seen [V] or [R, V]); a cut head's columns are `ids` [N]."""
        return _repeated(logits, self.seen if ids is None else self.seen[..., ids], self.factor)

    def take(self, tokens: Tensor) -> None:
        self.seen.index_fill_(0, tokens.view(-1), True)


def proposal(w: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """What a proposer draws from under the user's warp: the temperature alone. Exactness needs only p warped
    in full, a native chain computes a temperature itself, and top-p would cost a sort per draft token."""
    return Warper(w.temperature) if isinstance(w, Warper) else w


def uniforms(shape: tuple[int, ...], generator: torch.Generator | None, like: Tensor) -> Tensor:
    """U[0, 1) float64 draws on `like`'s device for `sample`, one a token (ahead, for a native chain)."""
    return torch.rand(shape, generator=generator, dtype=torch.float64, device=like.device)


def sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token per row of probs [..., V] (not necessarily normalised) -> long [...]: by the inverse CDF
    over float64 running sums, one uniform a row (a race would need V); a zero-probability token never."""
    u = uniforms(probs.shape[:-1], generator, probs)  # [...]
    c = probs.double().cumsum(dim=-1)  # [..., V]
    below = torch.searchsorted(c, (u * c[..., -1]).unsqueeze(-1), right=True).squeeze(-1)  # [...]
    return below.clamp_max_(probs.shape[-1] - 1)  # u * c_V rounded up to c_V: the last


def verify_greedy(drafts: Sequence[int], best: Sequence[int]) -> int:
    """Greedy verification -> n, the leading draft tokens d_1..d_m equal to the target's argmax `best` after each of
    [last, d_1..d_m]. The round emits best[:n+1]: the n accepted, then the correction (or bonus token when n == m)."""
    n = 0
    for d, b in zip(drafts, best, strict=False):  # (best has one more)
        if d != b:
            break
        n += 1
    return n


def verify_sample(drafts: Tensor, q: Tensor, p: Tensor, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Exact speculative sampling (Leviathan et al.) -> (n [B] accepted, out [B, k+1], filler past n): draft token i,
    drawn from q, accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection n the next token is
    drawn from max(0, p_n - q_n) renormalised (p_n if that is all zero), after k accepted the bonus token from p_k."""
    B, k = drafts.shape
    if k == 0:  # no draft: a draw from p_0, what the rule below comes to, without its tensors
        nxt = sample(p[:, 0].float(), generator)  # [B]
        return nxt.new_zeros(B), nxt.unsqueeze(1)
    V = p.shape[-1]
    idx = drafts.unsqueeze(-1)  # [B, k, 1]
    q_x = q.gather(-1, idx).squeeze(-1).float()  # [B, k]
    p_x = p[:, :k].gather(-1, idx).squeeze(-1).float()  # [B, k]
    u = torch.rand(B, k, generator=generator, device=p.device)  # [B, k] in [0, 1)
    n = (u * q_x < p_x).long().cumprod(dim=-1).sum(dim=-1)  # [B] the leading run of acceptances
    q_pad = torch.cat([q, q.new_zeros(B, 1, V)], dim=1)  # [B, k+1, V]: a zero row at the bonus position k
    at_n = n.view(B, 1, 1).expand(B, 1, V)  # [B, 1, V]
    p_n = p.gather(1, at_n).squeeze(1).float()  # [B, V]
    q_n = q_pad.gather(1, at_n).squeeze(1).float()  # [B, V]
    residual = (p_n - q_n).clamp_min(0.0)  # [B, V]
    has_mass = residual.sum(dim=-1, keepdim=True) > 0  # [B, 1]
    nxt = sample(torch.where(has_mass, residual, p_n), generator)  # [B]
    out = torch.cat([drafts, nxt.unsqueeze(1)], dim=1)  # [B, k+1]
    out.scatter_(1, n.unsqueeze(1), nxt.unsqueeze(1))  # out[:, n] = next token
    return n, out
