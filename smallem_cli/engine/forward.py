"""Passes over a flattened batch (`batch.BatchStep`): the target, a draft, the MTP module. With the
model's native steps a pass is one C call; else the eager pass below, the reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..backends.native import KV_DTYPE, NativeSteps
from ..kv.step import BatchStep
from ..model.llama import Block, MTPModule, Transformer, gated, unit_rms


def slab_for(model: Transformer | MTPModule, n_slots: int, device: torch.device) -> Tensor:
    """A model's K/V for the pool: [layer, K or V, kv head, n_slots, head dim] (the MTP module: one layer)."""
    c = model.cfg
    layers = 1 if isinstance(model, MTPModule) else c.n_layers
    # zeros, written at once: a lazily mapped slab (pages resident when first written) was slower, by its page
    # faults inside every run (docs/benchmarks.md, "2026-12-06, third session"); the pool starts small instead
    return torch.zeros(layers, 2, c.n_kv_heads, n_slots, c.head_dim, device=device, dtype=KV_DTYPE)


def attend(q: Tensor, kv: Tensor, bias: Tensor | None, Hkv: int, G: int) -> Tensor:
    """One sequence's attention, q [T, H*D] over kv [2, Hkv, S, D] (bias [T, S] or None) -> [T, H*D]. By hand:
    SDPA's CPU fallback for masks and groups costs several times more. Query heads j*G + g share kv head j."""
    T, D = q.shape[0], kv.shape[-1]
    H = Hkv * G
    kv = kv.to(q.dtype)
    q = q.view(T, Hkv, G, D)
    q = q.view(Hkv, G, D) if T == 1 else q.permute(1, 2, 0, 3).reshape(Hkv, G * T, D)
    s = torch.bmm(q, kv[0].transpose(1, 2))  # [Hkv, G*T, S]
    if bias is not None:
        s = (s.view(Hkv, G, T, -1) + bias).view(Hkv, G * T, -1)
    o = torch.bmm(torch.softmax(s, dim=-1), kv[1])  # [Hkv, G*T, D]
    return o.view(1, H * D) if T == 1 else o.view(Hkv, G, T, D).permute(2, 0, 1, 3).reshape(T, H * D)


def block_pass(blk: Block, x: Tensor, rope: Tensor, kv: Tensor, b: BatchStep) -> Tensor:
    """x [N, d] -> [N, d] through one block; kv: this layer's slab, written at b.slots (a row sees its own key, and
    in a local layer the `blk.window` keys up to it)."""
    p = blk.packed
    assert p is not None, "call pack() before decoding"
    N = x.shape[0]
    H, Hkv, D = blk.n_heads, blk.n_kv_heads, blk.head_dim
    G = H // Hkv
    bias = b.bias if not blk.window else b.window_bias(blk.window)
    B, Tm, S = bias.shape
    y = blk.project(x)  # [N, (H+2Hkv)*D]
    qkv = torch.view_as_real(torch.view_as_complex(y.view(N, -1, 2)) * rope).view(N, -1)
    kv.index_copy_(2, b.slots, qkv[:, H * D :].view(N, 2, Hkv, D).permute(1, 2, 0, 3).to(kv.dtype))
    if b.base is not None:  # one sequence, its pages in order: its keys are one view of the slab,
        # attended without a gather (one token sees every key: no mask)
        one = N == 1 and not blk.window  # one token sees every key: no mask
        att = attend(qkv[:, : H * D], kv[:, :, b.base : b.base + S], None if one else bias[0], Hkv, G)
    else:
        keys = kv.index_select(2, b.kv_slots.flatten()).to(x.dtype)  # [2, Hkv, B * S, D]
        keys = keys.view(2, Hkv, B, S, D).transpose(1, 2)  # [2, B, Hkv, S, D]
        q = qkv[:, : H * D][b.q_rows]  # [B, Tm, H*D]: rows (g, t) per kv head, grouped per kv head
        q = q.view(B, Tm, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * Tm, D)
        s = (q @ keys[0].transpose(-1, -2)).view(B, Hkv, G, Tm, S) + bias[:, None, None]  # [B, Hkv, G, Tm, S]
        o = torch.softmax(s, dim=-1).view(B, Hkv, G * Tm, S) @ keys[1]  # [B, Hkv, G*Tm, D]
        att = o.view(B, Hkv, G, Tm, D).permute(0, 3, 1, 2, 4).reshape(B * Tm, H * D)[b.out_rows]  # [N, H*D]
    x = blk.residual(x, att, "o", "ao")
    gu = unit_rms(x, blk.eps) @ p["gu"]  # [N, 2F]
    f = gu.shape[-1] // 2
    return blk.residual(x, gated(gu[:, :f], gu[:, f:], blk.geglu), "down", "mo")


def transformer_pass(
    model: Transformer, slab: Tensor, ids: Tensor, b: BatchStep, head: str = "all", steps: NativeSteps | None = None,
    taps: tuple[int, ...] = (),
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """ids [N] -> (logits, hidden [N, d], or with `taps` those layers' outputs [N, len(taps) * d]). head: "all"
    logits [N, V], "last" [B, V], "none" [0, V]."""
    if steps is not None:
        return steps.batch(ids, None, slab, b, head, taps=taps)
    assert model.eager().rope_packed is not None
    assert model.rope_packed_local is not None
    rope = model.rope_packed[b.positions]  # [N, P]
    local = model.rope_packed_local[b.positions] if model.cfg.local_layers else rope
    x = model.embed(ids)  # [N, d]
    tapped = {}
    for i, blk in enumerate(model.layers):
        x = block_pass(blk, x, local if blk.window else rope, slab[i], b)  # type: ignore[arg-type]
        if i in taps:
            tapped[i] = x
    hidden = torch.cat([tapped[i] for i in taps], dim=1) if taps else x
    if head == "none":
        return x.new_empty(0, model.cfg.vocab_size), hidden
    return model.logits(x[b.last] if head == "last" else x), hidden


def mtp_pass(
    mtp: MTPModule, target: Transformer, slab: Tensor, h: Tensor, ids: Tensor, b: BatchStep, steps: NativeSteps | None
) -> Tensor:
    """Pairs (h_j [N, d], token j+1 [N]) -> the module's states [N, d], through its one-layer slab."""
    if steps is not None:
        return steps.batch(ids, h, slab, b)[1]
    assert mtp.proj_t is not None and target.eager().rope_packed is not None, "pack() first"
    d = mtp.cfg.dim
    table = mtp.token_table(target.embed_tokens.weight)
    x = torch.addmm(F.embedding(ids, table), unit_rms(h, mtp.cfg.norm_eps), mtp.proj_t[:d])
    return block_pass(mtp.block, x, target.rope_packed[b.positions], slab[0], b)
