"""An EAGLE-3 draft head (Li et al., arXiv 2503.01840) for any target of the Llama family.

The target's states after a low, a middle and a high layer (`taps`) are fused by one projection (`fc`); the MTP
module's one block then reads that state with the next token's embedding (the target's), and an output head scores
the N tokens the target writes most (`ids`, FR-Spec): its own norm over the target's rows for those tokens (read
from the target when the head loads, never stored in its file), mapped to the target's ids. A chained draft token
reads the head's own last state in place of the fused one, as it was trained to (training-time test). The file names
its target by a fingerprint of the target's weights (`weights_fingerprint`): the model's GGUF file or HF folder finds
it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from .. import atomic
from ..config import ModelConfig
from .checkpoint import CheckpointError, check_finite, config_of, read_meta, write_safetensors
from .llama import MTPModule, RMSNorm, Transformer

KIND = "eagle"  # a checkpoint's "kind"
ROWS = "lm_head.weight"  # the target's rows for the head's tokens: never in the file


def default_taps(n_layers: int) -> tuple[int, int, int]:
    """A low, a middle and a high layer (EAGLE-3's choice for Llama: the 3rd, the middle, the 3rd from the top)."""
    return min(2, n_layers - 1), n_layers // 2, max(n_layers - 3, 0)


class EagleHead(MTPModule):
    def __init__(self, cfg: ModelConfig, taps: tuple[int, ...], ids: torch.Tensor) -> None:
        super().__init__(cfg)
        d = cfg.dim
        self.taps = taps
        self.fc = nn.Linear(len(taps) * d, d, bias=False)
        self.norm = RMSNorm(d, cfg.norm_eps)
        self.lm_head = nn.Linear(d, ids.numel(), bias=False)
        self.register_buffer("ids", ids.long(), persistent=False)  # row i of the head scores token ids[i]
        self.head_t: torch.Tensor | None = None  # [d, N], its norm folded in (`spec.head.Head` reads it)

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def pack(self) -> EagleHead:
        super().pack()
        with torch.no_grad():
            self.head_t = (self.lm_head.weight.t() * self.norm.weight[:, None]).contiguous()
        return self

    def take_rows(self, target: Transformer) -> None:
        """Its output rows: the target's own for its tokens (frozen: the file holds none)."""
        with torch.no_grad():
            self.lm_head.weight.copy_(target.floats(target.head_name)[self.ids])
        self.lm_head.weight.requires_grad_(False)

    def eager(self) -> EagleHead:
        return self if self.head_t is not None else self.pack()

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """The target's tapped states [..., len(taps) * d] -> the state the block reads [..., d]: each tap normed
        first (a target's states differ in scale by layer, and some positions' by 1000x: attention sinks)."""
        d = self.cfg.dim
        each = F.rms_norm(taps.unflatten(-1, (len(self.taps), d)), (d,), eps=self.cfg.norm_eps)
        return F.linear(each.flatten(-2), self.fc.weight)


def weights_fingerprint(model: Transformer) -> str:
    """A short hash of the target's shape and norm weights (rounded to bfloat16): the same for its GGUF file, whatever
    its quantization (norms stay float32 there), and its HF folder; a trained model's norms are its own (an untrained
    one's, all ones, are not)."""
    c = model.cfg
    names = ["norm.weight"] + [
        f"layers.{i}.{n}_layernorm.weight" for i in range(c.n_layers) for n in ("input", "post_attention")
    ]
    h = hashlib.sha256(json.dumps([c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size]).encode())
    for name in names:
        h.update(model.floats(name).cpu().to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


def save(path: Path, head: EagleHead, *, tokenizer: str, target: str, facts: dict[str, Any]) -> None:
    """Write atomically, float16 (the ids and taps in the header; the output rows, the target's, left out)."""
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in head.state_dict().items() if k != ROWS}
    meta = {
        "format": "smallem", "kind": KIND, "config": head.cfg.to_json(), "tokenizer": tokenizer, "target": target,
        "taps": json.dumps(list(head.taps)), "ids": json.dumps(head.ids.tolist()),
        "facts": json.dumps(facts, sort_keys=True),
    }  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.replace_with(path, lambda tmp: write_safetensors(tensors, tmp, meta))


def acceptance(facts: dict[str, Any]) -> tuple[float, ...]:
    """The head's held-out agreement with its target at depth 1, 2, ... (its training's `val_top1@j`), as far as the
    facts give it."""
    got: list[float] = []
    while isinstance(a := facts.get(f"val_top1@{len(got) + 1}"), float):
        got.append(a)
    return tuple(got)


def load(path: Path, target: Transformer, device: torch.device | str = "cpu") -> tuple[EagleHead, dict[str, str]]:
    """The head in `path`, checked against `target` (its shape, its layers) -> (the head in float32, its header)."""
    meta = read_meta(path)
    if meta.get("kind") != KIND:
        raise CheckpointError(f"{path} holds a {meta.get('kind')}, not an EAGLE head")
    cfg, tgt = config_of(meta, path), target.cfg
    try:
        taps, ids = tuple(int(i) for i in json.loads(meta["taps"])), json.loads(meta["ids"])
    except (KeyError, ValueError, TypeError):
        raise CheckpointError(f"{path}: its taps or ids are missing or not lists of integers") from None
    if (cfg.dim, cfg.vocab_size, cfg.n_heads, cfg.n_kv_heads) != (tgt.dim, tgt.vocab_size, tgt.n_heads, tgt.n_kv_heads):
        raise CheckpointError(f"{path}: the EAGLE head does not fit the target (its width, heads or vocabulary)")
    if not taps or not all(0 <= i < tgt.n_layers for i in taps):
        raise CheckpointError(f"{path}: taps {list(taps)} are not layers of the target's {tgt.n_layers}")
    if not ids or not all(isinstance(i, int) and 0 <= i < tgt.vocab_size for i in ids) or len(set(ids)) < len(ids):
        raise CheckpointError(f"{path}: its ids are not distinct token ids of the target")
    head = EagleHead(cfg, taps, torch.tensor(ids))
    tensors = load_file(str(path))
    want = {k: tuple(v.shape) for k, v in head.state_dict().items() if k != ROWS}
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if got != want:
        wrong = sorted(set(got) ^ set(want)) or [k for k in want if got[k] != want[k]]
        raise CheckpointError(f"{path}: tensors do not fit an EAGLE head ({', '.join(wrong[:3])})")
    check_finite(tensors, str(path))
    head.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    head.take_rows(target)
    return head.to(device).eval(), meta
