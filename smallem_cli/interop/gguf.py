"""GGUF export: a smallem model as llama.cpp reads it (architecture `llama`), tokenizer included.

Beyond renaming, one change: llama.cpp ropes adjacent pairs (x_2i, x_2i+1) where smallem pairs x_i with
x_{i+D/2}, so the rows of Wq and Wk are reordered within each head (q·k, and so the outputs, unchanged).
The tokenizer is the byte-level BPE as llama.cpp's `gpt2` model, `<|endoftext|>` both BOS and EOS.
The `gguf` package (the `gguf` extra) is imported only when a file is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import atomic
from ..config import ModelConfig
from ..model.llama import Transformer, permute_rope
from ..model.tokenizer import EOT
from .exportdir import ExportError, orphans, sigterm_raises
from .hf import load_for_export

DTYPES = ("f32", "f16")
INSTALL = "pip install 'smallem[gguf]'"
Vocab = tuple[list[str], list[int], list[str], int | None]  # tokens by id, their types, merges, EOT's id
_MATRICES = {  # smallem name in a layer -> llama.cpp's
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
    "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}  # fmt: skip
_TOP = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",  # an untied head only: llama.cpp reuses token_embd when it is absent
}


def gguf_package(error: type[Exception] = ImportError, what: str = "GGUF export") -> Any:
    try:
        import gguf
    except ImportError:
        raise error(f"{what} needs the gguf package: {INSTALL}") from None
    return gguf


def gguf_name(key: str) -> str:
    """smallem parameter name -> llama.cpp tensor name: `layers.3.q_proj.weight` -> `blk.3.attn_q.weight`."""
    if key in _TOP:
        return _TOP[key]
    parts = key.split(".")
    if len(parts) == 4 and parts[0] == "layers" and parts[2] in _MATRICES and parts[3] == "weight":
        return f"blk.{parts[1]}.{_MATRICES[parts[2]]}.weight"
    raise ExportError(f"no GGUF name for the parameter {key}")


def gguf_tensors(model: Transformer, dtype: str = "f32") -> dict[str, np.ndarray]:
    """llama.cpp name -> array, in smallem's [out, in] order (GGUF lists the dims reversed): matrices
    in `dtype` (f32 or f16), norm weights in float32 as llama.cpp wants them, Wq and Wk `permute_rope`d."""
    out = {}
    for key, v in model.state_dict().items():
        w = v.detach().to("cpu", torch.float32)
        if key.endswith("q_proj.weight"):
            w = permute_rope(w, model.cfg.n_heads)
        elif key.endswith("k_proj.weight"):
            w = permute_rope(w, model.cfg.n_kv_heads)
        if w.dim() == 2 and dtype == "f16":
            w = w.to(torch.float16)
        out[gguf_name(key)] = w.contiguous().numpy()
    return out


def gguf_vocab(tokenizer_json: str | Path, vocab_size: int) -> Vocab:
    """A byte-level BPE tokenizer.json -> (tokens by id, their GGUF token types, merges "a b", the id of
    <|endoftext|> or None). The list is padded to `vocab_size` with unused `[PADn]` tokens."""
    path = Path(tokenizer_json)
    try:
        tok = json.loads(path.read_text(encoding="utf-8"))
        model, pre = tok["model"], tok.get("pre_tokenizer") or {}
        vocab, merges = model["vocab"], model.get("merges", [])
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise ExportError(f"{path}: unreadable tokenizer: {e}") from None
    if model.get("type") != "BPE" or pre.get("type") != "ByteLevel" or model.get("byte_fallback"):
        kind = f"{model.get('type')} with a {pre.get('type')} pre-tokenizer"
        raise ExportError(f"{path}: {kind}: only byte-level BPE (GPT-2's) has a llama.cpp `gpt2` form")
    ids: dict[int, str] = {i: text for text, i in vocab.items()}
    types = dict.fromkeys(ids, 1)  # NORMAL
    for added in tok.get("added_tokens") or []:
        i = added["id"]
        ids[i], types[i] = added["content"], 3 if added.get("special") else 4  # CONTROL, USER_DEFINED
    if not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids):
        raise ExportError(f"{path}: its token ids do not fit the model's vocabulary of {vocab_size}")
    tokens = [ids.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    kinds = [types.get(i, 5) for i in range(vocab_size)]  # 5: UNUSED
    pairs = [m if isinstance(m, str) else " ".join(m) for m in merges]
    eot = next((i for i, t in ids.items() if t == EOT), None)
    return tokens, kinds, pairs, eot


def add_llama_metadata(w: Any, cfg: ModelConfig, vocab: Vocab, pre: str = "gpt-2") -> None:
    """A llama model's hyperparameters and its byte-level BPE tokenizer (`gguf_vocab`'s), on GGUFWriter `w`."""
    tokens, kinds, merges, eot = vocab
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.hidden_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(kinds)
    w.add_token_merges(merges)
    if eot is not None:
        w.add_bos_token_id(eot)
        w.add_eos_token_id(eot)


def write_gguf(
    model: Transformer, out_file: str | Path, tokenizer_json: str | Path, dtype: str = "f32", name: str = "smallem"
) -> None:
    """Write `model` and its tokenizer to `out_file` as it is: no checks of the destination (see export_gguf)."""
    gguf, cfg = gguf_package(), model.cfg
    tensors = gguf_tensors(model, dtype)
    vocab = gguf_vocab(tokenizer_json, cfg.vocab_size)
    w = gguf.GGUFWriter(str(out_file), "llama")
    try:
        w.add_name(name)
        w.add_vocab_size(cfg.vocab_size)
        add_llama_metadata(w, cfg, vocab)
        w.add_add_bos_token(False)
        w.add_add_eos_token(False)
        _finish(w, tensors, dtype)
    finally:
        w.close()


def restore_gguf(src: str | Path, model: Transformer, out_file: str | Path, dtype: str) -> None:
    """GGUF file `src`'s metadata with `model`'s weights (its dequantized values) in `dtype`, as `out_file`."""
    gguf = gguf_package()
    skip = ("general.architecture", "general.file_type", "general.quantization_version")  # the writer's own
    w = gguf.GGUFWriter(str(out_file), "llama")
    try:
        for name, f in gguf.GGUFReader(str(src)).fields.items():
            if not name.startswith("GGUF.") and name not in skip:
                w.add_key_value(name, f.contents(), f.types[0], f.types[1] if len(f.types) > 1 else None)
        _finish(w, gguf_tensors(model, dtype), dtype)
    finally:
        w.close()


def _finish(w: Any, tensors: dict[str, np.ndarray], dtype: str) -> None:
    gguf = gguf_package()
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    for tname, arr in tensors.items():
        w.add_tensor(tname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()


def export_gguf(
    ckpt: str | Path, out_file: str | Path, tokenizer_json: str | Path, *, dtype: str = "f32", overwrite: bool = False
) -> None:
    """Write a smallem model checkpoint as one GGUF file that llama.cpp loads, written aside and renamed into
    place (no half file); an existing regular file replaced only with `overwrite`, an input never."""
    ckpt, out, tokenizer_json = Path(ckpt), Path(out_file), Path(tokenizer_json)
    if dtype not in DTYPES:
        raise ExportError(f"unknown GGUF dtype {dtype!r}: use {' or '.join(DTYPES)}")
    gguf_package()  # the missing extra is reported before the checkpoint is read
    for src in (ckpt, tokenizer_json):
        if out.resolve() == src.resolve():
            raise ExportError(f"cannot export over the input {src}: choose another file")
    if out.is_dir():
        raise FileExistsError(f"{out} is a folder: give the path of the .gguf file to write")
    # only a regular file or nothing, judged before the checkpoint is read: a refusal comes at once
    if atomic.check_replaceable(out) and not overwrite:
        raise FileExistsError(f"{out} exists (pass --overwrite to replace it)")
    model, _, _ = load_for_export(ckpt, tokenizer_json, "holds an MTP module: it needs its target and has no GGUF form")
    out.parent.mkdir(parents=True, exist_ok=True)
    for p, suffix in orphans(out, folder=False):  # the files aside of exports whose process is gone
        if suffix == "tmp":
            p.unlink(missing_ok=True)
    with sigterm_raises():
        atomic.replace_with(out, lambda tmp: write_gguf(model, tmp, tokenizer_json, dtype, ckpt.stem))
