"""Checkpoints: safetensors files, 16-bit on disk, one model of `kind` "model" or "mtp", with its
config, training facts and tokenizer fingerprint in the metadata."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from .. import atomic
from ..config import ConfigError, ModelConfig
from ..errors import CheckpointError
from .llama import MTPModule, Transformer
from .tokenizer import load_tokenizer
from .weights import finite, safetensors_header

M = TypeVar("M", Transformer, MTPModule)
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of the dtypes weights may have (float32 on load)


def tokenizer_fingerprint(tokenizer_json: str | Path) -> str:
    """A short hash of the tokenizer's vocabulary: equal fingerprints, same token ids."""
    return vocab_fingerprint(load_tokenizer(tokenizer_json))


def vocab_fingerprint(tok: Tokenizer) -> str:
    """`tokenizer_fingerprint` of a loaded tokenizer (one read from a GGUF file has no tokenizer.json)."""
    vocab = tok.get_vocab(with_added_tokens=True)
    return hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]


def save(
    path: str | Path,
    model: Transformer | MTPModule,
    *,
    tokenizer: str = "",
    facts: dict[str, Any] | None = None,
    vocab_rank: list[int] | None = None,
    dtype: torch.dtype = torch.float16,
) -> None:
    """Write atomically (temp file, then rename), so an interrupted save leaves the old file whole."""
    path = Path(path)
    if not path.name or path.name in (".", "..") or path.is_dir():
        raise CheckpointError(f"{path} is a folder: name the checkpoint file to write (e.g. model.safetensors)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    meta = {
        "format": "smallem",
        "kind": "mtp" if isinstance(model, MTPModule) else "model",
        "config": model.cfg.to_json(),
        "tokenizer": tokenizer,
        "facts": json.dumps(facts or {}, sort_keys=True),
    }
    if vocab_rank is not None:  # token ids, most frequent in the training text first
        meta["vocab_rank"] = json.dumps(vocab_rank)
    atomic.replace_with(path, lambda tmp: write_safetensors(tensors, tmp, meta))


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path, meta: dict[str, str]) -> None:
    """safetensors' writer, with the umask's permissions (its 0600 hides a rebuilt checkpoint from a shared install)."""
    save_file(tensors, str(path), metadata=meta)
    mask = os.umask(0)
    os.umask(mask)
    path.chmod(0o666 & ~mask)


def read_meta(path: str | Path) -> dict[str, str]:
    """A smallem file's metadata alone (its header: no tensor is loaded), or a CheckpointError."""
    path = Path(path)
    try:  # what the path is not, said here: safetensors reports a file it may not open as "No such file"
        st = path.stat()
        if stat.S_ISREG(st.st_mode):
            with open(path, "rb"):
                pass
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint not found: {path}") from None
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"{path} is a folder, not a checkpoint file (an HF model folder holds a config.json)")
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path} is not a regular file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None
    if meta.get("format") != "smallem":
        raise CheckpointError(f"{path} is not a smallem checkpoint (no smallem metadata)")
    return meta


def header(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor, read from the header alone (nothing is allocated)."""
    return {k: (dtype, shape) for k, (dtype, shape, _, _) in safetensors_header(Path(path))[0].items()}


def check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    for name, t in tensors.items():
        if not finite(t):
            raise CheckpointError(f"{where}: weights contain NaN or infinity ({name})")


def expected_shapes(cfg: ModelConfig, mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """The parameter shapes of a model (or MTP module) from its config alone: the meta device costs seconds."""
    d, f, q, kv = cfg.dim, cfg.hidden_dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim

    def block(prefix: str) -> dict[str, tuple[int, ...]]:
        mats = {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q)}
        mats |= {"gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f)}
        out = {f"{prefix}.{n}.weight": (d,) for n in ("input_layernorm", "post_attention_layernorm")}
        if cfg.attn_bias:
            out |= {f"{prefix}.{n}.bias": (mats[n][0],) for n in ("q_proj", "k_proj", "v_proj")}
        if cfg.qk_norm:
            out |= {f"{prefix}.{n}.weight": (cfg.head_dim,) for n in ("q_norm", "k_norm")}
        if cfg.output_norms:
            out |= {f"{prefix}.{n}.weight": (d,) for n in ("attn_output_norm", "mlp_output_norm")}
        return out | {f"{prefix}.{n}.weight": shape for n, shape in mats.items()}

    if mtp:
        return {"hnorm.weight": (d,), "enorm.weight": (d,), "eh_proj.weight": (d, 2 * d), **block("block")}
    out: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, d)}
    for i in range(cfg.n_layers):
        out |= block(f"layers.{i}")
    out["norm.weight"] = (d,)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, d)
    return out


def _tensors(path: str | Path, cfg: ModelConfig, mtp: bool = False) -> dict[str, torch.Tensor]:
    """The file's tensors, names, shapes and dtypes checked first: a wrong file costs an error, not the memory."""
    expected = expected_shapes(cfg, mtp)
    try:
        declared = header(path)
        missing, extra = sorted(set(expected) - set(declared)), sorted(set(declared) - set(expected))
        if missing or extra:
            raise CheckpointError(
                f"{path}: tensors do not match its config (missing {missing[:3]}, unexpected {extra[:3]})"[:500]
            )
        for name, want in expected.items():
            dtype, shape = declared[name]
            if shape != want:
                raise CheckpointError(f"{path}: {name} has shape {shape}, config says {want}")
            if dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"{path}: {name} has dtype {dtype}, not one of {', '.join(FLOAT_DTYPES)}")
        tensors = load_file(str(path))
    except CheckpointError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None
    check_finite(tensors, str(path))
    return tensors


