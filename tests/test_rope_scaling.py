"""Scaled rotary positions, Llama 3's rule and linear: `ModelConfig.rope_freqs`, read from HF folders in both
config spellings (transformers 4's rope_scaling + rope_theta, 5's rope_parameters) and from GGUF files (the
tensor rope_freqs.weight, llama.cpp's form), must compute what transformers computes, eager and native alike.

The tiny model has heads 64 wide and original_max_position_embeddings 64, so that all three of llama3's bands
hold frequencies, and its prompt runs past position 64.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import CORPUS, Family
from test_hf import hf_logits, smallem_greedy, tokens, transformers
from typer.testing import CliRunner

from smallem_cli.cli.app import app
from smallem_cli.config import ConfigError, ModelConfig
from smallem_cli.interop.gguf import add_llama_metadata, gguf_name, gguf_vocab, load_gguf, write_gguf
from smallem_cli.interop.hf import HFFormatError, config_from_hf, export_hf, load_hf
from smallem_cli.model import checkpoint
from smallem_cli.model.llama import Transformer
from smallem_cli.model.weights import permute_rope

LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # fmt: skip
LINEAR = {"rope_type": "linear", "factor": 3.0}
PROMPT, NEW = 90, 30  # past original_max_position_embeddings
VOCAB = 300  # the tiny family's byte-level BPE tokenizer (conftest), which GGUF files can hold


def hf_model(rope: dict[str, Any], theta: float = 10000.0, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=128, max_position_embeddings=256, rope_parameters=rope | {"rope_theta": theta},
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
    return model


def save(model: Any, folder: Path, tok: Path, spelling: str = "v5") -> Path:
    """The model's folder with its rope in transformers 5's spelling ("v5") or 4's ("v4": rope_scaling, with the
    legacy key "type" for linear, and a top-level rope_theta)."""
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_bytes(tok.read_bytes())
    raw = json.loads((folder / "config.json").read_text())
    if spelling == "v4":
        rp = raw.pop("rope_parameters")
        raw["rope_theta"] = rp.pop("rope_theta")
        raw["rope_scaling"] = {"type" if rp["rope_type"] == "linear" else "rope_type": rp.pop("rope_type"), **rp}
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def greedy_ref(model: Any, prompt: torch.Tensor, n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            prompt[None], attention_mask=torch.ones_like(prompt)[None], do_sample=False, max_new_tokens=n
        )
    return out[0, len(prompt) :].tolist()


def same_logits(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal to float32 rounding (the logits span about +-15; a model with plain rope is off by more than 10)."""
    torch.testing.assert_close(ours, ref, atol=1e-4 * float(ref.abs().max()), rtol=0)


