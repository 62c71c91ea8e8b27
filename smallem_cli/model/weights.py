"""Weights where a file stores them: each tensor's place and type, read a tensor at a time in its own bytes (float16
stays float16, a quantized file's blocks stay blocks), never the whole model at once. The native backend lays each
one out as it reads it; the eager path widens them to float32 only when it runs (`Transformer.materialize`).

A read is a `pread` into memory of its own, not a view of a memory map: the pages of a mapped file would count
against the process for as long as the map lives, where a read's copy goes once the tensor is laid out."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import struct
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import CheckpointError
from . import quant
from .quant import Blocked

FLOATS = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
# the bytes of safetensors' other dtypes: a file that holds them is read far enough to be refused by name
_WIDTHS = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4}
_WIDTHS |= {"I64": 8, "U64": 8}
_MAX_HEADER = 100 << 20  # a safetensors header past this is not a model's


def interleave_halves(head_dim: int) -> torch.Tensor:
    """Column order [0, D/2, 1, D/2+1, ...] within a head: with the pairs Llama's rope turns adjacent, one
    complex multiply ropes every head; q's and k's dims permuted alike leave q·k unchanged."""
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()


def permute_rope(w: torch.Tensor, n_heads: int, inverse: bool = False) -> torch.Tensor:
    """Rows of Wq or Wk [n_heads*D, in], rotate-half -> `interleave_halves` (llama.cpp's, native's); `inverse`: back."""
    d = w.shape[0] // n_heads
    order = torch.argsort(interleave_halves(d)) if inverse else interleave_halves(d)
    return w.reshape(n_heads, d, *w.shape[1:])[:, order].reshape(w.shape)


@contextmanager
def laid_out() -> Iterator[None]:
    """Around reading a model's tensors into another layout: each read's buffer and each copy made on the way go back
    to the system when freed (glibc's default keeps freed blocks of up to 32 MB in its heap, which the next tensor's
    larger buffer cannot reuse, and the process's peak grows by that much), and what is left free is handed back
    at the end. A no-op where the C library is not glibc."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)  # fixed: glibc's dynamic threshold would rise past our tensors
    try:
        yield
    finally:
        if libc is not None:
            libc.malloc_trim(0)


_M_MMAP_THRESHOLD = -3


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_EXPONENT = {torch.float16: (torch.int16, 0x7C00), torch.bfloat16: (torch.int16, 0x7F80)}
_EXPONENT |= {torch.float32: (torch.int32, 0x7F800000), torch.float64: (torch.int64, 0x7FF0000000000000)}


def finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in t: no value with every exponent bit set, judged on the bits by numpy (torch.isfinite
    on float16 takes seconds a gigabyte on a CPU), a few million at a time."""
    ints, mask = _EXPONENT[t.dtype]
    bits = t.detach().cpu().reshape(-1).view(ints).numpy()
    return all(
        int(np.bitwise_and(bits[i : i + (1 << 22)], mask).max(initial=0)) != mask for i in range(0, bits.size, 1 << 22)
    )


class WeightsError(CheckpointError):
    """A weights file that does not hold what its header says, or holds NaN or infinity: one line."""


@dataclass(frozen=True)
class Stored:
    """One tensor in a file: `nbytes` at `offset`, of `kind` (a float type of FLOATS or a quantized type of
    `quant.KINDS`), shape [out, in] as smallem orders it; `heads` > 0: its rows are in llama.cpp's rope pair order
    (`permute_rope`), read in the order asked for."""

    path: Path
    offset: int
    nbytes: int
    kind: str
    shape: tuple[int, ...]
    heads: int = 0
    name: str = ""  # the file's name for it, for messages
    shift: float = 0.0  # added to the values read (Gemma's norm weights, stored as w where it multiplies by 1 + w)

    def read(self, pairs: int = 0) -> torch.Tensor | Blocked:
        """The tensor in its own type (a float tensor, or `Blocked`), checked finite: WeightsError names it. With
        `pairs` heads, its rows in rope pair order (`permute_rope`): a llama GGUF file's order, kept as it is."""
        raw = np.empty(self.nbytes, dtype=np.uint8)
        with open(self.path, "rb", buffering=0) as f:
            got = f.readinto(memoryview(raw)) if f.seek(self.offset) == self.offset else 0
        if got != self.nbytes:
            raise WeightsError(f"{self.path}: tensor {self.name} runs past the end of the file (truncated?)")
        if self.kind in FLOATS:
            t = torch.from_numpy(raw).view(FLOATS[self.kind]).reshape(self.shape)
            if not finite(t):
                raise WeightsError(f"{self.path}: weights contain NaN or infinity ({self.name})")
            return self._order(t if not self.shift else t.float() + self.shift, pairs)
        b = quant.from_gguf(raw, self.kind, (self.shape[0], self.shape[1]))
        if not all(finite(x) for x in (b.d, b.m) if x is not None):
            raise WeightsError(f"{self.path}: weights contain NaN or infinity ({self.name})")
        return b if self.heads == pairs else b.rows(lambda r: self._order(r, pairs))

    def _order(self, t: torch.Tensor, pairs: int) -> torch.Tensor:
        """Rows stored in `self.heads`' pair order (0: none) -> in `pairs`' (0: Hugging Face's)."""
        if self.heads == pairs:
            return t
        t = permute_rope(t, self.heads, inverse=True) if self.heads else t
        return permute_rope(t, pairs) if pairs else t


class Weights(Mapping[str, Stored]):
    """smallem parameter name -> where it is stored; `device`: where the eager path puts them."""

    def __init__(self, stored: dict[str, Stored], device: torch.device | str = "cpu") -> None:
        self._stored = stored
        self.device = torch.device(device)

    def __getitem__(self, name: str) -> Stored:
        return self._stored[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._stored)

    def __len__(self) -> int:
        return len(self._stored)

    def floats(self, name: str) -> torch.Tensor:
        """The tensor's values in float32 (a quantized one's, as `gguf` dequantizes them)."""
        t = self[name].read()
        return t.values() if isinstance(t, Blocked) else t.float()

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(sorted({s.kind for s in self._stored.values()}))


def safetensors_header(path: Path) -> tuple[dict[str, tuple[str, tuple[int, ...], int, int]], dict[str, str]]:
    """A safetensors file's header: name -> (dtype, shape, offset, nbytes), and its metadata; every tensor checked to
    lie inside the file with as many bytes as its shape needs (WeightsError where one does not)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= min(_MAX_HEADER, size - 8):
            raise WeightsError(f"{path}: not a safetensors file (its header length does not fit)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as e:
            raise WeightsError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: unreadable safetensors header")
    meta = header.pop("__metadata__", None) or {}
    out = {}
    for name, h in header.items():
        try:
            dtype, shape, (begin, end) = h["dtype"], tuple(int(x) for x in h["shape"]), h["data_offsets"]
            width = FLOATS[dtype].itemsize if dtype in FLOATS else _WIDTHS[dtype]
        except (KeyError, TypeError, ValueError):
            raise WeightsError(f"{path}: tensor {name}: unreadable header entry") from None
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= size - 8 - n):
            raise WeightsError(f"{path}: tensor {name} lies outside the file")
        if end - begin != width * int(np.prod(shape, dtype=np.int64)) or min(shape, default=1) < 0:
            raise WeightsError(f"{path}: tensor {name} holds {end - begin} bytes, its shape {shape} needs others")
        out[name] = (dtype, shape, 8 + n + begin, end - begin)
    return out, meta if isinstance(meta, dict) else {}
