"""A GGUF file's header read by us, every length and count checked against the bytes left as it is read, its metadata
checked where used; `gguf` (the `gguf` extra) imported only for its tables of types, and to write files."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..model.checkpoint import CheckpointError

MAGIC = b"GGUF"
READ_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError, MemoryError, OSError)
_FLOAT32, _BOOL, _STRING, _ARRAY = 6, 7, 8, 9  # GGUFValueType
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}  # -> struct


class GGUFReadError(CheckpointError):
    """A GGUF file smallem cannot run as it is meant to run: the message is one line."""


def gguf_package(error: type[Exception] = ImportError, what: str = "GGUF export") -> Any:
    try:
        import gguf
    except ImportError:
        raise error(f"{what} needs the gguf package: pip install 'smallem[gguf]'") from None
    return gguf


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: its dims in ggml's order (innermost first), its type's name (`F16`, `Q4_K`, ...),
    and where its bytes lie in the file (`offset`, absolute, and `nbytes`, both checked to fit the file)."""

    name: str
    dims: tuple[int, ...]
    kind: str
    offset: int
    nbytes: int


class GGUFFile:
    """A GGUF file's header, read once and checked as read: its metadata (`fields`, arrays as lists, float32 values
    as the shortest decimal that is them: 1e-05) and its tensors; no tensor's data is read."""

    def __init__(self, path: Path) -> None:
        gguf = gguf_package(GGUFReadError, "reading a GGUF file")  # its tables of types and block sizes
        self.path = path
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            self._m, self._pos, self._size = m, 0, len(m)
            if self._take("I") != int.from_bytes(MAGIC, "little") or self._take("I") not in (2, 3):
                raise ValueError("not a GGUF file of version 2 or 3")
            n_tensors, n_kv = self._take("Q"), self._take("Q")
            if (n_tensors + n_kv) * 12 > self._size:
                raise ValueError(f"{n_tensors} tensors and {n_kv} metadata entries cannot fit {self._size} bytes")
            self.fields: dict[str, Any] = {}
            for _ in range(n_kv):
                key = self._string()
                self.fields[key] = self._value(self._take("I"))
            infos = []
            for _ in range(n_tensors):
                name, n_dims = self._string(), self._take("I")
                if n_dims > 4:
                    raise ValueError(f"tensor {name} has {n_dims} dimensions")
                dims = tuple(self._take("Q") for _ in range(n_dims))
                infos.append((name, dims, self._take("I"), self._take("Q")))
            align = self.fields.get("general.alignment", 32)
            if not isinstance(align, int) or isinstance(align, bool) or not 0 < align <= 1 << 16:
                raise ValueError(f"general.alignment={align!r}")
            start = -(-self._pos // align) * align
        self.tensors: list[TensorInfo] = []
        for name, dims, kind, offset in infos:
            try:
                qtype = gguf.GGMLQuantizationType(kind)
                block, size = gguf.GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise ValueError(f"tensor {name} has an unknown type {kind}") from None
            n = int(np.prod(dims, dtype=np.int64)) if dims else 1
            if n % block or not 0 <= start + offset <= start + offset + n // block * size <= self._size:
                raise ValueError(f"tensor {name} lies past the end of the file")
            self.tensors.append(TensorInfo(name, dims, qtype.name, start + offset, n // block * size))

    def _skip(self, n: int) -> int:
        if n < 0 or self._pos + n > self._size:
            raise ValueError(f"{n} bytes at {self._pos} run past the end of the file ({self._size} bytes)")
        self._pos += n
        return self._pos - n

    def _take(self, fmt: str) -> Any:
        return struct.unpack_from("<" + fmt, self._m, self._skip(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        n = self._take("Q")
        at = self._skip(n)
        return bytes(self._m[at : at + n]).decode("utf-8")

    def _value(self, kind: int, depth: int = 0) -> Any:
        if kind in _SCALARS:
            v = self._take(_SCALARS[kind])
            return (
                bool(v)
                if kind == _BOOL
                else float(np.format_float_scientific(np.float32(v), unique=True))
                if kind == _FLOAT32
                else v
            )
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY or depth:
            raise ValueError(f"unknown metadata type {kind}")
        item, count = self._take("I"), self._take("Q")
        if item in _SCALARS and item != _BOOL:  # numbers at once (a vocabulary's types and scores)
            width = struct.calcsize(_SCALARS[item])
            at = self._skip(count * width)
            return np.frombuffer(self._m, dtype="<" + _SCALARS[item], count=count, offset=at).tolist()
        if count * (8 if item in (_STRING, _ARRAY) else 1) > self._size - self._pos:
            raise ValueError(f"an array of {count} items cannot fit the {self._size - self._pos} bytes left")
        return [self._value(item, depth + 1) for _ in range(count)]


def open_gguf(path: Path) -> GGUFFile:
    """`path`'s header, parsed and checked (`GGUFFile`), or one GGUFReadError line."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise GGUFReadError(f"cannot read {path}: {e.strerror or e}") from None
    if magic != MAGIC:
        raise GGUFReadError(f"{path} is not a GGUF file: it starts with {magic!r}, not {MAGIC!r}")
    try:
        return GGUFFile(path)
    except READ_ERRORS as e:
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise GGUFReadError(f"{path}: truncated or corrupt GGUF file ({why})") from None


class Meta(dict):
    """A GGUF file's metadata, checked where read."""

    def __init__(self, file: GGUFFile) -> None:
        super().__init__(file.fields)
        self.path = file.path

    def num(self, key: str, kind: type = int, default: Any = None) -> Any:
        if (v := self.get(key, default)) is None:
            raise GGUFReadError(f"{self.path}: metadata {key} is missing")
        if isinstance(v, bool) or not isinstance(v, (int, kind)) or not np.isfinite(v) or v <= 0:
            raise GGUFReadError(f"{self.path}: metadata {key}={v!r} is not a positive {kind.__name__}")
        return kind(v)

    def text(self, key: str) -> str | None:
        if (v := self.get(key)) is not None and not isinstance(v, str):
            raise GGUFReadError(f"{self.path}: metadata {key} is not a string")
        return v

    def strings(self, key: str) -> list[str]:
        v = self.get(key, [])
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise GGUFReadError(f"{self.path}: metadata {key} is not a list of strings")
        return v
