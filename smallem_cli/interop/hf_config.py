"""An HF folder's config.json both ways: a Llama's, Qwen2's, Qwen3's or Gemma 3's read into a ModelConfig, refusing by
field what smallem would compute otherwise, and the config files an export writes."""

from __future__ import annotations

from typing import Any

import torch

from ..config import ModelConfig
from ..model.llama import llama3_freqs, llama3_params
from ..model.tokenizer import EOT


class ExportError(ValueError):
    """A model that cannot be exported faithfully, or a destination that may not be written."""


class HFFormatError(ExportError):
    """A Hugging Face folder or config that smallem cannot read or write faithfully."""


# model_type -> its architecture; Qwen2 is Llama with q/k/v biases, Qwen3 Llama with q/k norms, Gemma 3 (its text
# model) with q/k norms and the parts `_gemma3` reads
_FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
             "gemma3_text": "Gemma3ForCausalLM"}  # fmt: skip
_MISSING = {"mixtral": "mixture-of-experts layers", "qwen2_moe": "mixture-of-experts layers",
            "qwen3_moe": "mixture-of-experts layers", "mamba": "state-space (Mamba) layers",
            "gemma3": "Gemma 3's vision tower (its text model, gemma3_text, is read)",
            "gemma2": "Gemma 2's logit soft-capping"}  # fmt: skip


def _refuse(name: str, value: Any, why: str) -> HFFormatError:
    return HFFormatError(f"unsupported config field {name}={value!r}: {why}")


def _required(hf: dict[str, Any], name: str) -> Any:
    if name not in hf:
        raise HFFormatError(f"HF config lacks required field {name}")
    return hf[name]


def _num(hf: dict[str, Any], name: str, default: float | None = None, kind: type = int) -> Any:
    v = _required(hf, name) if default is None else hf.get(name, default)
    if isinstance(v, bool) or not isinstance(v, (int, kind)) or v <= 0:
        raise _refuse(name, v, f"expected a positive {kind.__name__}")
    return kind(v)