def facts(meta: dict[str, str]) -> dict[str, Any]:
    """The training facts a file records ({} when none, or when they are unreadable: they are only shown)."""
    try:
        out = json.loads(meta.get("facts", "{}"))
    except (ValueError, RecursionError):
        return {}
    return out if isinstance(out, dict) else {}


def vocab_rank(meta: dict[str, str], path: str | Path, vocab_size: int) -> list[int] | None:
    """Token ids by training frequency, if the file records them (proposers use the head's top rows)."""
    if (raw := meta.get("vocab_rank")) is None:
        return None
    try:
        rank = json.loads(raw)
    except (ValueError, RecursionError):
        rank = None
    if not isinstance(rank, list) or not all(type(i) is int for i in rank):
        raise CheckpointError(f"{path}: vocab_rank in its metadata is not a list of token ids")
    if not all(0 <= i < vocab_size for i in rank) or len(set(rank)) != len(rank):
        raise CheckpointError(f"{path}: vocab_rank must list distinct token ids in 0..{vocab_size - 1}")
    return rank


def config_of(meta: dict[str, str], path: str | Path) -> ModelConfig:
    if "config" not in meta:
        raise CheckpointError(f"{path}: no config in its metadata")
    try:
        return ModelConfig.from_json(meta["config"])
    except ConfigError as e:
        raise CheckpointError(f"{path}: bad config in metadata: {e}") from None


def build(model: M, tensors: dict[str, torch.Tensor], device: torch.device | str) -> M:
    """`model` (new) with `tensors` (checked: names and shapes fit it) widened to float32, on `device`, in eval."""
    model.load_state_dict({k: v.float() for k, v in tensors.items()})
    return model.to(device).eval()


def load_model(path: str | Path, device: torch.device | str = "cpu") -> tuple[Transformer, dict[str, str]]:
    meta = read_meta(path)
    if meta.get("kind") != "model":
        raise CheckpointError(f"{path} holds a {meta.get('kind')} module, not a model")
    cfg = config_of(meta, path)
    tensors = _tensors(path, cfg)  # checked before the model is built
    return build(Transformer(cfg), tensors, device), meta


def load_mtp(
    path: str | Path, target: Transformer, device: torch.device | str = "cpu"
) -> tuple[MTPModule, dict[str, str]]:
    meta = read_meta(path)
    if meta.get("kind") != "mtp":
        raise CheckpointError(f"{path} holds a {meta.get('kind')}, not an MTP module")
    cfg = config_of(meta, path)
    shared, tgt = ("dim", "vocab_size", "n_heads", "n_kv_heads", "rope_theta", "rope_freqs", "max_seq_len"), target.cfg
    differ = [f"{f} {getattr(cfg, f)} vs {getattr(tgt, f)}" for f in shared if getattr(cfg, f) != getattr(tgt, f)]
    if differ:  # the module reads the target's states, embedding, head and rotary tables
        raise CheckpointError(f"{path}: MTP module does not fit the target ({', '.join(differ)})")
    tensors = _tensors(path, cfg, mtp=True)
    return build(MTPModule(cfg), tensors, device), meta
