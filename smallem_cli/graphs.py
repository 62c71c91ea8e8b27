"""The decode step as a pure graph, for ahead-of-time compilation (`aot.py`).

The eager decode path (`Block.decode`) writes the new K/V into the paged cache, then
attends over the whole visible range. A compiled graph must not do that: a cache mutated
inside the graph is copied whole at every call, which costs more than the step itself.
Here the cache is an input that is only read:

    inputs   tokens [T] (or the MTP's state h [T, d] and tokens [T]), the rope tables of
             the new positions cos, sin [T, P], and `past` [L, K or V, kv heads, S, D],
             a view of the slab over the S positions before the new tokens (S varies);
    outputs  logits and/or hidden states, and new_kv [L, K or V, kv heads, T, D], which
             the caller writes into the cache with one index_copy_ (`PagedKVCache.write_all`).

Attention is split in two, so that the past is never concatenated with the new keys:
scores against the past [.., S] and against the new tokens [.., T] (causal among
themselves) share one softmax, then both halves multiply their values. Every product is
written so that inductor generates it (its C++ micro-GEMM for the weights, fused loops for
attention): an op it leaves to ATen costs a call, and the small-M GEMM behind it.

T is fixed per graph (a pass over 1, 2, ... 16 tokens each gets its own), S is dynamic.
Everything the graphs compute matches the eager path to float32 rounding
(tests/test_compiled.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .model import Block, MTPModule, Transformer


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, as the eager `model.unit_rms` (which caches an eps tensor:
    a tensor made while tracing must not outlive the trace). Inductor fuses it into one loop."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def _rope(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Turn each adjacent pair of y's columns: y [T, 2P], cos, sin [T, P] -> [T, 2P].

    The real form of the eager path's complex multiply (`packed_rope`: v's pairs turn by 0).
    """
    T = y.shape[0]
    a, b = y.view(T, -1, 2).unbind(-1)  # [T, P] each
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).view(T, -1)


class _Layer(nn.Module):
    """One block's packed weights as buffers (constants of the compiled graph)."""

    def __init__(self, blk: Block) -> None:
        super().__init__()
        assert blk.packed is not None, "pack() the model first"
        self.n_heads, self.n_kv_heads, self.head_dim, self.eps = blk.n_heads, blk.n_kv_heads, blk.head_dim, blk.eps
        for name, w in blk.packed.items():
            self.register_buffer(name, w)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past: torch.Tensor, last: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d], past [K or V, Hkv, S, D] -> (x [T or 1, d], new K/V [K or V, Hkv, T, D])."""
        T = x.shape[0]
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        G = H // Hkv
        y = _rope(unit_rms(x, self.eps) @ self.qkv, cos, sin)  # [T, (H+2Hkv)*D]
        new = y[:, H * D :].view(T, 2, Hkv, D).permute(1, 2, 0, 3)  # [2, Hkv, T, D]
        q = y[:, : H * D]
        rows = torch.arange(T, device=x.device)
        mask = torch.zeros(T, T, device=x.device).masked_fill(rows[None, :] > rows[:, None], float("-inf"))
        if last and T > 1:  # only the last position's output is wanted: it sees every key
            x, q, mask, T = x[-1:], q[-1:], mask[-1:], 1
        # Attention as products and sums, not bmm: inductor fuses them into its own loops, where
        # a bmm is a call into ATen per layer and half (measured: v(5) 1.89 -> 1.39).
        q = q.reshape(T, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * T, 1, D)  # rows (g, t) per kv head
        s_past = (q * past[0][:, None]).sum(-1)  # [Hkv, G*T, S]
        s_new = ((q * new[0][:, None]).sum(-1).view(Hkv, G, T, -1) + mask).view(Hkv, G * T, -1)
        S = past.shape[2]
        p = torch.softmax(torch.cat([s_past, s_new], dim=-1), dim=-1)  # [Hkv, G*T, S+T']
        o = (p[..., :S, None] * past[1][:, None]).sum(-2) + (p[..., S:, None] * new[1][:, None]).sum(-2)
        att = o.view(Hkv, G, T, D).permute(2, 0, 1, 3).reshape(T, H * D)  # [T, H*D]
        x = x + att @ self.o
        gu = unit_rms(x, self.eps) @ self.gu  # [T, 2F]
        f = gu.shape[-1] // 2
        return x + (F.silu(gu[:, :f]) * gu[:, f:]) @ self.down, new


class TransformerStep(nn.Module):
    """A Transformer's pass over T new tokens: (tokens, cos, sin, past) -> (logits, hidden, new_kv).

    `head`: logits [T', V] (else an empty [0, V]); `last`: only the last position's
    hidden state and logits (T' = 1), as `Transformer.forward(last=True)`.
    """

    def __init__(self, model: Transformer, head: bool, last: bool) -> None:
        super().__init__()
        assert model.head_t is not None, "pack() the model first"
        self.head, self.last, self.eps = head, last, model.cfg.norm_eps
        self.register_buffer("embed", model.embed_tokens.weight.detach())
        self.register_buffer("head_t", model.head_t)
        self.layers = nn.ModuleList(_Layer(b) for b in model.layers)  # type: ignore[arg-type]

    def forward(
        self, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = F.embedding(tokens, self.embed)  # [T, d]
        news = []
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            x, new = layer(x, cos, sin, past[i], self.last and i == n - 1)
            news.append(new)
        logits = unit_rms(x, self.eps) @ self.head_t if self.head else x[:0]
        return logits, x, torch.stack(news)  # [T', V] (or [0, d]), [T', d], [L, 2, Hkv, T, D]


class MTPStep(nn.Module):
    """The MTP module's pass over T pairs (h_j, x_{j+1}): (h, tokens, cos, sin, past) -> (hidden, new_kv)."""

    def __init__(self, mtp: MTPModule, embed: torch.Tensor, last: bool) -> None:
        super().__init__()
        assert mtp.proj_t is not None, "pack() the module first"
        d = mtp.cfg.dim
        self.last, self.eps = last, mtp.cfg.norm_eps
        self.register_buffer("table", mtp.token_table(embed))  # [V, d]
        self.register_buffer("proj_h", mtp.proj_t[:d].contiguous())  # [d, d]
        self.layer = _Layer(mtp.block)

    def forward(
        self, h: torch.Tensor, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.addmm(F.embedding(tokens, self.table), unit_rms(h, self.eps), self.proj_h)  # [T, d]
        x, new = self.layer(x, cos, sin, past[0], self.last)
        return x, new[None]  # [T', d], [1, 2, Hkv, T, D]
