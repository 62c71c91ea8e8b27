"""GGUF import, the reverse of `interop.gguf`: a llama.cpp file (architecture `llama`) as a smallem Transformer,
tokenizer and chat format. Weights of the TYPES load to their exact values, copied out of gguf's memory map;
anything smallem would compute differently is refused with one line naming it."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from ..config import ModelConfig
from ..model import checkpoint
from ..model.chat import ChatFormat
from ..model.checkpoint import CheckpointError
from ..model.llama import Transformer, unpermute_rope
from .gguf import gguf_name, gguf_package

MAGIC = b"GGUF"
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")  # read to their exact values
PRE = {"gpt2": "gpt2", "gpt-2": "gpt2", "smollm": "smollm"}  # tokenizer.ggml.pre -> how text is split
_CONTROL, _USER, _UNUSED = 3, 4, 5  # llama.cpp's token types (1 normal, 2 unknown, 6 byte)
_FLOAT32 = 6  # GGUFValueType.FLOAT32
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
_STRING, _ARRAY = 8, 9
_READ_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError, MemoryError, OSError)


class GGUFReadError(CheckpointError):
    """A GGUF file smallem cannot run as it is meant to run: the message is one line."""


@dataclass
class GGUFModel:
    model: Transformer  # float32, eval, not packed
    tokenizer: Tokenizer
    fingerprint: str  # checkpoint.vocab_fingerprint: equal to its tokenizer.json's when exported by smallem
    chat: ChatFormat
    types: tuple[str, ...]  # the tensor types the file holds


def is_gguf(path: str | Path) -> bool:
    """A file named *.gguf, or any file that starts with GGUF's magic."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    try:
        with open(p, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def _reader(path: Path) -> Any:
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
        return gguf.GGUFReader(path)  # memory-mapped: the header is parsed, no tensor is copied
    except _READ_ERRORS as e:
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise GGUFReadError(f"{path}: truncated or corrupt GGUF file ({why})") from None


def _walk_header(path: Path) -> None:
    """Every length and count of the header checked against the bytes left; ValueError where one does not fit."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        size, pos = len(m), 0

        def take(fmt: str) -> int:
            nonlocal pos
            if pos + struct.calcsize(fmt) > size:
                raise ValueError(f"the header ends past the end of the file ({size} bytes)")
            (v,) = struct.unpack_from("<" + fmt, m, pos)
            pos += struct.calcsize(fmt)
            return v

        def skip(n: int) -> None:
            nonlocal pos
            if n < 0 or pos + n > size:
                raise ValueError(f"a length of {n} runs past the end of the file ({size} bytes)")
            pos += n

        def value(kind: int, depth: int = 0) -> None:
            if kind in _SCALAR:
                skip(_SCALAR[kind])
            elif kind == _STRING:
                skip(take("Q"))
            elif kind == _ARRAY and depth < 2:
                item, count = take("I"), take("Q")
                if item in _SCALAR:
                    skip(count * _SCALAR[item])
                    return
                if count * 8 > size - pos:  # a string or an array is 8 bytes at least
                    raise ValueError(f"an array of {count} items cannot fit the {size - pos} bytes left")
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
            dims = take("I")
            if dims > 4:
                raise ValueError(f"a tensor of {dims} dimensions")
            skip(8 * dims + 12)  # its dims, type and offset


class _Meta(dict):
    """The file's metadata, checked where read; a float32 as the shortest decimal that is it (1e-05)."""

    def __init__(self, reader: Any, path: Path) -> None:
        super().__init__()
        self.path = path
        for key, f in reader.fields.items():
            try:
                v = f.contents()
            except _READ_ERRORS as e:
                raise GGUFReadError(f"{path}: unreadable metadata {key} ({type(e).__name__})") from None
            self[key] = float(np.format_float_scientific(np.float32(v), unique=True)) if f.types == [_FLOAT32] else v

    def num(self, key: str, kind: type = int, default: Any = None) -> Any:
        v = self.get(key, default)
        if v is None:
            raise GGUFReadError(f"{self.path}: metadata {key} is missing")
        if isinstance(v, bool) or not isinstance(v, (int, kind)) or not np.isfinite(v) or v <= 0:
            raise GGUFReadError(f"{self.path}: metadata {key}={v!r} is not a positive {kind.__name__}")
        return kind(v)

    def text(self, key: str) -> str | None:
        v = self.get(key)
        if v is not None and not isinstance(v, str):
            raise GGUFReadError(f"{self.path}: metadata {key} is not a string")
        return v

    def strings(self, key: str) -> list[str]:
        v = self.get(key, [])
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise GGUFReadError(f"{self.path}: metadata {key} is not a list of strings")
        return v


def _config(meta: _Meta, n_vocab: int, tied: bool) -> ModelConfig:
    path = meta.path
    arch = meta.text("general.architecture")
    if arch != "llama":
        raise GGUFReadError(f"{path}: architecture {arch!r}: only llama is supported")
    for key in meta:
        if key.startswith("llama.rope.scaling.") and not (key.endswith(".type") and meta.get(key) == "none"):
            raise GGUFReadError(f"{path}: unsupported metadata {key}={meta.get(key)!r}: plain rotary positions only")
    if meta.get("llama.expert_count", 0):
        raise GGUFReadError(f"{path}: llama.expert_count={meta.get('llama.expert_count')!r}: mixture of experts")
    dim, heads = meta.num("llama.embedding_length"), meta.num("llama.attention.head_count")
    kv = meta.num("llama.attention.head_count_kv", default=heads)
    head_dim = dim // heads if dim % heads == 0 else 0
    for key in ("llama.rope.dimension_count", "llama.attention.key_length", "llama.attention.value_length"):
        if key in meta and meta.get(key) != head_dim:
            raise GGUFReadError(f"{path}: metadata {key}={meta.get(key)!r}: smallem needs {head_dim or '?'}")
    if "llama.vocab_size" in meta and meta.get("llama.vocab_size") != n_vocab:
        raise GGUFReadError(f"{path}: llama.vocab_size={meta.get('llama.vocab_size')!r}, the token list has {n_vocab}")
    try:
        return ModelConfig(
            vocab_size=n_vocab, dim=dim, n_layers=meta.num("llama.block_count"), n_heads=heads, n_kv_heads=kv,
            hidden_dim=meta.num("llama.feed_forward_length"), max_seq_len=meta.num("llama.context_length"),
            norm_eps=meta.num("llama.attention.layer_norm_rms_epsilon", float),
            rope_theta=meta.num("llama.rope.freq_base", float, 10000.0), tie_embeddings=tied, mtp=False,
        )  # fmt: skip
    except ValueError as e:  # ModelConfig's own checks
        raise GGUFReadError(f"{path}: its hyperparameters do not fit smallem: {e}") from None


def _weights(reader: Any, cfg: ModelConfig, path: Path) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
    """smallem name -> float32 tensor, names, shapes and types all checked before a weight is copied."""
    from gguf.quants import dequantize

    expected = checkpoint.expected_shapes(cfg)  # a tied model's has no lm_head
    ours = {gguf_name(k): k for k in expected}
    found = {t.name: t for t in reader.tensors}
    missing, extra = sorted(set(ours) - set(found)), sorted(set(found) - set(ours))
    if "rope_freqs.weight" in extra:
        raise GGUFReadError(f"{path}: tensor rope_freqs.weight scales rotary positions: plain rotary positions only")
    if missing or extra:
        raise GGUFReadError(f"{path}: tensors do not fit its metadata: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, t in found.items():
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists ggml's dims, innermost first
        if shape != expected[ours[name]]:
            raise GGUFReadError(f"{path}: tensor {name} has shape {shape}, its metadata says {expected[ours[name]]}")
        if t.tensor_type.name not in TYPES:
            raise GGUFReadError(f"{path}: tensor {name} has type {t.tensor_type.name}: only {', '.join(TYPES)}")
    out = {}
    for name, t in found.items():
        key = ours[name]
        try:  # a copy out of the memory map; F16 and F32 as they are, exactly
            w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)).reshape(expected[key])
        except _READ_ERRORS as e:
            raise GGUFReadError(f"{path}: tensor {name} is unreadable ({type(e).__name__}: {e})"[:300]) from None
        if key.endswith("q_proj.weight"):
            w = unpermute_rope(w, cfg.n_heads)
        elif key.endswith("k_proj.weight"):
            w = unpermute_rope(w, cfg.n_kv_heads)
        out[key] = w.contiguous()
    checkpoint.check_finite(out, str(path))
    return out, tuple(sorted({t.tensor_type.name for t in found.values()}))


