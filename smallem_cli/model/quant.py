"""Weights in blocks of 32 along a row, as GGUF's Q8_0, Q4_0 and Q4_1 store them:
W[n, k] = d[n, k // 32] * q[n, k] + m[n, k // 32], d and m float16, q small integers.

The native backend reads a quantized file's matrices this way, a byte a weight, rather than as their float32 values
(four); the eager path computes with `values`, the same numbers as `gguf`'s own dequantization."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32
KINDS = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}  # the GGUF type -> the bytes of a block


@dataclass(frozen=True)
class Blocked:
    q: torch.Tensor  # int8 [N, K]
    d: torch.Tensor  # float16 [N, K // 32]
    m: torch.Tensor | None  # float16 [N, K // 32]; None: no offset (Q8_0, Q4_0)
    kinds: frozenset[str]  # the GGUF types its rows came from

    def values(self) -> torch.Tensor:
        """The float32 matrix [N, K], each value d * q (+ m) in float32, as `gguf.quants` computes it."""
        w = self.d.float().repeat_interleave(BLOCK, dim=1) * self.q.float()
        return w if self.m is None else w + self.m.float().repeat_interleave(BLOCK, dim=1)

    def rows(self, f: Callable[[torch.Tensor], torch.Tensor]) -> Blocked:
        """The same rows rearranged by f (a function of dim 0 only), in q, d and m alike."""
        return Blocked(f(self.q), f(self.d), None if self.m is None else f(self.m), self.kinds)


def cat(parts: list[Blocked]) -> Blocked:
    """Rows of several matrices of the same K, one below the other (offsets 0 where a part has none)."""
    offsets = None
    if any(p.m is not None for p in parts):
        offsets = torch.cat([p.d.new_zeros(p.d.shape) if p.m is None else p.m for p in parts])
    kinds = frozenset().union(*(p.kinds for p in parts))
    return Blocked(torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), offsets, kinds)


def from_gguf(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> Blocked:
    """A GGUF tensor's bytes (uint8, any shape) of type `kind` holding a [N, K] matrix -> its blocks."""
    N, K = shape
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(N, K // BLOCK, KINDS[kind])
    d = torch.from_numpy(b[..., :2].copy().view(np.float16)[..., 0])
    if kind == "Q8_0":
        q, m = b[..., 2:].view(np.int8), None
    else:
        nibbles = b[..., 4:] if kind == "Q4_1" else b[..., 2:]  # 16 bytes: values 0-15 low, 16-31 high
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.int8)
        if kind == "Q4_0":
            q -= 8
        m = torch.from_numpy(b[..., 2:4].copy().view(np.float16)[..., 0]) if kind == "Q4_1" else None
    return Blocked(torch.from_numpy(np.ascontiguousarray(q).reshape(N, K)), d, m, frozenset([kind]))
