"""Weights in blocks along a row, as GGUF's block types store them: W[n, k] = d[n, k // B] * q[n, k] + m[n, k // B],
q small integers (int8), B = 32 weights a scale (16 for Q6_K), d and m float16 where that holds them exactly (Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1: the file's own float16) and else float32. A K-quant's scale is a float16 times a 6- or 8-bit
integer, up to 19 significant bits: float32 holds every one exactly, float16 seldom.

The native backend reads a quantized file's matrices as their blocks (`backends.native.blocks`: q made unsigned,
`BIAS`, in 4 bits where it fits, `NIBBLES`; a K-quant's scales as the file factors them, `Factors`), rather than as
their float32 values (four bytes); the eager path computes with `values`, the same numbers as `gguf`'s own
dequantization, bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

# the GGUF type -> (the bytes of a block, the weights it holds); a K-quant's block is a super-block of 256
KINDS = {
    "Q8_0": (34, 32), "Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32), "Q5_1": (24, 32),
    "Q4_K": (144, 256), "Q5_K": (176, 256), "Q6_K": (210, 256),
}  # fmt: skip
# What each type's q gains to be unsigned (0 <= q + BIAS < 256), and the types where that is under 16.
BIAS = {"Q8_0": 128, "Q4_0": 8, "Q4_1": 0, "Q5_0": 16, "Q5_1": 0, "Q4_K": 0, "Q5_K": 0, "Q6_K": 32}
NIBBLES = frozenset({"Q4_0", "Q4_1", "Q4_K"})
SUPER = 256  # a K-quant's super-block: the weights along a row one float16 `Factors.d` (and `dmin`) covers


@dataclass(frozen=True)
class Factors:
    """A K-quant's scales as its file factors them: block b's scale is d[b // per] * sc[b] and its offset
    dmin[b // per] * mn[b], per = SUPER // block, d and dmin float16 (dmin negated: the offset is minus the file's
    dmin times the min), sc and mn small integers (6 bits; Q6_K's sc 8 bits, signed). A float16 times an integer of at
    most 8 bits is exact in float32: the products are `Blocked.d` and `.m`, bit for bit, in an eighth of the bytes."""

    d: torch.Tensor  # float16 [N, K // SUPER]
    sc: torch.Tensor  # int8 [N, K // block]
    dmin: torch.Tensor | None  # float16 [N, K // SUPER], or None (Q6_K: no offset)
    mn: torch.Tensor | None  # int8 [N, K // block]

    def rows(self, f: Callable[[torch.Tensor], torch.Tensor]) -> Factors:
        return Factors(f(self.d), f(self.sc), _opt(f, self.dmin), _opt(f, self.mn))


def _opt(f: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else f(t)


@dataclass(frozen=True)
class Blocked:
    q: torch.Tensor  # int8 [N, K]
    d: torch.Tensor  # float16 or float32 [N, K // block]
    m: torch.Tensor | None  # d's dtype, [N, K // block]; None: no offset (Q8_0, Q4_0, Q5_0, Q6_K)
    kinds: frozenset[str]  # the GGUF types its rows came from
    block: int = 32  # the weights along a row that share a scale and offset: 32, or 16
    factors: Factors | None = None  # a K-quant's d and m as the file factors them, or None

    def values(self) -> torch.Tensor:
        """The float32 matrix [N, K], each value d * q (+ m) in float32, as `gguf.quants` computes it."""
        w = self.d.float().repeat_interleave(self.block, dim=1) * self.q.float()
        return w if self.m is None else w + self.m.float().repeat_interleave(self.block, dim=1)

    def rows(self, f: Callable[[torch.Tensor], torch.Tensor]) -> Blocked:
        """The same rows rearranged by f (a function of dim 0 only), in q, d and m alike."""
        factors = None if self.factors is None else self.factors.rows(f)
        return replace(self, q=f(self.q), d=f(self.d), m=_opt(f, self.m), factors=factors)


def cat(parts: list[Blocked]) -> Blocked:
    """Rows of several matrices of the same K, one below the other, in their common block length (16 where any part
    has 16: a block of 32's scale and offset repeated, the same values) and scale type (float32 where any part needs
    it, which holds a float16 exactly); offsets -0.0 where a part has none (x + -0.0 is x, -0.0 included)."""
    block = min(p.block for p in parts)
    dtype = torch.float32 if any(p.d.dtype == torch.float32 for p in parts) else torch.float16

    def scales(p: Blocked, t: torch.Tensor | None) -> torch.Tensor:
        t = p.d.new_full(p.d.shape, -0.0) if t is None else t
        return t.to(dtype).repeat_interleave(p.block // block, dim=1)

    offsets = None
    if any(p.m is not None for p in parts):
        offsets = torch.cat([scales(p, p.m) for p in parts])
    kinds = frozenset().union(*(p.kinds for p in parts))
    factors = None  # kept where every part has them alike (rows of one K-quant type)
    fs = [p.factors for p in parts if p.factors is not None]
    if len(kinds) == 1 and len(fs) == len(parts):
        ds, dmins = torch.cat([f.d for f in fs]), _cat([f.dmin for f in fs])
        factors = Factors(ds, torch.cat([f.sc for f in fs]), dmins, _cat([f.mn for f in fs]))
    q, d = torch.cat([p.q for p in parts]), torch.cat([scales(p, p.d) for p in parts])
    return Blocked(q, d, offsets, kinds, block, factors)


def _cat(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if any(t is None for t in ts) else torch.cat([t for t in ts if t is not None])


def from_gguf(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> Blocked:
    """A GGUF tensor's bytes (uint8, any shape) of type `kind` holding a [N, K] matrix -> its blocks."""
    N, K = shape
    size, per = KINDS[kind]
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(N, K // per, size)
    q, d, m, block = _DECODE[kind](b)
    q = torch.from_numpy(np.ascontiguousarray(q, dtype=np.int8).reshape(N, K))
    d, m = d.reshape(N, K // block), None if m is None else m.reshape(N, K // block)
    if d.dtype != np.float16 and _exact16(d, m):
        d, m = d.astype(np.float16), None if m is None else m.astype(np.float16)
    factors = _factors(b, kind, N) if kind.endswith("_K") else None
    dt, mt = torch.from_numpy(d), None if m is None else torch.from_numpy(m)
    return Blocked(q, dt, mt, frozenset([kind]), block, factors)


def _factors(b: np.ndarray, kind: str, N: int) -> Factors:
    """A K-quant's blocks [N, supers, bytes] -> its scales as the file factors them."""

    def t(a: np.ndarray, dtype: type) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype).reshape(N, -1))

    if kind == "Q6_K":
        return Factors(t(_f16(b, 208), np.float16), t(b[..., 192:208].view(np.int8), np.int8), None, None)
    sc, mn = _k_ints(b)
    return Factors(t(_f16(b, 0), np.float16), t(sc, np.int8), t(-_f16(b, 2), np.float16), t(mn, np.int8))


def _exact16(d: np.ndarray, m: np.ndarray | None) -> bool:
    """Whether float16 holds every scale and offset exactly (so the kernels read half as many bytes of them)."""
    with np.errstate(over="ignore"):
        return all(np.array_equal(t.astype(np.float16).astype(np.float32), t) for t in (d, m) if t is not None)


_Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None, int]  # q [N, blocks, ...], d, m, weights a scale


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of every block [N, blocks, bytes] -> [N, blocks]."""
    return b[..., at : at + 2].copy().view(np.float16)[..., 0]


def _nibbles(b: np.ndarray) -> np.ndarray:
    """Bytes [..., n] -> [..., 2n]: the n low nibbles, then the n high ones."""
    return np.concatenate([b & 0x0F, b >> 4], axis=-1)


def _q8_0(b: np.ndarray) -> _Decoded:
    return b[..., 2:].view(np.int8), _f16(b, 0), None, 32


def _q4_0(b: np.ndarray) -> _Decoded:
    return _nibbles(b[..., 2:]).astype(np.int8) - 8, _f16(b, 0), None, 32


def _q4_1(b: np.ndarray) -> _Decoded:
    return _nibbles(b[..., 4:]), _f16(b, 0), _f16(b, 2), 32


def _five(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """A 32-block's fifth bits (4 bytes, weight j at bit j, little-endian) over its nibbles -> values 0-31."""
    return _nibbles(low) | (np.unpackbits(high, axis=-1, bitorder="little") << 4)


def _q5_0(b: np.ndarray) -> _Decoded:
    return _five(b[..., 6:], b[..., 2:6]).astype(np.int8) - 16, _f16(b, 0), None, 32


def _q5_1(b: np.ndarray) -> _Decoded:
    return _five(b[..., 8:], b[..., 4:8]), _f16(b, 0), _f16(b, 2), 32


def _k_ints(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes at 4 of a block -> its 8 scales and 8 mins (6 bits each, uint8): bytes 0-3 hold
    scales 0-3 (6 low bits) and 4-7's top 2 bits, bytes 4-7 the same for the mins, bytes 8-11 scales 4-7's low 4 bits
    (low nibble) and mins 4-7's (high nibble)."""
    s = b[..., 4:16]
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, mn


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's blocks -> d * scale, -dmin * min [N, blocks, 8] (float32, exact)."""
    sc, mn = (x.astype(np.float32) for x in _k_ints(b))
    d, dmin = _f16(b, 0).astype(np.float32), _f16(b, 2).astype(np.float32)
    return d[..., None] * sc, -(dmin[..., None] * mn)


def _k_low(qs: np.ndarray) -> np.ndarray:
    """Q4_K's and Q5_K's 128 bytes of nibbles -> [..., 8, 32]: 32 bytes a pair of sub-blocks, low nibbles first."""
    return _nibbles(qs.reshape(*qs.shape[:-1], 4, 32)).reshape(*qs.shape[:-1], 8, 32)


def _q4_k(b: np.ndarray) -> _Decoded:
    return _k_low(b[..., 16:]), *_k_scales(b), 32


def _q5_k(b: np.ndarray) -> _Decoded:
    # sub-block i's fifth bits: bit i of the 32 bytes at 16, one a weight
    high = (b[..., 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1  # [..., 32, 8]
    return _k_low(b[..., 48:]) | (np.swapaxes(high, -1, -2) << 4), *_k_scales(b), 32


def _q6_k(b: np.ndarray) -> _Decoded:
    # two halves of 128 weights: 64 bytes of nibbles each (weights 0-63 low, 64-127 high), and 32 bytes of 2-bit
    # pairs (weights 32 j + l at bits 2j of byte l); then 16 int8 scales, one a 16 weights, and the float16 d
    lead = b.shape[:-1]
    low = _nibbles(b[..., :128].reshape(*lead, 2, 64))  # [..., 2, 128]
    high = (b[..., 128:192].reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    q = (low | (high.reshape(*lead, 2, 128) << 4)).astype(np.int8) - 32
    scales = b[..., 192:208].view(np.int8).astype(np.float32)
    return q, _f16(b, 208).astype(np.float32)[..., None] * scales, None, 16


_DECODE: dict[str, Callable[[np.ndarray], _Decoded]] = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}  # fmt: skip
