"""A GGUF file's header walked before `gguf`'s reader trusts it, its metadata checked where read; `gguf` (the
`gguf` extra) imported only when it is used."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

from ..model.checkpoint import CheckpointError

MAGIC = b"GGUF"
READ_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError, MemoryError, OSError)
_FLOAT32, _STRING, _ARRAY = 6, 8, 9  # GGUFValueType
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes


class GGUFReadError(CheckpointError):
    """A GGUF file smallem cannot run as it is meant to run: the message is one line."""


def gguf_package(error: type[Exception] = ImportError, what: str = "GGUF export") -> Any:
    try:
        import gguf
    except ImportError:
        raise error(f"{what} needs the gguf package: pip install 'smallem[gguf]'") from None
    return gguf


def open_gguf(path: Path) -> Any:
    """gguf's GGUFReader on `path`, memory-mapped: the header is parsed, no tensor is copied."""
    gguf = gguf_package(GGUFReadError, "reading a GGUF file")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise GGUFReadError(f"cannot read {path}: {e.strerror or e}") from None
    if magic != MAGIC:
        raise GGUFReadError(f"{path} is not a GGUF file: it starts with {magic!r}, not {MAGIC!r}")
    try:
        _walk_header(path)  # every count fits the file: gguf's reader trusts them (a huge one never ends)
        return gguf.GGUFReader(path)
    except READ_ERRORS as e:
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise GGUFReadError(f"{path}: truncated or corrupt GGUF file ({why})") from None


def _walk_header(path: Path) -> None:
    """Every length and count of the header checked against the bytes left; ValueError where one does not fit."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        size, pos = len(m), 0

        def skip(n: int) -> int:  # where the n bytes skipped start
            nonlocal pos
            if n < 0 or pos + n > size:
                raise ValueError(f"{n} bytes at {pos} run past the end of the file ({size} bytes)")
            pos += n
            return pos - n

        def take(fmt: str) -> int:
            return struct.unpack_from("<" + fmt, m, skip(struct.calcsize(fmt)))[0]

        def value(kind: int, depth: int = 0) -> None:
            if kind in _SCALAR:
                skip(_SCALAR[kind])
            elif kind == _STRING:
                skip(take("Q"))
            elif kind == _ARRAY and depth < 2:
                item, count = take("I"), take("Q")
                if item in _SCALAR:
                    skip(count * _SCALAR[item])
                elif count * 8 > size - pos:  # a string or an array is 8 bytes at least
                    raise ValueError(f"an array of {count} items cannot fit the {size - pos} bytes left")
                else:
                    for _ in range(count):
                        value(item, depth + 1)
            else:
                raise ValueError(f"unknown metadata type {kind}")

        skip(8)  # magic, version (gguf's reader checks both)
        n_tensors, n_kv = take("Q"), take("Q")
        if (n_tensors + n_kv) * 12 > size:
            raise ValueError(f"{n_tensors} tensors and {n_kv} metadata entries cannot fit {size} bytes")
        for _ in range(n_kv):
            skip(take("Q"))
            value(take("I"))
        for _ in range(n_tensors):
            skip(take("Q"))
            if (dims := take("I")) > 4:
                raise ValueError(f"a tensor of {dims} dimensions")
            skip(8 * dims + 12)  # its dims, type and offset


class Meta(dict):
    """A GGUF file's metadata, checked where read; a float32 as the shortest decimal that is it (1e-05)."""

    def __init__(self, reader: Any, path: Path) -> None:
        super().__init__()
        self.path = path
        for key, f in reader.fields.items():
            try:
                v = f.contents()
            except READ_ERRORS as e:
                raise GGUFReadError(f"{path}: unreadable metadata {key} ({type(e).__name__})") from None
            self[key] = float(np.format_float_scientific(np.float32(v), unique=True)) if f.types == [_FLOAT32] else v

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
