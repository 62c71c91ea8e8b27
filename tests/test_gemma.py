"""Gemma 3 as data on the one model (`ModelConfig`'s embed_scale, output_norms, geglu, attn_scale, sliding_window,
local_layers, rope_local_theta), read from HF folders (Gemma's norms multiply by 1 + w) and from GGUF files laid out
as llama.cpp's converter lays them out (1 + w stored, every 6th layer global, the local rope base 10000): eager and
native must compute what transformers computes, local layers over their window only, and speculation must keep
the target's greedy tokens. The real Gemma 3 270M file (`make gemma3`) is checked against transformers where
present."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Family
from test_hf import transformers
from test_qwen import VOCAB, check_parity, save, write_converted
from test_rope_scaling import greedy_ref, run
from tokenizers import Tokenizer
from typer.testing import CliRunner

from smallem_cli.cli.app import app
from smallem_cli.interop.gguf import load_gguf
from smallem_cli.interop.hf import HFFormatError, config_from_hf, load_hf

NEW = 24  # new tokens: past the window of 8 from every prompt
LOCAL, GLOBAL = 100.0, 20000.0  # rope bases of the local layers and the global ones


def hf_gemma(seed: int = 0, llama_cpp: bool = False) -> Any:
    """A tiny random Gemma3ForCausalLM of 7 layers (6 local, the 6th global), a head width of its own, a window of 8.
    `llama_cpp`: the attention scale and local rope base llama.cpp assumes for a gemma3 file (1/sqrt(head_dim),
    10000); else others, so that a rule taken from the wrong field shows."""
    torch.manual_seed(seed)
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0 if llama_cpp else LOCAL},
            "full_attention": {"rope_type": "default", "rope_theta": GLOBAL}}  # fmt: skip
    cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=128, max_position_embeddings=256, rms_norm_eps=1e-6, sliding_window=8,
        query_pre_attn_scalar=32 if llama_cpp else 24, rope_parameters=rope, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )  # fmt: skip
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from zero (Gemma's multiply by 1 + w), so that a misplaced one shows; matrices
        for name, p in model.named_parameters():  # small: at 0.3 its sqrt(d)-scaled embedding makes it repeat one token
            p.copy_((0.5 if name.endswith("norm.weight") else 0.05) * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def gemma() -> Any:
    return hf_gemma()


def test_config_reads_gemmas_parts(gemma: Any) -> None:
    cfg = config_from_hf(gemma.config.to_dict())
    assert (cfg.output_norms, cfg.geglu, cfg.qk_norm, cfg.tie_embeddings) == (True, True, True, True)
    assert cfg.local_layers == (0, 1, 2, 3, 4, 6) and cfg.sliding_window == 8 and cfg.head_dim == 32
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.attn_scale) == (GLOBAL, LOCAL, 24**-0.5)
    assert cfg.embed_scale == 64**0.5


def test_folder_matches_transformers(gemma: Any, family: Family, tmp_path: Path) -> None:
    m, _ = load_hf(save(gemma, tmp_path / "hf", family.tokenizer))
    check_parity(m.materialize(), gemma, NEW)


def test_a_window_leaves_keys_out(gemma: Any, family: Family, tmp_path: Path) -> None:
    """The local layers see their window only: the same model attending to every key computes other logits."""
    m, _ = load_hf(save(gemma, tmp_path / "hf", family.tokenizer))
    x = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3))[None]
    with torch.no_grad():
        windowed = m.materialize().logits(m.hidden(x))[0]
        for blk in m.layers:  # the local layers' windows wider than the text: every key
            blk.window = 1000 if blk.window else 0  # type: ignore[assignment]
        whole = m.logits(m.hidden(x))[0]
    torch.testing.assert_close(windowed[:8], whole[:8])  # the first 8 positions see every key either way
    assert (windowed[8:] - whole[8:]).abs().max() > 1e-2


def test_gguf_matches_transformers(family: Family, tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    hf = hf_gemma(seed=1, llama_cpp=True)
    # as llama.cpp's converter writes a gemma3 file: norm weights as 1 + w (read so from the folder), the window in
    # the metadata (the local rope base and the global layers llama.cpp's own)
    write_converted(hf, "gemma3", tmp_path / "m.gguf", family.tokenizer, lambda w, cfg: w.add_sliding_window(8))
    g = load_gguf(tmp_path / "m.gguf").model
    assert g.cfg == config_from_hf(hf.config.to_dict())  # what llama.cpp assumes is what the folder says
    check_parity(g.materialize(), hf, NEW)


def _tokens(*args: str) -> list[int]:
    r = run("generate", *args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)["tokens"]


def test_native_and_speculation_keep_transformers_tokens(gemma: Any, family: Family, tmp_path: Path) -> None:
    """From the CLI, past the window: native and eager give transformers' greedy tokens, and so do the n-gram lookup
    and a Gemma draft (another random Gemma of the same vocabulary: its chain runs the windows too)."""
    target = save(gemma, tmp_path / "t", family.tokenizer)
    draft = save(hf_gemma(seed=5), tmp_path / "d", family.tokenizer)
    text = "the cat sat on the mat and the dog"
    ids = torch.tensor(Tokenizer.from_file(str(family.tokenizer)).encode(text).ids)
    ref = greedy_ref(gemma, ids, 32)
    base = (text, "--target", str(target), "-n", "32")
    for engine in ("eager", "native"):
        assert _tokens(*base, "--engine", engine, "--proposer", "none") == ref, engine
        for proposer in ("ngram", str(draft)):
            assert _tokens(*base, "--engine", engine, "--proposer", proposer, "-k", "3") == ref, (engine, proposer)


def test_a_batch_attends_each_window(gemma: Any, family: Family, tmp_path: Path) -> None:
    """Three prompts decoded together (the flat batch pass, keys addressed as pages): eager gives transformers'
    greedy tokens, native its own one-sequence tokens (its float32 sums are not transformers', and a random model has
    near-ties: the third prompt's 10th token is a tie to 1e-4)."""
    target = save(gemma, tmp_path / "t", family.tokenizer)
    tok = Tokenizer.from_file(str(family.tokenizer))
    texts = ["the cat sat on the mat and the dog", "in the beginning", "a b c d e f g h i j k l m n"]
    refs = {"eager": [greedy_ref(gemma, torch.tensor(tok.encode(t).ids), 20) for t in texts]}
    refs["native"] = [_tokens(t, "--target", str(target), "-n", "20", "--engine", "native") for t in texts]
    for engine, ref in refs.items():
        args = ["batch", "--target", str(target), "-n", "20", "--max-batch", "3", "--ordered", "-q", "--engine", engine]
        r = CliRunner().invoke(app, args, input="\n".join(texts) + "\n")
        assert r.exit_code == 0, r.output
        assert [json.loads(line)["tokens"] for line in r.stdout.splitlines()] == ref, engine


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
        ({"hidden_activation": "silu"}, "hidden_activation='silu'"),
        ({"layer_types": ["full_attention"]}, "layer_types="),
        ({"model_type": "gemma3"}, "vision tower"),
        ({"model_type": "gemma2"}, "soft-capping"),
    ],
)
def test_what_is_not_gemma3_is_named(gemma: Any, change: dict, named: str) -> None:
    with pytest.raises(HFFormatError, match=named.replace("[", r"\[").replace("(", r"\(")):
        config_from_hf(gemma.config.to_dict() | change)


