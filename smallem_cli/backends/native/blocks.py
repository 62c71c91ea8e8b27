"""A quantized file's matrices (`model.quant.Blocked`) in the layout of the native kernels' integer products
(`qmatmul.h`), one stream of bytes a panel of `width` output rows (the hardware's prefetcher follows a few streams,
not one for the weights and more for each kind of scale):

- the weights as q + `quant.BIAS` (unsigned), four consecutive ones of a row in one 32-bit lane: [K / 4, width, 4]
  bytes a panel, a vector register being `width` rows by 4 weights; the types whose unsigned q is under 16 in half the
  bytes, two such groups of 4 in the low and high nibbles of one group's bytes: [K / 8, width, 4];
- in units of one block (or a K-quant's 256 weights), each unit's scales first, then its weights: the block's d (and
  m) [width] as the file stores them, float16 (or float32); or a K-quant's as the file factors them (`quant.Factors`):
  d (and dmin) [width] float16, then sc (and mn) [blocks in 256, width] int8.

A fused matrix (q/k/v, gate/up) whose parts are of different types is held as segments, consecutive parts of one
type together, each read in its own width and block length: a Q4_K_M file's 4-bit q and k stay 4-bit beside its
6-bit v."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from torch import Tensor

from ...model import quant

_P, _I = ctypes.c_void_p, ctypes.c_int
W_F16, W_F32, W_FACTORS = 0, 2, 4  # matmul.h's scale kinds of a segment: float16, float32, or `quant.Factors`


class QSeg(ctypes.Structure):
    """`qmatmul.h`'s `QSeg`: one segment of a quantized matrix, `rows` output rows of it."""

    _fields_ = [(n, _I) for n in ("rows", "block", "bias", "nibbles", "skind", "offsets")] + [("w", _P)]


def segments(parts: list[quant.Blocked]) -> list[quant.Blocked]:
    """The parts one below the other, consecutive parts of the same type joined (`quant.cat`)."""
    runs: list[list[quant.Blocked]] = []
    for p in parts:
        if runs and runs[-1][0].kinds == p.kinds:
            runs[-1].append(p)
        else:
            runs.append([p])
    return [quant.cat(r) if len(r) > 1 else r[0] for r in runs]


def by_panel(t: Tensor, width: int) -> Tensor:
    """[N, C] -> [ceil(N / width), C, width], the last padded with zero rows (as `native.panels`)."""
    if pad := -t.shape[0] % width:
        t = torch.cat([t, t.new_zeros(pad, t.shape[1])])
    return t.view(-1, width, t.shape[1]).transpose(1, 2).contiguous()


def unsigned(q: Tensor, bias: int, nibbles: bool, width: int) -> Tensor:
    """int8 q [N, K] -> q + bias as uint8 in the kernels' groups of 4 (module doc), the padding rows zero."""
    N, K = q.shape
    u = q.view(torch.uint8) + bias  # modulo 256: q + bias itself, which lies in 0..255
    if pad := -N % width:
        u = torch.cat([u, u.new_zeros(pad, K)])
    if nibbles:  # groups 2j and 2j+1 of a row in the low and high nibbles of one group's bytes
        pairs = u.view(-1, width, K // 8, 2, 4)
        u = pairs[..., 0, :] | (pairs[..., 1, :] << 4)
    return u.reshape(-1, width, K // (8 if nibbles else 4), 4).transpose(1, 2).contiguous()


def pack(b: quant.Blocked, width: int, hold: Callable[[Tensor], int], chunk: int = 1 << 14) -> QSeg:
    """One segment (rows of one type) in the kernels' layout (module doc), kept alive by `hold` (-> its address); laid
    out `chunk` rows at a time into the one tensor kept, so that the copies on the way (a 262k-row head's) take a
    chunk's memory, not the matrix's."""
    (kind,) = b.kinds
    bias, nibbles = quant.BIAS[kind], kind in quant.NIBBLES
    assert int(b.q.min()) + bias >= 0 and int(b.q.max()) + bias < (16 if nibbles else 256), kind
    assert b.block == 32 or not nibbles
    N, step = b.q.shape[0], max(width, chunk - chunk % width)
    out: Tensor | None = None
    for r in range(0, N, step):
        part = _panels(b.rows(lambda t, r=r: t[r : r + step]), width, bias, nibbles)  # [panels, units, bytes]
        if out is None:
            out = torch.empty(-(-N // width), *part.shape[1:], dtype=torch.uint8)
        out[r // width : r // width + part.shape[0]] = part
    assert out is not None
    skind = W_FACTORS if b.factors is not None else W_F32 if b.d.dtype == torch.float32 else W_F16
    return QSeg(N, b.block, bias, int(nibbles), skind, int(b.m is not None), hold(out))


def _panels(b: quant.Blocked, width: int, bias: int, nibbles: bool) -> Tensor:
    """`pack`'s layout of some rows: [panels, units, a unit's scales then its weights] bytes."""
    f = b.factors
    if f is not None:  # units of 256 weights: d, dmin [width] float16, then sc, mn [blocks, width] int8
        units, per = b.q.shape[1] // quant.SUPER, quant.SUPER // b.block
        head = [by_panel(t, width) for t in (f.d, f.dmin) if t is not None]
        head += [by_panel(t, width).view(-1, units, per * width) for t in (f.sc, f.mn) if t is not None]
        unit = quant.SUPER
    else:  # units of a block: its d, m [width]
        head = [by_panel(t, width) for t in (b.d, b.m) if t is not None]
        unit = b.block
    units = b.q.shape[1] // unit
    weights = unsigned(b.q, bias, nibbles, width).view(-1, units, unit * width // (2 if nibbles else 1))
    return torch.cat([t.contiguous().view(torch.uint8) for t in head] + [weights], dim=2)


def held_array(segs: list[QSeg]) -> Tensor:
    """The segments as the C array a `Mat` points at, in a tensor's bytes (kept with the model's tensors)."""
    arr = (QSeg * len(segs))(*segs)
    buf = torch.empty(ctypes.sizeof(arr), dtype=torch.uint8)
    ctypes.memmove(buf.data_ptr(), ctypes.addressof(arr), ctypes.sizeof(arr))
    return buf
