"""Model configuration: one dataclass, a few named presets. Saved in a checkpoint's metadata, so a
checkpoint knows its own shape. Field names follow Llama's where one exists."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

# Bounds on a config read from a file, checked before anything is allocated (a ~2B Llama fits).
LIMITS = {"vocab_size": 1 << 20, "dim": 1 << 14, "n_layers": 256, "n_heads": 1 << 10, "n_kv_heads": 1 << 10}
# max_seq_len: the rotary tables hold a row per position
LIMITS |= {"hidden_dim": 1 << 16, "max_seq_len": 1 << 17, "head_dim": 1 << 10, "sliding_window": 1 << 17}
MAX_PARAMS = 1 << 31  # 8 GiB of float32 weights
MAX_ROPE = 1 << 25  # entries of the rotary tables (max_seq_len x head_dim), built whatever the file holds


class ConfigError(ValueError):
    """A model configuration that is malformed or out of bounds; the message names the field."""


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
    # Per-pair divisors of the rotary frequencies (llama.cpp's rope_freqs): llama3 and linear scaling, () for none.
    rope_freqs: tuple[float, ...] = ()
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    attn_bias: bool = False  # biases on the q, k and v projections (Qwen2's; o_proj has none)
    qk_norm: bool = False  # an RMSNorm of head_dim weights on each head of q and of k, before rope (Qwen3's)
    mtp: bool = False  # a multi-token-prediction module (DeepSeek-V3 style) is trained with this model
    head_dim: int = 0  # each attention head's width; 0: dim / n_heads (Qwen3's and Gemma's are their own)
    # Gemma 3's parts (each off by default):
    embed_scale: float = 1.0  # the token embedding times this on the way in (Gemma's sqrt(dim)), not on the head
    output_norms: bool = False  # an RMSNorm on the attention's output and on the MLP's, before each residual add
    geglu: bool = False  # the MLP's gate through gelu (tanh approximation) in place of silu
    attn_scale: float = 0.0  # the scores' scale; 0: head_dim ** -0.5
    sliding_window: int = 0  # the keys a local layer sees, its own position included; 0: no local layers
    local_layers: tuple[int, ...] = ()  # the layers that attend within sliding_window, turning by rope_local_theta
    rope_local_theta: float = 10000.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not (f.name in _ZERO_IS_NONE and getattr(self, f.name) == 0):
                _check_field(f.name, f.type, getattr(self, f.name))
        object.__setattr__(self, "rope_freqs", tuple(map(float, self.rope_freqs)))  # JSON gives a list
        object.__setattr__(self, "local_layers", tuple(self.local_layers))
        if any(i >= self.n_layers for i in self.local_layers) or len(set(self.local_layers)) < len(self.local_layers):
            raise ConfigError(f"local_layers {self.local_layers} must name distinct layers below {self.n_layers}")
        if bool(self.local_layers) != bool(self.sliding_window):
            raise ConfigError("sliding_window and local_layers go together: a window, and the layers that use it")
        if self.head_dim == 0:
            if self.dim % self.n_heads:
                raise ConfigError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} must be even for rotary positions")
        if (n := len(self.rope_freqs)) and n != self.head_dim // 2:
            raise ConfigError(f"rope_freqs holds {n} factors, not {self.head_dim // 2}, one per pair")
        if self.max_seq_len * self.head_dim > MAX_ROPE:
            raise ConfigError(
                f"max_seq_len {self.max_seq_len} x head_dim {self.head_dim} exceeds smallem's limit of "
                f"{MAX_ROPE:,} rotary table entries"
            )
        if (n := self.n_params) > MAX_PARAMS:
            raise ConfigError(f"the config describes {n:,} parameters, more than smallem's limit of {MAX_PARAMS:,}")

    @property
    def n_params(self) -> int:
        """Parameters of the model (an MTP module adds about one layer), from the config alone."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        layer = self.dim * (2 * q + 2 * kv) + 3 * self.dim * self.hidden_dim + 2 * self.dim
        layer += (q + 2 * kv) * self.attn_bias + 2 * self.head_dim * self.qk_norm + 2 * self.dim * self.output_norms
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + head + (self.n_layers + 2) * layer

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        """A config from its JSON; ConfigError (naming the field) for anything malformed."""
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise ConfigError(f"config is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config is a JSON object, not {_show(raw)}")
        if unknown := sorted(set(raw) - {f.name for f in dataclasses.fields(cls)}):
            raise ConfigError(f"unknown config fields: {', '.join(map(str, unknown))}"[:300])
        return cls(**raw)


_ZERO_IS_NONE = ("head_dim", "attn_scale", "sliding_window")  # 0: the field's rule is off


def _check_field(name: str, kind: object, value: object) -> None:
    """One field's type and range (int fields positive and bounded, floats finite and positive)."""
    if kind == "tuple[int, ...]":  # layer indices, bounded by the caller
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
        ):
            raise ConfigError(f"config field {name} must be a list of layer indices, got {_show(value)}")
    elif kind in (bool, "bool"):
        if not isinstance(value, bool):
            raise ConfigError(f"config field {name} must be true or false, got {_show(value)}")
    elif kind == "tuple[float, ...]":
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config field {name} must be a list of numbers, got {_show(value)}")
        for v in value:
            _check_field(name, float, v)
    elif kind in (int, "int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config field {name} must be an integer, got {_show(value)}")
        if not 1 <= value <= LIMITS[name]:
            raise ConfigError(f"config field {name} must be between 1 and {LIMITS[name]:,}, got {value}")
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"config field {name} must be a number, got {_show(value)}")
    elif not (math.isfinite(value) and value > 0):
        raise ConfigError(f"config field {name} must be a finite number > 0, got {value}")


def _show(value: object) -> str:
    """A value and its JSON type, briefly: `'256' (a string)`."""
    kinds = {str: "a string", list: "a list", dict: "an object", float: "a number", type(None): "null"}
    return f"{value!r}"[:40] + f" ({kinds.get(type(value), type(value).__name__)})"


# The shipped family: narrow drafts, so that one of their tokens costs a fraction of a target pass.
PRESETS: dict[str, ModelConfig] = {
    "target": ModelConfig(dim=256, n_layers=8, n_heads=4, n_kv_heads=4, hidden_dim=768, mtp=True),
    "draft-2l": ModelConfig(dim=192, n_layers=2, n_heads=3, n_kv_heads=3, hidden_dim=512),
    "draft-4l": ModelConfig(dim=192, n_layers=4, n_heads=3, n_kv_heads=3, hidden_dim=512),
    "tiny": ModelConfig(  # tiny random models for tests
        vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=256, mtp=True
    ),
}
