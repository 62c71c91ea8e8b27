"""GGUF in and out: a smallem model as llama.cpp reads it (architecture `llama`, `qwen2` or `qwen3`, tokenizer
included), and a llama.cpp file as a smallem Transformer, tokenizer and chat format (the TYPES to their exact values;
anything smallem would compute differently refused with one line naming it). Beyond renaming, one change: for `llama`
llama.cpp ropes adjacent pairs (x_2i, x_2i+1) where smallem pairs x_i with x_{i+D/2}, so the rows of Wq and Wk are
reordered within each head (outputs unchanged); its Qwen files keep Hugging Face's order, as smallem. An export's
tokenizer is byte-level BPE, llama.cpp's `gpt2`, with `<|endoftext|>` both BOS and EOS; a file's is read as it says
(`gguf_vocab`: byte-level BPE or SentencePiece)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from .. import atomic
from ..config import ModelConfig
from ..model import checkpoint
from ..model.chat import ChatFormat, check_template
from ..model.llama import Transformer
from ..model.tokenizer import EOT
from ..model.weights import Stored, Weights, permute_rope
from .gguf_file import MAGIC, GGUFFile, GGUFReadError, Meta, gguf_package, open_gguf
from .gguf_vocab import CONTROL, UNUSED, USER, tokenizer
from .hf import load_for_export, orphans, sigterm_raises
from .hf_config import ExportError

DTYPES = ("f32", "f16")
Vocab = tuple[list[str], list[int], list[str], int | None]  # tokens by id, their types, merges, EOT's id
_MATRICES = {  # smallem name in a layer -> llama.cpp's
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
    "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "q_norm": "attn_q_norm",
    "k_norm": "attn_k_norm", "attn_output_norm": "post_attention_norm", "mlp_output_norm": "post_ffw_norm",
}  # fmt: skip
# Qwen2: Llama with q/k/v biases; Qwen3: with q/k norms; Gemma 3: `_gemma3`
ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
_TOP = {  # lm_head: an untied head only (llama.cpp reuses token_embd when output.weight is absent)
    "embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
}  # fmt: skip
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")  # read exactly


def gguf_name(key: str) -> str:
    """smallem parameter name -> llama.cpp tensor name: `layers.3.q_proj.weight` -> `blk.3.attn_q.weight`."""
    if key in _TOP:
        return _TOP[key]
    parts = key.split(".")
    if len(parts) == 4 and parts[0] == "layers" and parts[2] in _MATRICES and parts[3] in ("weight", "bias"):
        return f"blk.{parts[1]}.{_MATRICES[parts[2]]}.{parts[3]}"
    raise ExportError(f"no GGUF name for the parameter {key}")


def arch_of(cfg: ModelConfig) -> str:
    """llama.cpp's architecture for `cfg`: gemma3 with output norms, qwen2 with q/k/v biases, qwen3 with q/k norms,
    else llama."""
    if cfg.output_norms:
        return "gemma3"
    if cfg.attn_bias and cfg.qk_norm:
        raise ExportError("q/k/v biases and q/k norms together: no llama.cpp architecture holds both")
    return "qwen2" if cfg.attn_bias else "qwen3" if cfg.qk_norm else "llama"


def gguf_tensors(model: Transformer, dtype: str = "f32") -> dict[str, np.ndarray]:
    """llama.cpp name -> array, in smallem's [out, in] order (GGUF lists the dims reversed): matrices
    in `dtype` (f32 or f16), norm weights and biases in float32 as llama.cpp wants them, Wq and Wk `permute_rope`d
    for llama."""
    out, llama = {}, arch_of(model.cfg) == "llama"
    for key, v in model.materialize().state_dict().items():
        w = v.detach().to("cpu", torch.float32)
        if llama and key.endswith(("q_proj.weight", "k_proj.weight")):
            w = permute_rope(w, model.cfg.n_heads if key.endswith("q_proj.weight") else model.cfg.n_kv_heads)
        if w.dim() == 2 and dtype == "f16":
            w = w.to(torch.float16)
        out[gguf_name(key)] = w.contiguous().numpy()
    if model.cfg.rope_freqs:  # llama.cpp divides each pair's rotary frequency by its factor, as rope_tables does
        out["rope_freqs.weight"] = np.array(model.cfg.rope_freqs, dtype=np.float32)
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
    types = dict.fromkeys(ids, 1)  # normal
    for added in tok.get("added_tokens") or []:
        i = added["id"]
        ids[i], types[i] = added["content"], CONTROL if added.get("special") else USER
    if not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids):
        raise ExportError(f"{path}: its token ids do not fit the model's vocabulary of {vocab_size}")
    tokens = [ids.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    kinds = [types.get(i, UNUSED) for i in range(vocab_size)]
    pairs = [m if isinstance(m, str) else " ".join(m) for m in merges]
    eot = next((i for i, t in ids.items() if t == EOT), None)
    return tokens, kinds, pairs, eot


def add_llama_metadata(w: Any, cfg: ModelConfig, vocab: Vocab, pre: str = "gpt-2") -> None:
    tokens, kinds, merges, eot = vocab
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.hidden_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    if cfg.head_dim * cfg.n_heads != cfg.dim:  # llama.cpp derives it from these two otherwise
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
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
    w = gguf.GGUFWriter(str(out_file), arch_of(cfg))
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
    w = gguf.GGUFWriter(str(out_file), arch := arch_of(model.cfg))
    try:
        for name, f in gguf.GGUFReader(str(src)).fields.items():
            # any linear scaling is in the model's rope_freqs, which the file gets as a tensor
            if not name.startswith(("GGUF.", f"{arch}.rope.scaling.")) and name not in skip:
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


@dataclass
class GGUFModel:
    model: Transformer  # its weights in the file until used (`Transformer.stored`)
    tokenizer: Tokenizer
    fingerprint: str  # checkpoint.vocab_fingerprint: equal to its tokenizer.json's when exported by smallem
    chat: ChatFormat
    types: tuple[str, ...]  # the tensor types the file holds


# tokens that end a generation wherever a file has them, as llama.cpp's vocabulary takes them
_END_TEXTS = frozenset(("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>"))


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


def _rope_freqs(meta: Meta, file: GGUFFile, pairs: int, a: str) -> tuple[float, ...]:
    """`ModelConfig.rope_freqs`: the tensor rope_freqs.weight (llama.cpp's form of llama3 scaling), times the factor
    of linear scaling (llama.cpp scales positions by its inverse); () for plain rotary positions."""
    if (kind := meta.text(f"{a}rope.scaling.type") or "none") not in ("none", "linear"):
        raise GGUFReadError(f"{meta.path}: {a}rope.scaling.type={kind!r}: smallem computes linear and llama3 only")
    scaling = (f"{a}rope.scaling.type", f"{a}rope.scaling.factor")
    if extra := [k for k in meta if k.startswith(f"{a}rope.scaling.") and k not in scaling]:
        raise GGUFReadError(f"{meta.path}: unsupported metadata {extra[0]}={meta.get(extra[0])!r}")
    linear = meta.num(f"{a}rope.scaling.factor", float, 1.0)
    t = next((t for t in file.tensors if t.name == "rope_freqs.weight"), None)
    if t is not None and (len(t.dims) != 1 or t.kind != "F32"):
        raise GGUFReadError(f"{meta.path}: tensor rope_freqs.weight must be one F32 row, not {t.kind} {t.dims}")
    freqs = [1.0] * pairs * (linear != 1)
    if t is not None:
        freqs = np.fromfile(file.path, dtype="<f4", count=t.dims[0], offset=t.offset).astype(np.float64).tolist()
    return tuple(f * linear for f in freqs)


def _gemma3(meta: Meta, a: str, dim: int, heads: int, head_dim: int, n_layers: int) -> dict[str, Any]:
    """`ModelConfig`'s Gemma 3 fields as llama.cpp computes a gemma3 file: its norm weights hold 1 + w already (the
    converter adds it), every 6th layer global, the local layers' rope base 10000, the scores scaled by
    1/sqrt(head_dim) except in the 27B (62 layers: 1/sqrt(dim / heads))."""
    if f"{a}final_logit_softcapping" in meta:
        raise GGUFReadError(f"{meta.path}: {a}final_logit_softcapping: smallem computes no soft-capping")
    window = meta.num(f"{a}attention.sliding_window") if f"{a}attention.sliding_window" in meta else 0
    local = tuple(i for i in range(n_layers) if i % 6 < 5) if window else ()
    return {
        "embed_scale": dim**0.5, "output_norms": True, "geglu": True, "qk_norm": True, "sliding_window": window,
        "local_layers": local, "rope_local_theta": meta.num(f"{a}rope.freq_base_swa", float, 10000.0),
        "attn_scale": (dim // heads if n_layers == 62 else head_dim) ** -0.5,
    }  # fmt: skip


def _config(meta: Meta, file: GGUFFile, n_vocab: int, tied: bool) -> ModelConfig:
    path = meta.path
    if (arch := meta.text("general.architecture")) not in ARCHS:
        raise GGUFReadError(f"{path}: architecture {arch!r}: smallem reads {', '.join(ARCHS)} only")
    a = f"{arch}."  # the prefix of its hyperparameters
    if meta.get(f"{a}expert_count", 0):
        raise GGUFReadError(f"{path}: {a}expert_count={meta.get(f'{a}expert_count')!r}: mixture of experts")
    dim, heads = meta.num(f"{a}embedding_length"), meta.num(f"{a}attention.head_count")
    kv = meta.num(f"{a}attention.head_count_kv", default=heads)
    if f"{a}attention.key_length" in meta:  # a head width of its own (Qwen3's), else embedding_length / head_count
        head_dim = meta.num(f"{a}attention.key_length")
    elif dim % heads:
        raise GGUFReadError(
            f"{path}: {a}embedding_length {dim} is not divisible by {a}attention.head_count {heads} "
            "and no attention.key_length gives the head width"
        )
    else:
        head_dim = dim // heads
    for key in (f"{a}rope.dimension_count", f"{a}attention.value_length"):  # rope over whole heads, v as wide as k
        if key in meta and meta.get(key) != head_dim:
            raise GGUFReadError(f"{path}: metadata {key}={meta.get(key)!r}: smallem needs the head width {head_dim}")
    if f"{a}vocab_size" in meta and meta.get(f"{a}vocab_size") != n_vocab:
        raise GGUFReadError(f"{path}: {a}vocab_size={meta.get(f'{a}vocab_size')!r}, the token list has {n_vocab}")
    if arch != "gemma3" and meta.get(f"{a}attention.sliding_window"):
        raise GGUFReadError(f"{path}: {a}attention.sliding_window: smallem attends to the whole context")
    rope_freqs = _rope_freqs(meta, file, head_dim // 2, a)
    n_layers = meta.num(f"{a}block_count")
    parts = _gemma3(meta, a, dim, heads, head_dim, n_layers) if arch == "gemma3" else {"qk_norm": arch == "qwen3"}
    try:
        return ModelConfig(
            vocab_size=n_vocab, dim=dim, n_layers=n_layers, n_heads=heads, n_kv_heads=kv,
            hidden_dim=meta.num(f"{a}feed_forward_length"), max_seq_len=meta.num(f"{a}context_length"),
            norm_eps=meta.num(f"{a}attention.layer_norm_rms_epsilon", float),
            rope_theta=meta.num(f"{a}rope.freq_base", float, 10000.0), tie_embeddings=tied, mtp=False,
            rope_freqs=rope_freqs, attn_bias=arch == "qwen2", head_dim=head_dim, **parts,
        )  # fmt: skip
    except ValueError as e:  # ModelConfig's own checks
        raise GGUFReadError(f"{path}: its hyperparameters do not fit smallem: {e}") from None


def _weights(file: GGUFFile, cfg: ModelConfig, device: torch.device | str) -> Weights:
    """Where each smallem parameter lies in the file, names, shapes, types and extents all checked; nothing is read."""
    expected = checkpoint.expected_shapes(cfg)  # a tied model's has no lm_head
    ours = {gguf_name(k): k for k in expected}
    path = file.path
    found = {t.name: t for t in file.tensors if t.name != "rope_freqs.weight"}  # read with the config
    missing, extra = sorted(set(ours) - set(found)), sorted(set(found) - set(ours))
    if missing or extra:
        raise GGUFReadError(f"{path}: tensors do not fit its metadata: missing {missing[:3]}, unexpected {extra[:3]}")
    stored = {}
    for name, t in found.items():
        key, kind = ours[name], t.kind
        shape = tuple(reversed(t.dims))  # GGUF lists ggml's dims, innermost first
        if shape != expected[key]:
            raise GGUFReadError(f"{path}: tensor {name} has shape {shape}, its metadata says {expected[key]}")
        if kind not in TYPES:
            raise GGUFReadError(f"{path}: tensor {name} has type {kind}: only {', '.join(TYPES)}")
        heads = cfg.n_heads if key.endswith("q_proj.weight") else cfg.n_kv_heads if key.endswith("k_proj.weight") else 0
        heads *= arch_of(cfg) == "llama"  # llama.cpp's converter permutes Wq, Wk for llama alone
        stored[key] = Stored(path, t.offset, t.nbytes, kind, shape, heads, name)
    return Weights(stored, device)


def load_gguf(path: str | Path, device: torch.device | str = "cpu", check_chat: bool = False) -> GGUFModel:
    """A llama, qwen2, qwen3 or gemma3 GGUF file -> its model (float32, eval), tokenizer, fingerprint and chat format,
    or GGUFReadError; `check_chat`: its chat template is checked (`check_template`) before the weights, ChatError where
    it is broken."""
    path = Path(path)
    file = open_gguf(path)
    meta = Meta(file)
    tokens = meta.strings("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFReadError(f"{path}: metadata tokenizer.ggml.tokens is missing or empty")
    cfg = _config(meta, file, len(tokens), tied=not any(t.name == "output.weight" for t in file.tensors))
    ids = {n: v for n in ("bos", "eos", "eot", "eom") if (v := meta.get(f"tokenizer.ggml.{n}_token_id")) is not None}
    for name, v in ids.items():
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < len(tokens):
            raise GGUFReadError(f"{path}: tokenizer.ggml.{name}_token_id={v!r} is not a token id")
    tok = tokenizer(meta, tokens, ids)  # before the weights: a refusal costs no memory
    # any of them ends a generation: the file's, and the tokens llama.cpp ends on by their text (Gemma's end of turn)
    named = (i for i, text in enumerate(tokens) if text in _END_TEXTS)
    ends = tuple(dict.fromkeys([*(ids[n] for n in ("eos", "eot", "eom") if n in ids), *named]))
    bos, eos = (tokens[ids[n]] if n in ids else "" for n in ("bos", "eos"))
    chat = ChatFormat(ends, meta.text("tokenizer.chat_template"), bos, eos)
    if check_chat:
        check_template(chat, str(path))
    weights = _weights(file, cfg, device)
    return GGUFModel(Transformer.stored(cfg, weights), tok, checkpoint.vocab_fingerprint(tok), chat, weights.kinds)
