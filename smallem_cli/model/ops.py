"""Two products of the eager decode path, each written the way that measured fastest on a CPU."""

from __future__ import annotations

import torch


def head_matmul(x: torch.Tensor, w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [M, d] @ w [d, V] for a wide output head, `rows` being w transposed ([V, d], contiguous).
    MKL's GEMM for a few rows against a wide matrix costs several times its one-row case, where the
    transposed product does not: one row takes x @ w, three or more the other."""
    if x.dim() == 2 and x.shape[0] >= 3:
        return (rows @ x.t()).t().contiguous()  # [M, V]
    return x @ w


def attend(q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor | None, Hkv: int, G: int) -> torch.Tensor:
    """One sequence's attention: queries q [T, H*D] over its keys and values kv [2, Hkv, S, D] (bias
    [T, S] additive, None when every key is visible) -> [T, H*D]. By hand, as SDPA's CPU fallback for
    masks and groups costs several times more: query heads h = j*G + g share kv head j, rows (g, t)."""
    T, D = q.shape[0], kv.shape[-1]
    H = Hkv * G
    q = q.view(T, Hkv, G, D)
    q = q.view(Hkv, G, D) if T == 1 else q.permute(1, 2, 0, 3).reshape(Hkv, G * T, D)
    s = torch.bmm(q, kv[0].transpose(1, 2))  # [Hkv, G*T, S]
    if bias is not None:
        s = (s.view(Hkv, G, T, -1) + bias).view(Hkv, G * T, -1)
    o = torch.bmm(torch.softmax(s, dim=-1), kv[1])  # [Hkv, G*T, D]
    return o.view(1, H * D) if T == 1 else o.view(Hkv, G, T, D).permute(2, 0, 1, 3).reshape(T, H * D)
