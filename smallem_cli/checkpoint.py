"""Checkpoints: safetensors files, 16-bit on disk, config and facts in the metadata.

A file holds one model: `kind` is "model" (a target or a draft, Llama parameter names)
or "mtp" (an MTP module, which needs its target). The metadata also records the
tokenizer's fingerprint, so a proposer trained with another tokenizer is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .config import ModelConfig
from .model import MTPModule, Transformer
from .tokenizer import load_tokenizer


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or does not fit what it is used for."""


def tokenizer_fingerprint(tokenizer_json: str | Path) -> str:
    """A short hash of the tokenizer's vocabulary: equal fingerprints, same token ids."""
    vocab = load_tokenizer(tokenizer_json).get_vocab(with_added_tokens=True)
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
    tmp = path.with_name(path.name + ".tmp")
    write_safetensors(tensors, tmp, meta)
    tmp.replace(path)


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path, meta: dict[str, str]) -> None:
    """safetensors' writer, with the permissions of any file the user writes.

    safetensors creates its files 0600 whatever the umask, so a rebuilt checkpoint would
    be unreadable to the other users of a shared install.
    """
    save_file(tensors, str(path), metadata=meta)
    mask = os.umask(0)
    os.umask(mask)
    path.chmod(0o666 & ~mask)


def read_meta(path: str | Path) -> dict[str, str]:
    """A smallem file's metadata alone (its header: no tensor is loaded), or a CheckpointError."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None
    if meta.get("format") != "smallem":
        raise CheckpointError(f"{path} is not a smallem checkpoint (no smallem metadata)")
    return meta


def read(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a smallem file, or a CheckpointError saying why not."""
    meta = read_meta(path)
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None
    return tensors, meta


def facts(meta: dict[str, str]) -> dict[str, Any]:
    return json.loads(meta.get("facts", "{}"))


def vocab_rank(meta: dict[str, str]) -> list[int] | None:
    """Token ids by training frequency, if the file records them (proposers use the head's top rows)."""
    raw = meta.get("vocab_rank")
    return None if raw is None else [int(i) for i in json.loads(raw)]


def config_of(meta: dict[str, str], path: str | Path) -> ModelConfig:
    try:
        return ModelConfig.from_json(meta["config"])
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: bad config in metadata: {e}") from None


def _build(model: Transformer | MTPModule, tensors: dict[str, torch.Tensor], path: Path) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise CheckpointError(
            f"{path}: tensors do not match its config (missing {missing[:3]}, unexpected {extra[:3]})"
        )
    for k, v in expected.items():
        if tensors[k].shape != v.shape:
            raise CheckpointError(f"{path}: {k} has shape {tuple(tensors[k].shape)}, config says {tuple(v.shape)}")
    model.load_state_dict({k: v.float() for k, v in tensors.items()})
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        raise CheckpointError(f"{path}: weights contain NaN or infinity")


def load_model(path: str | Path, device: torch.device | str = "cpu") -> tuple[Transformer, dict[str, str]]:
    tensors, meta = read(path)
    if meta.get("kind") != "model":
        raise CheckpointError(f"{path} holds a {meta.get('kind')} module, not a model")
    cfg = config_of(meta, path)
    model = Transformer(cfg)
    _build(model, tensors, Path(path))
    return model.to(device).eval(), meta


def load_mtp(
    path: str | Path, target: Transformer, device: torch.device | str = "cpu"
) -> tuple[MTPModule, dict[str, str]]:
    tensors, meta = read(path)
    if meta.get("kind") != "mtp":
        raise CheckpointError(f"{path} holds a {meta.get('kind')}, not an MTP module")
    cfg = config_of(meta, path)
    shared = ("dim", "vocab_size", "n_heads", "n_kv_heads", "rope_theta", "max_seq_len")
    differ = [
        f"{f} {getattr(cfg, f)} vs {getattr(target.cfg, f)}"
        for f in shared
        if getattr(cfg, f) != getattr(target.cfg, f)
    ]
    if differ:  # the module reads the target's states, embedding, head and rotary tables
        raise CheckpointError(f"{path}: MTP module does not fit the target ({', '.join(differ)})")
    mtp = MTPModule(cfg)
    _build(mtp, tensors, Path(path))
    return mtp.to(device).eval(), meta
