"""Hugging Face interchange, Llama, Qwen2 and Qwen3 folders in and out (and MiMo's, for vLLM): a renaming (smallem's
Transformer is Llama without `model.`, `self_attn.`, `mlp.`) plus a config translation, refusing by field what
it would compute otherwise (yarn or dynamic rotary positions, an o_proj bias, sliding windows, ...)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer

from .. import atomic
from ..config import ModelConfig
from ..model import checkpoint
from ..model.llama import Transformer, llama3_freqs, llama3_params
from ..model.tokenizer import EOT, load_tokenizer


class ExportError(ValueError):
    """A model that cannot be exported faithfully, or a destination that may not be written."""


class HFFormatError(ExportError):
    """A Hugging Face folder or config that smallem cannot read or write faithfully."""


_MLP = ("gate_proj", "up_proj", "down_proj")
# model_type -> its architecture; Qwen2 is Llama with q/k/v biases, Qwen3 Llama with q/k norms
_FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_MISSING = {"mixtral": "mixture-of-experts layers", "qwen2_moe": "mixture-of-experts layers",
            "qwen3_moe": "mixture-of-experts layers", "mamba": "state-space (Mamba) layers"}  # fmt: skip
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}  # an export keeps these


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


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Translate a LlamaForCausalLM config.json dict; HFFormatError for anything smallem does not compute."""
    if not isinstance(hf, dict):
        raise HFFormatError(f"an HF config is a JSON object, not {type(hf).__name__}")
    if (kind := _required(hf, "model_type")) not in _FAMILIES:
        missing = f"smallem does not compute {_MISSING[kind]}; " if kind in _MISSING else ""
        raise _refuse("model_type", kind, f"{missing}smallem reads {', '.join(_FAMILIES)} models")
    if (archs := hf.get("architectures")) is not None and archs != [_FAMILIES[kind]]:
        raise _refuse("architectures", archs, f"a {kind} model is a {_FAMILIES[kind]}")
    if hf.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", hf["hidden_act"], "smallem's MLP is SwiGLU with silu")
    for name in ("attention_bias", "mlp_bias"):  # Qwen2's q/k/v biases go without saying
        if hf.get(name, False) is not False:
            raise _refuse(name, hf[name], "smallem computes no o_proj or MLP bias (q/k/v biases: Qwen2's)")
    if hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or ()):
        field = "use_sliding_window" if hf.get("use_sliding_window") else "layer_types"
        raise _refuse(field, hf[field], "smallem attends to the whole context in every layer (no sliding window)")
    if hf.get("quantization_config") is not None:
        raise _refuse("quantization_config", hf["quantization_config"], "quantized weights are not supported")
    tie = hf.get("tie_word_embeddings", False)  # HF Llama's default: untied
    if not isinstance(tie, bool):
        raise _refuse("tie_word_embeddings", tie, "expected true or false")
    dim, heads = _num(hf, "hidden_size"), _num(hf, "num_attention_heads")
    kv = heads if hf.get("num_key_value_heads") is None else _num(hf, "num_key_value_heads")  # None: MHA
    if dim % heads:
        raise _refuse("num_attention_heads", heads, f"hidden_size {dim} is not a multiple of it")
    if heads % kv:
        raise _refuse("num_key_value_heads", kv, f"num_attention_heads {heads} is not a multiple of it")
    if (head_dim := hf.get("head_dim", 128 if kind == "qwen3" else None)) is not None and head_dim != dim // heads:
        raise _refuse("head_dim", head_dim, f"smallem needs hidden_size / num_attention_heads = {dim // heads}")
    theta, freqs = _rope(hf, dim // heads)
    try:
        return ModelConfig(
            vocab_size=_num(hf, "vocab_size"), dim=dim, n_layers=_num(hf, "num_hidden_layers"), n_heads=heads,
            n_kv_heads=kv, hidden_dim=_num(hf, "intermediate_size"),
            max_seq_len=_num(hf, "max_position_embeddings", 2048),  # LlamaConfig's defaults
            norm_eps=_num(hf, "rms_norm_eps", 1e-6, float), rope_theta=theta, rope_freqs=freqs, tie_embeddings=tie,
            attn_bias=kind == "qwen2", qk_norm=kind == "qwen3", mtp=False,
        )  # fmt: skip
    except ValueError as e:  # ModelConfig's own checks (e.g. an odd head_dim)
        raise HFFormatError(f"HF config does not fit smallem: {e}") from None


def in_group(rest: str) -> str:
    """A layer's parameter under its HF sub-module: `q_proj.weight` -> `self_attn.q_proj.weight`."""
    sub = rest.split(".", 1)[0]
    attn = sub.endswith(("_proj", "q_norm", "k_norm"))
    return ("mlp." if sub in _MLP else "self_attn." if attn else "") + rest  # the other norms sit in the layer


def hf_name(key: str) -> str:
    """smallem parameter name -> HF Llama name: `layers.3.q_proj.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    if key == "lm_head.weight":
        return key
    if key.startswith("layers."):
        _, i, rest = key.split(".", 2)
        return f"model.layers.{i}.{in_group(rest)}"
    return "model." + key


def is_hf_dir(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file()


def _tokenizer(path: Path, vocab_size: int) -> Tokenizer:
    """The tokenizer at `path`, checked to fit the model: an id past the embedding would crash a lookup."""
    if not path.is_file():
        raise HFFormatError(f"tokenizer.json not found: {path}")
    tok = load_tokenizer(path)  # TokenizerError if unreadable
    if (top := max(tok.get_vocab(with_added_tokens=True).values(), default=-1)) >= vocab_size:
        raise HFFormatError(f"{path}: token id {top} does not fit vocab_size {vocab_size}")
    return tok


def _declared(folder: Path) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """HF name -> (file, dtype, shape) of every tensor of the folder's weights, from the headers alone."""
    if (index := folder / "model.safetensors.index.json").is_file():  # sharded: it names every shard
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise HFFormatError(f"{index}: unreadable shard index: {e}") from None
        if not all(isinstance(f, str) and f and Path(f).name == f for f in shards):
            raise HFFormatError(f"{index}: its weight_map must name files in {folder}")
        files = [folder / f for f in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise HFFormatError(f"{folder}: no *.safetensors weights (pytorch_model.bin is not read)")
    out = {}
    for path in files:  # a shard named in the index but absent fails to open, named here
        try:
            for name, (dtype, shape) in checkpoint.header(path).items():
                if not name.endswith("rotary_emb.inv_freq"):  # old transformers saved this derived buffer
                    out[name] = (path, dtype, shape)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise HFFormatError(f"{path}: unreadable safetensors file: {e}") from None
    return out


def load_hf(folder: str | Path, device: torch.device | str = "cpu") -> tuple[Transformer, str]:
    """A LlamaForCausalLM folder -> (float32 eval Transformer, its tokenizer.json's fingerprint), checked first."""
    folder = Path(folder)
    if not is_hf_dir(folder):
        raise HFFormatError(f"{folder} is not a Hugging Face model folder (no config.json)")
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise HFFormatError(f"{folder}/config.json: unreadable: {e}") from None
    cfg = config_from_hf(raw)
    tok = _tokenizer(folder / "tokenizer.json", cfg.vocab_size)  # before the weights: fail before the slow part
    expected = checkpoint.expected_shapes(cfg)  # smallem name -> shape; nothing allocated
    declared = _declared(folder)
    tied_head = cfg.tie_embeddings and "lm_head.weight" in declared  # redundant: checked equal to the embedding
    if tied_head:
        expected["lm_head.weight"] = expected["embed_tokens.weight"]
    ours = {hf_name(k): k for k in expected}
    missing, extra = sorted(set(ours) - set(declared)), sorted(set(declared) - set(ours))
    if missing or extra:
        raise HFFormatError(f"{folder}: weights do not fit config.json: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, (_, dtype, shape) in declared.items():
        if shape != expected[ours[name]]:
            raise HFFormatError(f"{folder}: {name} has shape {shape}, not {expected[ours[name]]}")
        if dtype not in checkpoint.FLOAT_DTYPES:
            raise HFFormatError(f"{folder}: {name} has dtype {dtype}: only {', '.join(checkpoint.FLOAT_DTYPES)}")
    found: dict[str, torch.Tensor] = {}
    for path in dict.fromkeys(p for p, _, _ in declared.values()):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in (n for n, (p, _, _) in declared.items() if p == path):
                    found[ours[name]] = f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise HFFormatError(f"{path}: unreadable safetensors file: {e}") from None
    checkpoint.check_finite(found, str(folder))
    if tied_head and not torch.equal(found.pop("lm_head.weight"), found["embed_tokens.weight"]):
        raise HFFormatError(f"{folder}: tie_word_embeddings is true but lm_head.weight differs from embed_tokens")
    return checkpoint.build(Transformer(cfg), found, device), checkpoint.vocab_fingerprint(tok)


def load_for_export(ckpt: Path, tokenizer_json: Path, mtp_refusal: str) -> tuple[Transformer, int | None, torch.dtype]:
    """The model, its end-of-text id and `stored_dtype`; ExportError for an MTP module or another tokenizer's."""
    if checkpoint.read_meta(ckpt).get("kind") == "mtp":
        raise ExportError(f"{ckpt} {mtp_refusal}")
    model, meta = checkpoint.load_model(ckpt)
    eot = _tokenizer(tokenizer_json, model.cfg.vocab_size).token_to_id(EOT)
    if meta.get("tokenizer") and meta["tokenizer"] != checkpoint.tokenizer_fingerprint(tokenizer_json):
        raise ExportError(f"{ckpt} was trained with another tokenizer than {tokenizer_json}")
    return model, eot, stored_dtype(ckpt)


def stored_dtype(ckpt: Path) -> torch.dtype:
    """The dtype of a (readable) checkpoint's weights where an export keeps it, else float32."""
    return _DTYPES.get(next(iter(checkpoint.header(ckpt).values()))[0], torch.float32)


def hf_jsons(cfg: ModelConfig, dtype: torch.dtype, eot: int | None) -> dict[str, Any]:
    """config.json (a Llama's, Qwen2's or Qwen3's), generation_config.json and tokenizer_config.json of an export."""
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


def export_hf(
    checkpoint_path: str | Path, outdir: str | Path, tokenizer_json: str | Path, *, overwrite: bool = False
) -> None:
    """A smallem checkpoint as a LlamaForCausalLM folder, written whole where `check_destination` allows."""
    ckpt, outdir, tokenizer_json = Path(checkpoint_path), Path(outdir), Path(tokenizer_json)
    check_destination(outdir, (ckpt, tokenizer_json), overwrite)
    why = "it needs its target and has no plain Llama form (`--format mimo` on the target writes both, for vLLM)"
    model, eot, dtype = load_for_export(ckpt, tokenizer_json, f"holds an MTP module: {why}")
    # HF names, in the stored dtype (lossless: load_model widened the model from it).
    tensors = {hf_name(k): v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    write_export(outdir, tensors, hf_jsons(model.cfg, dtype, eot), tokenizer_json)


MTP_LAYER = "model.mtp_layers.0"
MODULE_NAMES = {"hnorm": "hidden_layernorm", "enorm": "token_layernorm", "eh_proj": "input_proj"}


def export_mimo(
    target: str | Path, mtp_path: str | Path, outdir: str | Path, tokenizer: str | Path, *, overwrite: bool = False
) -> None:
    """The target and its MTP module as one MiMoForCausalLM folder, which vLLM runs with its `mtp` method, written
    as `export_hf` writes one. MiMo's MTP layer computes our module (DeepSeek-V3's) for a dense target; its layers
    are Qwen2's, Llama layers with q/k/v biases, so the target goes under Qwen2's names with zero biases and the
    module as `model.mtp_layers.0`. Why, and what still differs: docs/architecture.md, "The MTP module in vLLM"."""
    target, mtp_file, outdir, tok = Path(target), Path(mtp_path), Path(outdir), Path(tokenizer)
    check_destination(outdir, (target, mtp_file, tok), overwrite)
    model, eot, dtype = load_for_export(target, tok, "is an MTP module: give the target, and the module with --mtp")
    mtp, meta = checkpoint.load_mtp(mtp_file, model)  # refused if it does not fit the target
    if meta.get("tokenizer") and meta["tokenizer"] != checkpoint.tokenizer_fingerprint(tok):
        raise HFFormatError(f"{mtp_file} was trained with another tokenizer than {tok}")
    cfg = model.cfg
    if cfg.qk_norm:
        raise HFFormatError(f"{target}: its q/k norms have no place in MiMo's Qwen2 layers")
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
            tensors.setdefault(f"{prefix}.self_attn.{proj}.bias", torch.zeros(heads * cfg.head_dim))
    jsons = hf_jsons(cfg, dtype, eot)
    config = {k: v for k, v in jsons["config.json"].items() if k not in ("attention_bias", "mlp_bias", "head_dim")}
    jsons["config.json"] = config | {
        "architectures": ["MiMoForCausalLM"], "model_type": "qwen2", "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": cfg.n_layers,
    }  # fmt: skip
    write_export(outdir, {k: v.detach().to(dtype).contiguous() for k, v in tensors.items()}, jsons, tok)


def check_destination(outdir: Path, inputs: tuple[Path, ...], overwrite: bool) -> None:
    """An export may write `outdir`: a folder or nothing (`atomic.check_replaceable`), holding none of its
    inputs, empty unless `overwrite`. Called before the checkpoint is read: a refusal comes at once."""
    for p, suffix in orphans(outdir, folder=True):  # `.old`: the previous `outdir`, if the swap never happened
        if suffix == "old" and not outdir.exists():
            p.rename(outdir)
        else:
            shutil.rmtree(p, ignore_errors=True)
    atomic.check_replaceable(outdir, folder=True)
    for src in inputs:  # replacing the folder would delete the export's own input
        if src.resolve().is_relative_to(outdir.resolve()):
            raise ExportError(f"cannot export into {outdir}: it holds the input {src}; choose another folder")
    if outdir.exists() and any(outdir.iterdir()) and not overwrite:
        raise FileExistsError(f"{outdir} exists and is not empty (pass --overwrite to replace it)")


def write_export(outdir: Path, tensors: dict[str, torch.Tensor], jsons: dict[str, Any], tokenizer_json: Path) -> None:
    """The folder built under a temporary name beside `outdir`, then swapped in: an error, Ctrl-C or SIGTERM
    leaves `outdir` as it was; what an export killed outright left behind is cleared by the next one."""
    outdir.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = (outdir.with_name(f".{outdir.name}.{os.getpid()}.{x}") for x in ("tmp", "old"))
    shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted run with this process id
    with sigterm_raises():
        tmp.mkdir()
        try:
            checkpoint.write_safetensors(tensors, tmp / "model.safetensors", {"format": "pt"})  # transformers checks it
            for name, obj in jsons.items():
                (tmp / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            shutil.copyfile(tokenizer_json, tmp / "tokenizer.json")
            # Judged again just before the swap: while the folder was built, `outdir` may have become
            # something else, which the rename would move aside and `rmtree` then fail to remove.
            if atomic.check_replaceable(outdir, folder=True):
                outdir.rename(old)
            tmp.rename(outdir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if old.exists() and not outdir.exists():
                old.rename(outdir)  # put the previous folder back
            raise
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM (a `kill`, a stopped job) raises SystemExit(143) in the main thread, so the
    export's clean-up runs as for Ctrl-C; a second SIGTERM is ignored while it does."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def orphans(out: Path, folder: bool) -> Iterator[tuple[Path, str]]:
    """(path, "tmp" or "old") of each `.NAME.PID.tmp` / `.old` beside `out` that a dead export left behind."""
    if not out.parent.is_dir():
        return
    for p in sorted(out.parent.glob(f".{out.name}.*.*")):
        pid, _, suffix = p.name.removeprefix(f".{out.name}.").partition(".")
        kind_ok = p.is_dir() if folder else p.is_file()
        if suffix not in ("tmp", "old") or not pid.isdigit() or not kind_ok or p.is_symlink():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            yield p, suffix
        except (OverflowError, OSError):  # no process id (not an export's), or alive (another user's)
            pass