def _special_ids(meta: _Meta, n_tokens: int) -> dict[str, int]:
    """The bos, eos, eot and eom ids the file names, each checked to be a token's."""
    ids = {name: meta.get(f"tokenizer.ggml.{name}_token_id") for name in ("bos", "eos", "eot", "eom")}
    for name, v in ids.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n_tokens):
            raise GGUFReadError(f"{meta.path}: tokenizer.ggml.{name}_token_id={v!r} is not a token id")
    return {name: v for name, v in ids.items() if v is not None}


def _tokenizer(meta: _Meta, tokens: list[str], ids: dict[str, int]) -> Tokenizer:
    """tokenizer.ggml.* -> a byte-level BPE `tokenizers` object: control tokens special (decoded as nothing),
    user-defined ones plain, unused ones left out; BOS / EOS added where the file says llama.cpp adds them."""
    path = meta.path
    kind = meta.text("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFReadError(f"{path}: tokenizer.ggml.model {kind!r}: only gpt2 (byte-level BPE) is read")
    pre = meta.text("tokenizer.ggml.pre") or "default"
    if pre not in PRE:
        raise GGUFReadError(f"{path}: tokenizer.ggml.pre {pre!r}: only {', '.join(PRE)} are read")
    merges = meta.strings("tokenizer.ggml.merges")
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    if not isinstance(types, list) or len(types) != len(tokens) or not all(isinstance(t, int) for t in types):
        raise GGUFReadError(f"{path}: tokenizer.ggml.token_type does not list one type per token")
    vocab: dict[str, int] = {}
    added: list[tuple[int, str, bool]] = []
    for i, (text, t) in enumerate(zip(tokens, types, strict=True)):
        if t != _UNUSED:
            vocab.setdefault(text, i)  # added tokens too: `add_tokens` then keeps their ids
        if t in (_CONTROL, _USER):
            added.append((i, text, t == _CONTROL))
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges]))  # type: ignore[arg-type]
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.pre_tokenizer = (
            byte_level
            if PRE[pre] == "gpt2"
            else pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        )
        tok.decoder = decoders.ByteLevel()
        for i, text, special in sorted(added):  # in id order: each gets its own id, as the file says
            tok.add_tokens([AddedToken(text, special=special, normalized=False)])
            if tok.token_to_id(text) != i:
                raise GGUFReadError(f"{path}: token {text!r} is listed twice (ids {tok.token_to_id(text)} and {i})")
        ends = {w: ids[w] for w in ("bos", "eos") if w in ids and meta.get(f"tokenizer.ggml.add_{w}_token") is True}
        texts = {w: tok.id_to_token(i) for w, i in ends.items()}
        if None in texts.values():
            raise GGUFReadError(f"{path}: tokenizer.ggml.add_*_token names a token that is not in its list")
        if ends:
            single = [texts[w] for w in ("bos",) if w in ends] + ["$A"] + [texts[w] for w in ("eos",) if w in ends]
            specials = [(texts[w], i) for w, i in ends.items()]
            tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    except GGUFReadError:
        raise
    except Exception as e:  # tokenizers raises bare Exceptions on a bad vocabulary or merge
        raise GGUFReadError(f"{path}: its tokenizer cannot be built: {str(e).splitlines()[0][:200]}") from None
    return tok


