"""The target and its MTP module as one folder that vLLM runs with its `mtp` method.

Our MTP module is DeepSeek-V3's: norm(h_i) ‖ norm(embed(t_{i+1})) -> a linear 2d -> d -> one decoder
block -> the target's final norm and head. vLLM has that layer for a dense target in Xiaomi's MiMo
(`MiMoForCausalLM`, Qwen2 layers): hidden_layernorm, token_layernorm, input_proj, a decoder block,
final_layernorm, the shared embedding and head, fed the target's last hidden state before its final
norm, as ours is. A Qwen2 layer is a Llama layer with q/k/v biases, computing what ours does when
they are zero. So `export_mimo` writes the target under Qwen2's names with zero biases and the module
as `model.mtp_layers.0`. What differs: vLLM chains a second guess on the module's output after
final_layernorm, ours before (guesses past the first are not ours, though the target still checks
them); and MiMo zeroes the token embedding at position 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..model import checkpoint
from .exportdir import check_destination, write_export
from .hf import _DTYPE_NAMES, HFFormatError, _hf_config, _hf_name, _in_group, hf_jsons, load_for_export, stored_kind

MTP_LAYER = "model.mtp_layers.0"
MODULE_NAMES = {"hnorm.weight": "hidden_layernorm.weight", "enorm.weight": "token_layernorm.weight"}
MODULE_NAMES["eh_proj.weight"] = "input_proj.weight"


def mtp_name(key: str) -> str:
    """smallem MTP parameter name -> MiMo's: `block.q_proj.weight` -> `model.mtp_layers.0.self_attn.q_proj.weight`."""
    if key in MODULE_NAMES:
        return f"{MTP_LAYER}.{MODULE_NAMES[key]}"
    if not key.startswith("block."):
        raise HFFormatError(f"MTP parameter {key} has no place in MiMo's layout")
    return f"{MTP_LAYER}.{_in_group(key.removeprefix('block.'))}"


def zero_biases(prefix: str, n_heads: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> dict:
    """Qwen2's q/k/v biases of one layer, all zero."""
    sizes = {"q_proj": n_heads, "k_proj": n_kv_heads, "v_proj": n_kv_heads}
    return {f"{prefix}.self_attn.{p}.bias": torch.zeros(n * head_dim, dtype=dtype) for p, n in sizes.items()}


def mimo_config(base: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """The Llama export's config as MiMo's (Qwen2's fields, one MTP layer, an untied head written out)."""
    cfg = {k: v for k, v in base.items() if k not in ("attention_bias", "mlp_bias", "head_dim")}
    cfg.update(
        architectures=["MiMoForCausalLM"],
        model_type="qwen2",
        num_nextn_predict_layers=1,
        tie_word_embeddings=False,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=n_layers,
    )
    return cfg


def export_mimo(
    target_path: str | Path,
    mtp_path: str | Path,
    outdir: str | Path,
    tokenizer_json: str | Path,
    *,
    overwrite: bool = False,
) -> None:
    """Write the target and its MTP module as one MiMoForCausalLM folder (see the module's doc),
    as `export_hf` writes a folder: whole or not at all, nothing replaced without `overwrite`."""
    target, mtp_file, outdir, tok = Path(target_path), Path(mtp_path), Path(outdir), Path(tokenizer_json)
    check_destination(outdir, (target, mtp_file, tok), overwrite)
    kind, stored = stored_kind(target)
    if kind == "mtp":
        raise HFFormatError(f"{target} is an MTP module: give the target, and the module with --mtp")
    model, eot, dtype = load_for_export(target, tok, stored)
    if stored_kind(mtp_file)[1] != dtype:  # both lossless in the wider of the two
        dtype = torch.float32
    mtp, meta = checkpoint.load_mtp(mtp_file, model)  # refused if it does not fit the target
    if meta.get("tokenizer") and meta["tokenizer"] != checkpoint.tokenizer_fingerprint(tok):
        raise HFFormatError(f"{mtp_file} was trained with another tokenizer than {tok}")
    cfg = model.cfg
    if (mtp.cfg.hidden_dim, mtp.cfg.norm_eps) != (cfg.hidden_dim, cfg.norm_eps):
        raise HFFormatError(f"{mtp_file}: MiMo's MTP block takes the target's shape (hidden_dim, norm_eps)")

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(dtype).clone().contiguous()  # clone: the tied head is its own tensor here

    tensors = {_hf_name(k): put(v) for k, v in model.state_dict().items()}
    tensors["lm_head.weight"] = put(model.head_weight)
    tensors.update({mtp_name(k): put(v) for k, v in mtp.state_dict().items()})
    tensors[f"{MTP_LAYER}.final_layernorm.weight"] = put(model.norm.weight)  # the module ends on the target's norm
    for prefix in [f"model.layers.{i}" for i in range(cfg.n_layers)] + [MTP_LAYER]:
        tensors.update(zero_biases(prefix, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, dtype))
    config = mimo_config(_hf_config(cfg, _DTYPE_NAMES[dtype], eot), cfg.n_layers)
    write_export(outdir, tensors, hf_jsons(config, eot), tok)
