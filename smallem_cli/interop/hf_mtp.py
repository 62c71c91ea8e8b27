"""The target and its MTP module as one MiMoForCausalLM folder, which vLLM runs with its `mtp` method.

MiMo's MTP layer computes our module (DeepSeek-V3's) for a dense target; its layers are Qwen2's, Llama
layers with q/k/v biases, so the target goes under Qwen2's names with zero biases and the module as
`model.mtp_layers.0`. Why, and what still differs: docs/architecture.md, "The MTP module in vLLM".
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..model import checkpoint
from .exportdir import check_destination, write_export
from .hf import HFFormatError, hf_jsons, hf_name, in_group, load_for_export, stored_dtype

MTP_LAYER = "model.mtp_layers.0"
MODULE_NAMES = {"hnorm": "hidden_layernorm", "enorm": "token_layernorm", "eh_proj": "input_proj"}


def export_mimo(
    target: str | Path, mtp_path: str | Path, outdir: str | Path, tokenizer: str | Path, *, overwrite: bool = False
) -> None:
    """The target and its MTP module as one MiMoForCausalLM folder, written as `export_hf` writes one."""
    target, mtp_file, outdir, tok = Path(target), Path(mtp_path), Path(outdir), Path(tokenizer)
    check_destination(outdir, (target, mtp_file, tok), overwrite)
    model, eot, dtype = load_for_export(target, tok, "is an MTP module: give the target, and the module with --mtp")
    mtp, meta = checkpoint.load_mtp(mtp_file, model)  # refused if it does not fit the target
    if meta.get("tokenizer") and meta["tokenizer"] != checkpoint.tokenizer_fingerprint(tok):
        raise HFFormatError(f"{mtp_file} was trained with another tokenizer than {tok}")
    cfg = model.cfg
    if (mtp.cfg.hidden_dim, mtp.cfg.norm_eps) != (cfg.hidden_dim, cfg.norm_eps):
        raise HFFormatError(f"{mtp_file}: MiMo's MTP block takes the target's shape (hidden_dim, norm_eps)")
    if stored_dtype(mtp_file) != dtype:  # both lossless in the wider of the two
        dtype = torch.float32

    tensors = {hf_name(k): v for k, v in model.state_dict().items()}
    tensors["lm_head.weight"] = model.head_weight.clone()  # MiMo's head is untied: its own tensor
    tensors[f"{MTP_LAYER}.final_layernorm.weight"] = model.norm.weight.clone()  # the module ends on the target's norm
    for k, v in mtp.state_dict().items():  # `hnorm.weight`, ..., `block.q_proj.weight`, ...
        module, rest = k.split(".", 1)
        name = f"{MODULE_NAMES[module]}.{rest}" if module in MODULE_NAMES else in_group(rest)
        tensors[f"{MTP_LAYER}.{name}"] = v
    for prefix in [*(f"model.layers.{i}" for i in range(cfg.n_layers)), MTP_LAYER]:  # Qwen2's q/k/v biases: zero
        for proj, heads in (("q_proj", cfg.n_heads), ("k_proj", cfg.n_kv_heads), ("v_proj", cfg.n_kv_heads)):
            tensors[f"{prefix}.self_attn.{proj}.bias"] = torch.zeros(heads * cfg.head_dim)
    jsons = hf_jsons(cfg, dtype, eot)
    config = {k: v for k, v in jsons["config.json"].items() if k not in ("attention_bias", "mlp_bias", "head_dim")}
    jsons["config.json"] = config | {
        "architectures": ["MiMoForCausalLM"],
        "model_type": "qwen2",
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": cfg.n_layers,
    }
    write_export(outdir, {k: v.detach().to(dtype).contiguous() for k, v in tensors.items()}, jsons, tok)
