"""Training an EAGLE head (`model.eagle`) on its data (`eagle_data`): training-time test over `DEPTH` unrolled steps,
on soft targets.

Step 1 at each position t reads the fused taps at t and token t+1, as the head's first draft does; step j > 1 reads
the head's own state from step j-1 and token t+j, at position t+j-1, and attends, as a chained draft does, to step
1's entries up to t and to its own chain's (EAGLE-3's training-time test, HASS's deeper positions). Each step is
fitted to the target's distribution for its token restricted to the head's vocabulary (its softmax over those rows
alone, from the saved last-layer state), on the answers' tokens; deeper steps weigh DECAY^(j-1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..model.eagle import EagleHead
from ..model.llama import Transformer, apply_rope, gated, unit_rms
from .eagle_data import Shards
from .loop import ProgressFn, TrainSettings, train_loop

DEPTH = 3  # unrolled steps
DECAY = 0.8
HELD_OUT_EVERY = 20  # one document in 20 is validation


class Teacher:
    """What the loss reads of the frozen target: its token embedding, and its head's rows for the head's tokens
    with its final norm folded in."""

    def __init__(self, embed: Tensor, rows: Tensor, eps: float) -> None:
        self.embed, self.rows, self.eps = embed, rows, eps  # [V, d], [N, d]

    @classmethod
    def of(cls, target: Transformer, ids: Tensor) -> Teacher:
        rows = target.floats(target.head_name)[ids] * target.floats("norm.weight")[None]
        return cls(target.floats("embed_tokens.weight"), rows.contiguous(), target.cfg.norm_eps)

    def log_p(self, state: Tensor) -> Tensor:
        """The target's last-layer states [..., d] -> its log-distribution over the head's tokens [..., N]."""
        return F.log_softmax(unit_rms(state.float(), self.eps) @ self.rows.t(), dim=-1)


def new_head(target: Transformer, taps: tuple[int, ...], ids: Tensor, seed: int) -> EagleHead:
    """A new head for `target`: its output rows (frozen) and its norm (to train) the target's own for its tokens, its
    projection the top tap's identity (so that it starts as an MTP module would), the rest drawn by `seed`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = EagleHead(target.cfg, taps, ids)
    d = target.cfg.dim
    head.take_rows(target)
    with torch.no_grad():
        head.norm.weight.copy_(target.floats("norm.weight"))
        head.fc.weight.zero_()
        head.fc.weight[:, (len(taps) - 1) * d :].copy_(torch.eye(d))
    return head


def windows(shards: Shards, train: bool, seq_len: int, seed: int, step: int, batch: int) -> Tensor:
    """[batch, seq_len + 2] stream positions: windows of the training documents (or validation ones)."""
    rng = np.random.default_rng((seed, step, int(train)))
    n = shards.tokens.shape[0] - seq_len - 2
    starts = rng.integers(0, n, size=batch)
    return torch.from_numpy(starts)[:, None] + torch.arange(seq_len + 2)


def is_train(shards: Shards) -> Tensor:
    return shards.docs % HELD_OUT_EVERY != HELD_OUT_EVERY // 2