REAL = Path(__file__).resolve().parents[1] / "models" / "gemma-3-270m-q4_k_m.gguf"


@pytest.mark.skipif(not REAL.is_file(), reason="the real Gemma 3 270M file: `make gemma3`")
def test_the_real_file_gives_transformers_tokens() -> None:
    """Gemma 3 270M Q4_K_M as transformers reads the same file (dequantized, float32): the greedy tokens equal up to
    any position where its top two logits are within 1e-3, native and eager; the n-gram lookup keeps them."""
    pytest.importorskip("accelerate")
    pytest.importorskip("gguf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(REAL.parent), gguf_file=REAL.name, dtype=torch.float32
    ).eval()
    tok = load_gguf(REAL).tokenizer
    for text in ("The capital of France is", "def fibonacci(n):"):
        x = torch.tensor([tok.encode(text).ids])
        with torch.no_grad():
            out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=24,
                              output_logits=True, return_dict_in_generate=True)  # fmt: skip
        ref = out.sequences[0, x.shape[1] :].tolist()
        margins = [float(t.diff()) for t in (-lg[0].topk(2).values for lg in out.logits)]
        upto = next((i for i, m in enumerate(margins) if m < 1e-3), len(ref))
        for engine in ("native", "eager"):
            got = _tokens(text, "--target", str(REAL), "-n", "24", "--engine", engine, "--proposer", "none")
            assert got[:upto] == ref[:upto], (text, engine)
        spec = _tokens(text, "--target", str(REAL), "-n", "24", "--engine", "native", "--proposer", "ngram")
        assert spec[:upto] == ref[:upto]
