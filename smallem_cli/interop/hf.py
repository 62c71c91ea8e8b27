"""Hugging Face interchange, Llama, Qwen2 and Qwen3 folders in and out, Gemma 3's in (and MiMo's, for vLLM): a renaming
(smallem's Transformer is Llama without `model.`, `self_attn.`, `mlp.`; Gemma 3 names its norms its own way) plus a
config translation (`hf_config`, which refuses by field what smallem would compute otherwise: yarn or dynamic rotary
positions, an o_proj bias, soft-capping, ...)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from .. import atomic
from ..model import checkpoint
from ..model.llama import Transformer
from ..model.tokenizer import EOT, load_tokenizer
from ..model.weights import Stored, Weights, WeightsError, safetensors_header
from .hf_config import ExportError, HFFormatError, config_from_hf, hf_jsons

_MLP = ("gate_proj", "up_proj", "down_proj")
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}  # an export keeps these


def in_group(rest: str) -> str:
    """A layer's parameter under its HF sub-module: `q_proj.weight` -> `self_attn.q_proj.weight`."""
    sub = rest.split(".", 1)[0]
    attn = sub.endswith(("_proj", "q_norm", "k_norm"))
    return ("mlp." if sub in _MLP else "self_attn." if attn else "") + rest  # the other norms sit in the layer


# Gemma 3's names for the norms: its post_attention_layernorm norms the attention's output, where Llama's (and
# smallem's) is the MLP's input norm
_GEMMA_NORMS = {
    "post_attention_layernorm": "pre_feedforward_layernorm", "attn_output_norm": "post_attention_layernorm",
    "mlp_output_norm": "post_feedforward_layernorm",
}  # fmt: skip


def hf_name(key: str, gemma: bool = False) -> str:
    """smallem parameter name -> HF Llama name: `layers.3.q_proj.weight` -> `model.layers.3.self_attn.q_proj.weight`;
    `gemma`: Gemma 3's."""
    if key == "lm_head.weight":
        return key
    if key.startswith("layers."):
        _, i, rest = key.split(".", 2)
        if gemma and (norm := rest.removesuffix(".weight")) in _GEMMA_NORMS:
            rest = f"{_GEMMA_NORMS[norm]}.weight"
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


def _declared(folder: Path) -> dict[str, Stored]:
    """HF name -> where each tensor of the folder's weights lies, from the headers alone."""
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
            for name, (dtype, shape, offset, nbytes) in safetensors_header(path)[0].items():
                if not name.endswith("rotary_emb.inv_freq"):  # old transformers saved this derived buffer
                    out[name] = Stored(path, offset, nbytes, dtype, shape, name=name)
        except WeightsError as e:
            raise HFFormatError(str(e)) from None
        except OSError as e:
            raise HFFormatError(f"{path}: unreadable safetensors file: {e.strerror or e}") from None
    return out


def load_hf(folder: str | Path, device: torch.device | str = "cpu") -> tuple[Transformer, str]:
    """A LlamaForCausalLM folder -> (its Transformer, the weights left in their files until used, and its
    tokenizer.json's fingerprint), every name, shape, type and extent checked first."""
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
    ours = {hf_name(k, cfg.output_norms): k for k in expected}
    missing, extra = sorted(set(ours) - set(declared)), sorted(set(declared) - set(ours))
    if missing or extra:
        raise HFFormatError(f"{folder}: weights do not fit config.json: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, t in declared.items():
        if t.shape != expected[ours[name]]:
            raise HFFormatError(f"{folder}: {name} has shape {t.shape}, not {expected[ours[name]]}")
        if t.kind not in checkpoint.FLOAT_DTYPES:
            raise HFFormatError(f"{folder}: {name} has dtype {t.kind}: only {', '.join(checkpoint.FLOAT_DTYPES)}")
    if cfg.output_norms:  # Gemma's RMSNorm multiplies by 1 + w: read as the weights it multiplies by, as llama.cpp's
        declared = {n: replace(t, shift=1.0) if n.endswith("norm.weight") else t for n, t in declared.items()}
    weights = Weights({ours[name]: t for name, t in declared.items()}, device)
    if tied_head:  # read once here, to be left out
        try:
            same = torch.equal(weights["lm_head.weight"].read(), weights["embed_tokens.weight"].read())  # type: ignore[arg-type]
        except (WeightsError, OSError) as e:
            raise HFFormatError(str(e)) from None
        if not same:
            raise HFFormatError(f"{folder}: tie_word_embeddings is true but lm_head.weight differs from embed_tokens")
        weights = Weights({k: v for k, v in weights.items() if k != "lm_head.weight"}, device)
    return Transformer.stored(cfg, weights), checkpoint.vocab_fingerprint(tok)


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
