"""Train the MTP module on the chain it runs (a "training-time test", EAGLE-3's name).

At inference the module's guess j+1 reads its own output state from guess j in place of the
target's (not computed yet), and attends to the true context plus the chain's own earlier entries.
Here every position t starts a chain of `depth` steps, all in parallel: step 1 reads (h_t, x_{t+1}),
causal over the true entries; step d reads (out_{d-1}[t], x_{t+d}) at position t+d-1 and attends to
the true entries 0..t and the chain's own entries of steps 2..d at t. out_d[t] is fitted to the
target's distribution for token t+d+1. Teacher forcing (step d reads the text's x_{t+d}) is exact
whenever the guesses before were right, the only case in which guess d counts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.llama import MTPModule, Transformer, apply_rope
from .fit import Fit, LossFn, fit_loss, student_logits, teacher_log_p


def _chain_attention(
    q: torch.Tensor, k_true: torch.Tensor, v_true: torch.Tensor, k_own: list[torch.Tensor], v_own: list[torch.Tensor]
) -> torch.Tensor:
    """q [B, H, n, D] of chains t = 0..n-1; k_true, v_true [B, H, >=n, D] (step 1's, key j at
    position j, visible when j <= t); k_own, v_own: one [B, H, n, D] per chain step (the chain's
    own entry at t) -> [B, H, n, D]."""
    n, D = q.shape[2], q.shape[3]
    s_true = q @ k_true[:, :, :n].transpose(-1, -2) / D**0.5  # [B, H, n, n]
    rows = torch.arange(n, device=q.device)
    s_true = s_true.masked_fill(rows[None, :] > rows[:, None], float("-inf"))
    s_own = torch.stack([(q * k).sum(-1) for k in k_own], dim=-1) / D**0.5  # [B, H, n, steps]
    p = torch.softmax(torch.cat([s_true, s_own], dim=-1), dim=-1)
    out = p[..., :n] @ v_true[:, :, :n]
    for j, v in enumerate(v_own):
        out = out + p[..., n + j, None] * v
    return out


def chain_states(
    mtp: MTPModule, target: Transformer, h: torch.Tensor, x: torch.Tensor, depth: int
) -> list[torch.Tensor]:
    """h [B, T, d] (the target's states), x [B, T] (the tokens) -> out_d [B, T-d, d], d = 1..depth:
    the module's state after the d-th step of the chain started at each position t."""
    blk = mtp.block
    B, T, _ = h.shape
    H, Hkv, Dh = blk.n_heads, blk.n_kv_heads, blk.head_dim
    outs: list[torch.Tensor] = []
    k_true = v_true = torch.empty(0)
    k_own: list[torch.Tensor] = []
    v_own: list[torch.Tensor] = []
    for d in range(1, depth + 1):
        n = T - d  # chains whose step d has its token x_{t+d}
        state = h[:, :n] if d == 1 else outs[-1][:, :n]
        z = mtp.eh_proj(torch.cat([mtp.hnorm(state), mtp.enorm(target.embed_tokens(x[:, d : d + n]))], dim=-1))
        cos, sin = target.cos[d - 1 : d - 1 + n], target.sin[d - 1 : d - 1 + n]  # position t + d - 1
        a = blk.input_layernorm(z)
        q = apply_rope(blk.q_proj(a).view(B, n, H, Dh), cos, sin).transpose(1, 2)  # [B, H, n, D]
        k = apply_rope(blk.k_proj(a).view(B, n, Hkv, Dh), cos, sin).transpose(1, 2)
        v = blk.v_proj(a).view(B, n, Hkv, Dh).transpose(1, 2)
        if H != Hkv:
            k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
        if d == 1:
            k_true, v_true = k, v
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            k_own = [kk[:, :, :n] for kk in k_own] + [k]
            v_own = [vv[:, :, :n] for vv in v_own] + [v]
            att = _chain_attention(q, k_true, v_true, k_own, v_own)
        z = z + blk.o_proj(att.transpose(1, 2).reshape(B, n, H * Dh))
        g = blk.post_attention_layernorm(z)
        outs.append(z + blk.down_proj(F.silu(blk.gate_proj(g)) * blk.up_proj(g)))
    return outs


def chain_loss(target: Transformer, mtp: MTPModule, fit: Fit, ids: torch.Tensor | None, depth: int) -> LossFn:
    """`loop.distill`'s loss for a chain of `depth` guesses (those the proposer runs at k = depth):
    the mean of every step's fit to the frozen target."""

    def loss_fn(x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        inp = x[:, :-2]
        with torch.no_grad():
            h = target.hidden(inp)
            teacher = teacher_log_p(fit, target.logits(h).float(), ids)  # [B, T, V or N]: row j predicts token j+1
        losses, extra = [], {}
        for d, o in enumerate(chain_states(mtp, target, h, inp, depth), 1):
            rows = slice(d, d + o.shape[1])  # out_d[t] guesses token t+d+1: the target's view of it is row t+d
            view = [(lp[:, rows], lp_fit[:, rows]) for lp, lp_fit in teacher]
            loss, read = fit_loss(fit, view, student_logits(target, o, ids))
            losses.append(loss)
            extra |= {f"{k}/{d}": v for k, v in read.items()}
        return torch.stack(losses).mean(), extra

    return loss_fn
