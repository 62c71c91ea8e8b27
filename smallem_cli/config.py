"""Model configuration: one dataclass, a few named presets.

The config is saved beside the weights (as safetensors metadata), so a checkpoint
always knows its own shape. Field names follow Llama's where one exists.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 8192
    dim: int = 256  # width of the residual stream
    n_layers: int = 6
    n_heads: int = 4
    n_kv_heads: int = 4  # < n_heads means grouped-query attention
    hidden_dim: int = 768  # SwiGLU inner width
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    # A multi-token-prediction module (DeepSeek-V3 style) is trained with this model.
    mtp: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary positions")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        raw = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown config fields: {', '.join(unknown)}")
        return cls(**raw)


# The shipped family. The drafts share a width (the seed: same config, 2 or 4 layers)
# and are narrow, so that one of their tokens costs a fraction of a target pass.
PRESETS: dict[str, ModelConfig] = {
    "target": ModelConfig(dim=256, n_layers=8, n_heads=4, n_kv_heads=4, hidden_dim=768, mtp=True),
    "draft-2l": ModelConfig(dim=192, n_layers=2, n_heads=3, n_kv_heads=3, hidden_dim=512),
    "draft-4l": ModelConfig(dim=192, n_layers=4, n_heads=3, n_kv_heads=3, hidden_dim=512),
    # Tiny random models for tests.
    "tiny": ModelConfig(
        vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=256, mtp=True
    ),
}