def _attend(blk: Any, x: Tensor, pos: slice, cos: Tensor, sin: Tensor, first: tuple[Tensor, Tensor] | None,
            chain: list[tuple[Tensor, Tensor]], mask: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:  # fmt: skip
    """One block's attention for one step, x [B, T, d] -> (its output [B, T, d], its keys and values): keys of step 1
    at t' <= t (`mask` [B, T, T]) and the chain's steps before it at t, then its own."""
    B, T, _ = x.shape
    H, Hkv, D = blk.n_heads, blk.n_kv_heads, blk.head_dim
    h = blk.input_layernorm(x)
    q, k = blk.q_proj(h).view(B, T, H, D), blk.k_proj(h).view(B, T, Hkv, D)
    if blk.q_norm is not None:
        q, k = blk.q_norm(q), blk.k_norm(k)
    q, k = apply_rope(q, cos[pos], sin[pos]), apply_rope(k, cos[pos], sin[pos])
    v = blk.v_proj(h).view(B, T, Hkv, D)
    k, v = (t.repeat_interleave(H // Hkv, dim=2) for t in (k, v))  # [B, T, H, D]
    mine = (k, v)
    k1, v1 = first if first is not None else mine
    s1 = torch.einsum("bthd,bshd->bhts", q, k1) * blk.scale
    s1 = s1.masked_fill(~mask[:, None], float("-inf"))
    diag = [(q * kk).sum(-1).transpose(1, 2)[..., None] * blk.scale for kk, _ in [*chain, mine]] if first else []
    p = torch.softmax(torch.cat([s1, *diag], dim=-1), dim=-1)  # [B, H, T, T + steps]
    out = torch.einsum("bhts,bshd->bthd", p[..., :T], v1)
    for i, (_, vv) in enumerate([*chain, mine] if first else []):
        out = out + p[..., T + i].transpose(1, 2)[..., None] * vv
    return blk.o_proj(out.reshape(B, T, H * D)), mine


def unrolled(head: EagleHead, teacher: Teacher, taps: Tensor, tokens: Tensor, docs: Tensor,
             cos: Tensor, sin: Tensor) -> list[Tensor]:  # fmt: skip
    """The head's logits [B, T, N] at each of DEPTH steps over windows of W = T + DEPTH + 1 positions: taps
    [B, W, k d], tokens and documents [B, W]."""
    T = tokens.shape[1] - DEPTH - 1
    blk = head.block
    t = torch.arange(T)
    mask = (t[None, :] <= t[:, None])[None] & (docs[:, :T, None] == docs[:, None, :T])  # [B, T, T]
    state = head.fuse(taps[:, :T])
    first: tuple[Tensor, Tensor] | None = None
    chain: list[tuple[Tensor, Tensor]] = []
    out = []
    for j in range(1, DEPTH + 1):
        e = teacher.embed[tokens[:, j : j + T]]
        x = head.eh_proj(torch.cat([head.hnorm(state), head.enorm(e)], dim=-1))
        a, kv = _attend(blk, x, slice(j - 1, j - 1 + T), cos, sin, first, chain, mask)
        if first is None:
            first = kv
        else:
            chain.append(kv)
        x = x + a
        hh = blk.post_attention_layernorm(x)
        state = x + blk.down_proj(gated(blk.gate_proj(hh), blk.up_proj(hh), blk.geglu))
        out.append(head.lm_head(head.norm(state)).float())
    return out


def ttt_loss(head: EagleHead, teacher: Teacher, shards: Shards, x: Tensor, cos: Tensor, sin: Tensor
             ) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """The loss over windows x [B, W] of stream positions, and each step's agreement with the target's top token."""
    n_taps = len(head.taps)
    states = shards.states[x]  # [B, W, taps + 1, d] float16
    tokens, docs, answer = shards.tokens[x], shards.docs[x], shards.answer[x]
    logits = unrolled(head, teacher, states[:, :, :n_taps].flatten(2).float(), tokens, docs, cos, sin)
    T = x.shape[1] - DEPTH - 1
    loss, extra = logits[0].new_zeros(()), {}
    for j, lg in enumerate(logits, start=1):
        with torch.no_grad():
            lp = teacher.log_p(states[:, j : j + T, n_taps])  # the target's view of token t + j + 1
        # its token an answer's, in the same document as t (whose state the step started from)
        keep = (answer[:, j + 1 : j + 1 + T] & (docs[:, j + 1 : j + 1 + T] == docs[:, :T])).float()
        ce = -(lp.exp() * F.log_softmax(lg, dim=-1)).sum(-1)  # [B, T]
        denom = keep.sum().clamp(min=1)
        loss = loss + DECAY ** (j - 1) * (ce * keep).sum() / denom
        with torch.no_grad():
            extra[f"top1@{j}"] = ((lg.argmax(-1) == lp.argmax(-1)).float() * keep).sum() / denom
    return loss, extra


def train_head(head: EagleHead, teacher: Teacher, shards: Shards, cos: Tensor, sin: Tensor, settings: TrainSettings,
               run_dir: Path, on_progress: ProgressFn | None) -> dict[str, Any]:  # fmt: skip
    """Fit `head` (in place) on `shards`' training documents -> the facts, with its agreement on the held-out ones."""
    train = is_train(shards)
    W = settings.seq_len + 2

    def draw(step: int, held_out: bool = False) -> Tensor:
        """Windows whose first position is a training (or held-out) document's."""
        got = []
        i = 0
        while len(got) < settings.batch_size:
            w = windows(shards, not held_out, W - 2, settings.seed, step * 1000 + i, settings.batch_size)
            got += [r for r in w if bool(train[r[0]]) != held_out]
            i += 1
        return torch.stack(got[: settings.batch_size])

    def loss_fn(x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        return ttt_loss(head, teacher, shards, x, cos, sin)

    def judge() -> dict[str, float]:
        head.eval()
        sums: dict[str, float] = {}
        with torch.no_grad():
            for i in range(8):
                _, extra = ttt_loss(head, teacher, shards, draw(10**9 + i, held_out=True), cos, sin)
                for k, v in extra.items():
                    sums[f"val_{k}"] = sums.get(f"val_{k}", 0.0) + v.item() / 8
        return sums

    return train_loop(loss_fn, {"eagle": head}, draw, settings, run_dir, on_progress, judge)