_ROPE = {"default": (), "linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
_ROPE_ALSO = {"rope_type", "type", "rope_theta", "original_max_position_embeddings"}  # the last: llama3's only


def _rope(hf: dict[str, Any], head_dim: int) -> tuple[float, tuple[float, ...]]:
    """Rotary base and `ModelConfig.rope_freqs` from either layout: v4's top-level rope_theta and rope_scaling,
    v5's rope_parameters {"rope_type", "rope_theta", ...}. Both may be present, and must agree."""
    thetas: list[float] = [_num(hf, "rope_theta", kind=float)] if "rope_theta" in hf else []
    given: dict[str, dict[str, Any]] = {}  # field -> its scaling, "rope_type" spelled one way
    for name in ("rope_scaling", "rope_parameters"):
        if (rp := hf.get(name)) is None:
            continue
        kind = rp.get("rope_type", rp.get("type", "default")) if isinstance(rp, dict) else None
        if not isinstance(kind, str) or kind not in _ROPE:
            raise _refuse(name, rp, f"rope type {kind!r}: smallem computes default, linear and llama3 rope only")
        if extra := sorted(set(rp) - _ROPE_ALSO - set(_ROPE[kind])):
            raise _refuse(name, rp, f"smallem does not compute {', '.join(extra)} for {kind} rope")
        if "rope_theta" in rp:
            thetas.append(_num(rp, "rope_theta", kind=float))
        given[name] = {k: v for k, v in rp.items() if k not in ("type", "rope_theta")} | {"rope_type": kind}
    if len(set(thetas)) > 1:
        raise _refuse("rope_parameters", hf.get("rope_parameters"), f"its rope_theta disagrees with {thetas}")
    if len(given) == 2 and given["rope_scaling"] != given["rope_parameters"]:
        raise _refuse("rope_parameters", hf["rope_parameters"], f"it disagrees with rope_scaling {hf['rope_scaling']}")
    theta, (field, rp) = thetas[0] if thetas else 10000.0, next(iter(given.items()), ("", {"rope_type": "default"}))
    nums = [_num(rp, k, kind=float) for k in _ROPE[rp["rope_type"]]]
    if rp["rope_type"] != "llama3":  # default: no factors; linear: its factor for every pair
        return theta, tuple(nums) * (head_dim // 2)
    if nums[1] >= nums[2]:
        raise _refuse(field, hf[field], "its low_freq_factor must be below its high_freq_factor")
    original = _num(rp, "original_max_position_embeddings", _num(hf, "max_position_embeddings", 2048))
    return theta, llama3_freqs(theta, head_dim, *nums, original)


def _rope_export(cfg: ModelConfig) -> dict[str, Any]:
    """`rope_parameters` of `cfg` less its rope_theta: default, linear or llama3; ExportError for factors no HF
    rope type gives."""
    f = cfg.rope_freqs
    if len(set(f)) <= 1:
        return {"rope_type": "linear", "factor": f[0]} if f else {"rope_type": "default"}
    if (found := llama3_params(cfg)) is None:
        raise ExportError("its rope_freqs follow neither linear nor llama3 scaling: no HF config holds them")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return {"rope_type": "llama3", **dict(zip(keys, found, strict=True))}


def _gemma3(hf: dict[str, Any], n_layers: int, head_dim: int) -> dict[str, Any]:
    """`ModelConfig`'s Gemma 3 fields (and its global rope) from a gemma3_text config: √d embedding scale, norms on
    both outputs, GeGLU, the query_pre_attn_scalar, local layers over a sliding window with their own rope base."""
    for name in ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"):
        if hf.get(name):
            raise _refuse(name, hf[name], "smallem computes Gemma 3's causal attention without soft-capping")
    if (act := hf.get("hidden_activation", hf.get("hidden_act", "gelu_pytorch_tanh"))) != "gelu_pytorch_tanh":
        raise _refuse("hidden_activation", act, "smallem's Gemma MLP is GeGLU with gelu (tanh approximation)")
    types = hf.get("layer_types")
    if types is None:  # transformers 4's spelling: every n-th layer global
        every = _num(hf, "sliding_window_pattern", 6)
        types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or set(types) - {"full_attention", "sliding_attention"}:
        raise _refuse("layer_types", types, f"one of full_attention or sliding_attention for each of {n_layers} layers")
    rope = dict(hf)
    local_theta = _num(hf, "rope_local_base_freq", 10000.0, float)
    if isinstance(rp := hf.get("rope_parameters"), dict) and "full_attention" in rp:  # transformers 5: one per kind
        rope["rope_parameters"], local = rp["full_attention"], rp.get("sliding_attention") or {}
        if not isinstance(local, dict) or local.get("rope_type", "default") != "default":
            raise _refuse("rope_parameters", rp, "smallem turns local layers by plain rotary positions only")
        local_theta = _num(local, "rope_theta", 10000.0, float)
    theta, freqs = _rope(rope, head_dim)
    local = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return {
        "rope_theta": theta, "rope_freqs": freqs, "embed_scale": _num(hf, "hidden_size") ** 0.5, "output_norms": True,
        "geglu": True, "attn_scale": _num(hf, "query_pre_attn_scalar", 256, float) ** -0.5, "qk_norm": True,
        "sliding_window": _num(hf, "sliding_window") if local else 0, "local_layers": local,
        "rope_local_theta": local_theta,
    }  # fmt: skip


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Translate a LlamaForCausalLM config.json dict; HFFormatError for anything smallem does not compute."""
    if not isinstance(hf, dict):
        raise HFFormatError(f"an HF config is a JSON object, not {type(hf).__name__}")
    if (kind := _required(hf, "model_type")) not in _FAMILIES:
        missing = f"smallem does not compute {_MISSING[kind]}; " if kind in _MISSING else ""
        raise _refuse("model_type", kind, f"{missing}smallem reads {', '.join(_FAMILIES)} models")
    if (archs := hf.get("architectures")) is not None and archs != [_FAMILIES[kind]]:
        raise _refuse("architectures", archs, f"a {kind} model is a {_FAMILIES[kind]}")
    gemma = kind == "gemma3_text"
    if not gemma and hf.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", hf["hidden_act"], "smallem's MLP is SwiGLU with silu")
    for name in ("attention_bias", "mlp_bias"):  # Qwen2's q/k/v biases go without saying
        if hf.get(name, False) is not False:
            raise _refuse(name, hf[name], "smallem computes no o_proj or MLP bias (q/k/v biases: Qwen2's)")
    if not gemma and (hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or ())):
        field = "use_sliding_window" if hf.get("use_sliding_window") else "layer_types"
        raise _refuse(field, hf[field], "smallem attends to the whole context in every layer (no sliding window)")
    if hf.get("quantization_config") is not None:
        raise _refuse("quantization_config", hf["quantization_config"], "quantized weights are not supported")
    tie = hf.get("tie_word_embeddings", gemma)  # HF Llama's default: untied; Gemma's: tied
    if not isinstance(tie, bool):
        raise _refuse("tie_word_embeddings", tie, "expected true or false")
    dim, heads = _num(hf, "hidden_size"), _num(hf, "num_attention_heads")
    kv = heads if hf.get("num_key_value_heads") is None else _num(hf, "num_key_value_heads")  # None: MHA
    if heads % kv:
        raise _refuse("num_key_value_heads", kv, f"num_attention_heads {heads} is not a multiple of it")
    if hf.get("head_dim") is not None:
        head_dim = _num(hf, "head_dim")
    elif kind in ("qwen3", "gemma3_text"):  # their configs' defaults
        head_dim = 128 if kind == "qwen3" else 256
    elif dim % heads:
        raise _refuse("num_attention_heads", heads, f"hidden_size {dim} is not a multiple of it (and no head_dim)")
    else:
        head_dim = dim // heads
    layers = _num(hf, "num_hidden_layers")
    if gemma:
        parts = _gemma3(hf, layers, head_dim)
    else:
        theta, freqs = _rope(hf, head_dim)
        parts = {"rope_theta": theta, "rope_freqs": freqs, "qk_norm": kind == "qwen3"}
    try:
        return ModelConfig(
            vocab_size=_num(hf, "vocab_size"), dim=dim, n_layers=layers, n_heads=heads,
            n_kv_heads=kv, hidden_dim=_num(hf, "intermediate_size"),
            max_seq_len=_num(hf, "max_position_embeddings", 2048),  # LlamaConfig's defaults
            norm_eps=_num(hf, "rms_norm_eps", 1e-6, float), tie_embeddings=tie,
            attn_bias=kind == "qwen2", mtp=False, head_dim=head_dim, **parts,
        )  # fmt: skip
    except ValueError as e:  # ModelConfig's own checks (e.g. an odd head_dim)
        raise HFFormatError(f"HF config does not fit smallem: {e}") from None


def hf_jsons(cfg: ModelConfig, dtype: torch.dtype, eot: int | None) -> dict[str, Any]:
    """config.json (a Llama's, Qwen2's or Qwen3's), generation_config.json and tokenizer_config.json of an export."""
    if cfg.output_norms or cfg.local_layers or cfg.geglu or cfg.embed_scale != 1.0 or cfg.attn_scale:
        raise ExportError("a Gemma 3 model is not exported (smallem writes Llama, Qwen2 and Qwen3 folders)")
    name, rope = str(dtype).removeprefix("torch."), _rope_export(cfg)
    if cfg.attn_bias and cfg.qk_norm:
        raise ExportError("q/k/v biases and q/k norms together: no HF model type holds both")
    kind = "qwen2" if cfg.attn_bias else "qwen3" if cfg.qk_norm else "llama"
    config = {  # both rope layouts (transformers 4 and 5) and both dtype names
        "architectures": [_FAMILIES[kind]], "model_type": kind, "hidden_act": "silu",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": rope | {"rope_theta": cfg.rope_theta},
        **({"rope_scaling": rope} if cfg.rope_freqs else {}),
        **({} if cfg.attn_bias else {"attention_bias": False, "mlp_bias": False}),
        **({"use_sliding_window": False} if kind != "llama" else {}), "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": eot, "eos_token_id": eot, "torch_dtype": name, "dtype": name,
    }  # fmt: skip
    special = {"eos_token": EOT, "bos_token": EOT} if eot is not None else {}
    return {
        "config.json": config, "generation_config.json": {"bos_token_id": eot, "eos_token_id": eot},
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_seq_len,
                                  "clean_up_tokenization_spaces": False, **special},
    }  # fmt: skip