def run(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def llama3() -> Any:
    return hf_model(LLAMA3)


def test_llama3_factors_cover_all_three_bands(llama3: Any) -> None:
    """The test model is a real test of the rule: some pairs kept, some slowed by the factor, some blended."""
    cfg = config_from_hf(llama3.config.to_dict())
    assert cfg.rope_freqs[0] == 1.0 and cfg.rope_freqs[-1] == 4.0 and any(1 < f < 4 for f in cfg.rope_freqs)
    inv = llama3.model.rotary_emb.inv_freq.double()
    base = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    torch.testing.assert_close(base / torch.tensor(cfg.rope_freqs, dtype=torch.float64), inv, rtol=1e-6, atol=0)


@pytest.mark.parametrize("spelling", ["v5", "v4"])
@pytest.mark.parametrize("rope", ["llama3", "linear"])
def test_scaled_folder_matches_transformers(
    llama3: Any, family: Family, tmp_path: Path, spelling: str, rope: str
) -> None:
    hf = llama3 if rope == "llama3" else hf_model(LINEAR, seed=1)
    m, _ = load_hf(save(hf, tmp_path / "hf", family.tokenizer, spelling))
    m.materialize()
    assert m.cfg.rope_freqs == config_from_hf(hf.config.to_dict()).rope_freqs != ()
    x = tokens(PROMPT + NEW)
    with torch.no_grad():
        same_logits(m.logits(m.hidden(x[None]))[0], hf_logits(hf, x))
    m.pack()
    prompt = tokens(PROMPT, seed=2)
    ref = greedy_ref(hf, prompt, NEW)
    assert smallem_greedy(m, prompt, NEW) == ref and len(set(ref)) > 5


def test_native_engine_gives_the_eager_tokens(llama3: Any, family: Family, tmp_path: Path) -> None:
    folder = save(llama3, tmp_path / "hf", family.tokenizer)
    prompt = CORPUS  # 139 tokens
    outs = {}
    for engine in ("eager", "native"):
        res = run("generate", prompt, "--target", str(folder), "--engine", engine, "-n", str(NEW), "--json")
        assert res.exit_code == 0, (res.stderr, res.exception)
        out = json.loads(res.stdout)
        assert out["stats"]["backend"].startswith(engine), out["stats"]
        outs[engine] = out["tokens"]
    assert outs["native"] == outs["eager"] and len(outs["eager"]) == NEW


def test_plain_rope_theta_500000_still_works(family: Family, tmp_path: Path) -> None:
    hf = hf_model({"rope_type": "default"}, theta=500000.0, seed=2)
    m, _ = load_hf(save(hf, tmp_path / "hf", family.tokenizer))
    m.materialize()
    assert m.cfg.rope_theta == 500000.0 and m.cfg.rope_freqs == ()
    x = tokens(PROMPT)
    with torch.no_grad():
        same_logits(m.logits(m.hidden(x[None]))[0], hf_logits(hf, x))


# --- GGUF ------------------------------------------------------------------------------------------
def converter_factors(theta: float, head_dim: int, rope: dict[str, Any]) -> list[float]:
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py computes it for a llama3 model."""
    factor, low, high, old = (rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                 "original_max_position_embeddings"))  # fmt: skip
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for freq in 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim):
        wavelen = 2 * math.pi / float(freq)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def write_converted(hf: Any, path: Path, tok: Path, kv: dict[str, Any], freqs: np.ndarray | None) -> None:
    """The HF model as llama.cpp's converter writes it: Wq and Wk permuted, rope_freqs.weight if given."""
    import gguf

    m, _ = load_hf(save(hf, path.with_suffix(".src"), tok))
    m.materialize()
    cfg = m.cfg
    w = gguf.GGUFWriter(str(path), "llama")
    add_llama_metadata(w, cfg, gguf_vocab(tok, cfg.vocab_size))
    for key, value in kv.items():
        w.add_key_value(key, value[0], value[1])
    for key, v in m.state_dict().items():
        heads = {"q_proj": cfg.n_heads, "k_proj": cfg.n_kv_heads}.get(key.split(".")[-2], 0)
        w.add_tensor(gguf_name(key), (permute_rope(v, heads) if heads else v).contiguous().numpy())
    if freqs is not None:
        w.add_tensor("rope_freqs.weight", freqs)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_rope_freqs_match_transformers(llama3: Any, family: Family, tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    freqs = np.array(converter_factors(10000.0, 64, LLAMA3), dtype=np.float32)
    write_converted(llama3, tmp_path / "m.gguf", family.tokenizer, {}, freqs)
    m = load_gguf(tmp_path / "m.gguf").model.materialize()
    x = tokens(PROMPT + NEW)
    with torch.no_grad():
        same_logits(m.logits(m.hidden(x[None]))[0], hf_logits(llama3, x))
    m.pack()
    prompt = tokens(PROMPT, seed=2)
    assert smallem_greedy(m, prompt, NEW) == greedy_ref(llama3, prompt, NEW)


def test_gguf_linear_metadata_matches_transformers(family: Family, tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    hf = hf_model(LINEAR, seed=1)
    kv = {"llama.rope.scaling.type": ("linear", gguf.GGUFValueType.STRING),
          "llama.rope.scaling.factor": (3.0, gguf.GGUFValueType.FLOAT32)}  # fmt: skip
    write_converted(hf, tmp_path / "m.gguf", family.tokenizer, kv, None)
    m = load_gguf(tmp_path / "m.gguf").model.materialize()
    assert m.cfg.rope_freqs == (3.0,) * 32
    x = tokens(PROMPT + NEW)
    with torch.no_grad():
        same_logits(m.logits(m.hidden(x[None]))[0], hf_logits(hf, x))


def test_exports_write_the_scaling_back(llama3: Any, family: Family, tmp_path: Path) -> None:
    """A scaled smallem checkpoint exported to HF (both spellings) and to GGUF (rope_freqs.weight) computes the
    same logits there: transformers on the folder, smallem on both."""
    pytest.importorskip("gguf")
    tok = family.tokenizer
    m, _ = load_hf(save(llama3, tmp_path / "src", tok))
    m.materialize()
    ckpt = tmp_path / "m.safetensors"
    checkpoint.save(ckpt, m, tokenizer=checkpoint.tokenizer_fingerprint(tok), dtype=torch.float32)
    export_hf(ckpt, tmp_path / "hf", tok)
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert raw["rope_scaling"] == LLAMA3 and raw["rope_parameters"] == LLAMA3 | {"rope_theta": 10000.0}
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    x = tokens(PROMPT + NEW)
    torch.testing.assert_close(hf_logits(back, x), hf_logits(llama3, x), atol=1e-5, rtol=0)
    write_gguf(m, tmp_path / "m.gguf", tok)
    g = load_gguf(tmp_path / "m.gguf").model.materialize()
    torch.testing.assert_close(torch.tensor(g.cfg.rope_freqs), torch.tensor(m.cfg.rope_freqs), rtol=1e-6, atol=0)
    with torch.no_grad():
        same_logits(g.logits(g.hidden(x[None]))[0], hf_logits(llama3, x))


# --- refusals --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("rope", "named"),
    [
        ({"rope_type": "yarn", "factor": 4.0}, "rope type 'yarn'"),
        ({"rope_type": "dynamic", "factor": 2.0}, "rope type 'dynamic'"),
        ({"rope_type": "longrope", "short_factor": [1.0]}, "rope type 'longrope'"),
        (LLAMA3 | {"factor": 0}, "factor=0"),
        (LLAMA3 | {"factor": -2.0}, "factor=-2.0"),
        (LLAMA3 | {"low_freq_factor": 4.0}, "low_freq_factor must be below its high_freq_factor"),
        (LLAMA3 | {"beta_fast": 32}, "does not compute beta_fast for llama3"),
        ({"rope_type": "linear"}, "lacks required field factor"),
    ],
)
def test_bad_scaling_is_refused_in_one_line(family: Family, tmp_path: Path, rope: dict[str, Any], named: str) -> None:
    folder = save(hf_model(LINEAR), tmp_path / "hf", family.tokenizer)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(raw | {"rope_parameters": rope | {"rope_theta": 10000.0}}))
    res = run("generate", "hi", "--target", str(folder), "-n", "2")
    assert res.exit_code == 2 and res.stderr.count("\n") == 1 and named in res.stderr, res.stderr


def test_spellings_that_disagree_are_refused() -> None:
    base = hf_model(LLAMA3).config.to_dict()
    with pytest.raises(HFFormatError, match="disagrees with rope_scaling"):
        config_from_hf(base | {"rope_scaling": LLAMA3 | {"factor": 8.0}})
    assert config_from_hf(base | {"rope_scaling": LLAMA3}) == config_from_hf(base)


def test_gguf_bad_rope_freqs_are_refused_in_one_line(llama3: Any, family: Family, tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    good = np.array(converter_factors(10000.0, 64, LLAMA3), dtype=np.float32)
    cases = {
        "short": (good[:16], {}, "rope_freqs holds 16 factors, not 32, one per pair"),
        "nan": (np.where(np.arange(32) == 5, np.nan, good).astype(np.float32), {}, "finite number > 0, got nan"),
        "zero": (np.where(np.arange(32) == 0, 0, good).astype(np.float32), {}, "finite number > 0, got 0.0"),
        "yarn": (None, {"llama.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING)}, "scaling.type='yarn'"),
    }
    for name, (freqs, kv, named) in cases.items():
        write_converted(llama3, tmp_path / f"{name}.gguf", family.tokenizer, kv, freqs)
        res = run("generate", "hi", "--target", str(tmp_path / f"{name}.gguf"), "-n", "2")
        assert res.exit_code == 2 and res.stderr.count("\n") == 1 and named in res.stderr, (name, res.stderr)


def test_config_checks_and_old_checkpoints() -> None:
    cfg = ModelConfig(dim=32, n_heads=4, rope_freqs=[2.0] * 4)  # type: ignore[arg-type]  # JSON's list
    assert cfg.rope_freqs == (2.0,) * 4 and ModelConfig.from_json(cfg.to_json()) == cfg
    old = json.loads(ModelConfig().to_json())
    old.pop("rope_freqs")  # a checkpoint saved before the field: plain rope
    assert ModelConfig.from_json(json.dumps(old)).rope_freqs == ()
    for bad, named in (([2.0] * 3, "3 factors"), ([0.0] * 4, "> 0"), ("x", "list of numbers")):
        with pytest.raises(ConfigError, match=named):
            ModelConfig(dim=32, n_heads=4, rope_freqs=bad)  # type: ignore[arg-type]
    assert isinstance(Transformer(cfg).cos, torch.Tensor)