def load_gguf(path: str | Path, device: torch.device | str = "cpu") -> GGUFModel:
    """A llama GGUF file -> its model (float32, eval), tokenizer, fingerprint and chat format, or GGUFReadError."""
    path = Path(path)
    reader = _reader(path)
    meta = _Meta(reader, path)
    tokens = meta.strings("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFReadError(f"{path}: metadata tokenizer.ggml.tokens is missing or empty")
    cfg = _config(meta, len(tokens), tied=not any(t.name == "output.weight" for t in reader.tensors))
    ids = _special_ids(meta, len(tokens))
    tok = _tokenizer(meta, tokens, ids)  # before the weights: a refusal costs no memory
    ends = tuple(dict.fromkeys(ids[n] for n in ("eos", "eot", "eom") if n in ids))  # any of them ends a generation
    bos, eos = (tokens[ids[n]] if n in ids else "" for n in ("bos", "eos"))
    chat = ChatFormat(ends, meta.text("tokenizer.chat_template"), bos, eos)
    weights, types = _weights(reader, cfg, path)
    model = Transformer(cfg)
    model.load_state_dict(weights)  # names and shapes checked above: strict, and it fits
    return GGUFModel(model.to(device).eval(), tok, checkpoint.vocab_fingerprint(tok), chat, types)
