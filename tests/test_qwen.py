"""Qwen2 (q/k/v biases) and Qwen3 (an RMSNorm on each head of q and k before rope) as data on the one model:
`ModelConfig.attn_bias` and `qk_norm`, read from HF folders and from GGUF files laid out as llama.cpp's converter
lays them out (no q/k permutation for these architectures), must compute what transformers computes, eager and
native alike, and speculation must keep the target's greedy tokens."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CORPUS, Family
from test_hf import hf_logits, smallem_greedy, transformers
from test_rope_scaling import greedy_ref, run, same_logits
from tokenizers import Regex, pre_tokenizers

from smallem_cli.config import ModelConfig
from smallem_cli.interop.gguf import add_llama_metadata, gguf_name, gguf_vocab, load_gguf, write_gguf
from smallem_cli.interop.gguf_vocab import QWEN2_SPLIT
from smallem_cli.interop.hf import HFFormatError, config_from_hf, export_hf, load_hf
from smallem_cli.model import checkpoint

VOCAB, NEW = 300, 20  # the tiny family's byte-level BPE tokenizer (conftest), which GGUF files can hold
KINDS = {"qwen2": "Qwen2", "qwen3": "Qwen3"}


def hf_model(kind: str, seed: int = 0, **extra: Any) -> Any:
    torch.manual_seed(seed)
    cfg = getattr(transformers, f"{KINDS[kind]}Config")(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=extra.pop("head_dim", 16), intermediate_size=128, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra,
    )  # fmt: skip
    model = getattr(transformers, f"{KINDS[kind]}ForCausalLM")(cfg).eval()
    with torch.no_grad():  # norms not all ones and biases not zero, so that a misplaced one shows
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=sorted(KINDS))
def qwen(request: pytest.FixtureRequest) -> tuple[str, Any]:
    return request.param, hf_model(request.param)


def save(model: Any, folder: Path, tok: Path) -> Path:
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_bytes(tok.read_bytes())
    return folder


def prompts() -> list[torch.Tensor]:
    return [
        torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(s)) for s, n in enumerate((5, 17, 40))
    ]


def check_parity(m: Any, hf: Any, new: int = NEW) -> None:
    """Logits close over 60 tokens; greedy tokens equal over `new` on 3 prompts."""
    x = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        same_logits(m.logits(m.hidden(x[None]))[0], hf_logits(hf, x))
    m.pack()
    for p in prompts():
        ref = greedy_ref(hf, p, new)
        assert smallem_greedy(m, p, new) == ref and len(set(ref)) > 3


def test_folder_matches_transformers(qwen: tuple[str, Any], family: Family, tmp_path: Path) -> None:
    kind, hf = qwen
    m, _ = load_hf(save(hf, tmp_path / "hf", family.tokenizer))
    m.materialize()
    assert (m.cfg.attn_bias, m.cfg.qk_norm) == (kind == "qwen2", kind == "qwen3")
    check_parity(m, hf)


def write_converted(hf: Any, kind: str, path: Path, tok: Path, more: Callable[[Any, Any], None] | None = None) -> None:
    """The HF model as llama.cpp's converter writes a qwen2 / qwen3 (or gemma3) file: Wq and Wk as they are, biases
    and q/k norm weights in float32, the `qwen2` pre-tokenizer; `more(writer, config)` adds metadata."""
    import gguf

    m, _ = load_hf(save(hf, path.with_suffix(".src"), tok))
    m.materialize()
    w = gguf.GGUFWriter(str(path), kind)
    add_llama_metadata(w, m.cfg, gguf_vocab(tok, m.cfg.vocab_size), pre="qwen2")
    if more is not None:
        more(w, m.cfg)
    for key, v in m.state_dict().items():
        w.add_tensor(gguf_name(key), v.contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_matches_transformers(qwen: tuple[str, Any], family: Family, tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    kind, hf = qwen
    write_converted(hf, kind, tmp_path / "m.gguf", family.tokenizer)
    g = load_gguf(tmp_path / "m.gguf")
    g.model.materialize()
    assert (g.model.cfg.attn_bias, g.model.cfg.qk_norm) == (kind == "qwen2", kind == "qwen3")
    check_parity(g.model, hf)


def test_a_head_width_of_its_own(family: Family, tmp_path: Path) -> None:
    """Qwen3's head_dim apart from hidden / heads (Qwen3-0.6B's: 128 against 1024 / 16), here 32 against 64 / 4:
    the folder and its GGUF conversion (which says it as attention.key_length) compute what transformers does."""
    pytest.importorskip("gguf")
    hf = hf_model("qwen3", seed=2, head_dim=32)
    m, _ = load_hf(save(hf, tmp_path / "hf", family.tokenizer))
    assert m.cfg.head_dim == 32 and m.cfg.dim // m.cfg.n_heads == 16
    check_parity(m.materialize(), hf)
    write_converted(hf, "qwen3", tmp_path / "m.gguf", family.tokenizer)
    g = load_gguf(tmp_path / "m.gguf").model
    assert g.cfg == m.cfg
    check_parity(g.materialize(), hf)
    texts = {e: run("generate", "hello", "--target", str(tmp_path / "m.gguf"), "-n", "12", "--engine", e, "--json")
             for e in ("eager", "native")}  # fmt: skip
    assert all(r.exit_code == 0 for r in texts.values()), [r.output for r in texts.values()]
    assert json.loads(texts["eager"].stdout)["tokens"] == json.loads(texts["native"].stdout)["tokens"]


def test_qwen2_split_is_qwens_own() -> None:
    """The `qwen2` pre-tokenizer splits text as Qwen's tokenizer.json does (case-insensitive contractions)."""
    hf_pattern = QWEN2_SPLIT.replace("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])",
                                     "(?i:'s|'t|'re|'ve|'m|'ll|'d)")  # fmt: skip
    ours, theirs = (pre_tokenizers.Split(Regex(p), "isolated") for p in (QWEN2_SPLIT, hf_pattern))
    text = "He'LL pay $1234.50 for it's\n\n  naïve  résumé!!\tDONE's 42x"
    assert ours.pre_tokenize_str(text) == theirs.pre_tokenize_str(text)
    assert [s for s, _ in ours.pre_tokenize_str("year 1234")][-4:] == ["1", "2", "3", "4"]


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_speculation_and_native_keep_the_tokens(
    qwen: tuple[str, Any], family: Family, tmp_path: Path, source: str
) -> None:
    """--proposer ngram gives the target alone's greedy tokens, on both engines, and native gives eager's."""
    kind, hf = qwen
    if source == "gguf":
        pytest.importorskip("gguf")
        write_converted(hf, kind, target := tmp_path / "m.gguf", family.tokenizer)
    else:
        target = save(hf, tmp_path / "hf", family.tokenizer)
    outs = {}
    for engine in ("eager", "native"):
        for proposer in ("none", "ngram"):
            res = run("generate", CORPUS[:120], "--target", str(target), "--engine", engine, "--proposer", proposer,
                      "-n", str(NEW), "--json")  # fmt: skip
            assert res.exit_code == 0, (res.stderr, res.exception)
            out = json.loads(res.stdout)
            assert out["stats"]["backend"].startswith(engine), out["stats"]
            outs[engine, proposer] = out["tokens"]
    assert len(set(map(tuple, outs.values()))) == 1 and len(outs["eager", "none"]) == NEW, outs


def test_exports_write_them_back(qwen: tuple[str, Any], family: Family, tmp_path: Path) -> None:
    """A smallem checkpoint of a Qwen model exported to HF (transformers reads it as that model) and to GGUF."""
    pytest.importorskip("gguf")
    kind, hf = qwen
    tok = family.tokenizer
    m, _ = load_hf(save(hf, tmp_path / "src", tok))
    m.materialize()
    ckpt = tmp_path / "m.safetensors"
    checkpoint.save(ckpt, m, tokenizer=checkpoint.tokenizer_fingerprint(tok), dtype=torch.float32)
    assert checkpoint.load_model(ckpt)[0].cfg == m.cfg
    export_hf(ckpt, tmp_path / "hf", tok)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == kind
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(back).__name__ == f"{KINDS[kind]}ForCausalLM"
    x = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(hf_logits(back, x), hf_logits(hf, x), atol=1e-5, rtol=0)
    write_gguf(m, tmp_path / "m.gguf", tok)
    g = load_gguf(tmp_path / "m.gguf").model.materialize()
    with torch.no_grad():
        same_logits(g.logits(g.hidden(x[None]))[0], hf_logits(hf, x))


def test_old_checkpoint_configs_load_unchanged() -> None:
    old = json.loads(ModelConfig().to_json())
    for name in ("attn_bias", "qk_norm"):
        old.pop(name)  # a checkpoint saved before the fields
    cfg = ModelConfig.from_json(json.dumps(old))
    assert not cfg.attn_bias and not cfg.qk_norm and "layers.0.q_proj.bias" not in checkpoint.expected_shapes(cfg)


@pytest.mark.parametrize(
    ("kind", "change", "named"),
    [
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window=True"),
        ("qwen3", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types="),
        ("qwen3", {"head_dim": 32}, "k_norm.weight has shape (16,), not (32,)"),  # config and weights disagree
        ("qwen3", {"head_dim": None}, "not (128,)"),  # Qwen3's default, not hidden / heads
        ("qwen3", {"attention_bias": True}, "attention_bias=True"),
        ("qwen2", {"model_type": "mixtral"}, "mixture-of-experts layers"),
        ("qwen2", {"architectures": ["Qwen3ForCausalLM"]}, "a qwen2 model is a Qwen2ForCausalLM"),
    ],
)
def test_refusals_in_one_line(family: Family, tmp_path: Path, kind: str, change: dict[str, Any], named: str) -> None:
    folder = save(hf_model(kind), tmp_path / "hf", family.tokenizer)
    raw = {k: v for k, v in (json.loads((folder / "config.json").read_text()) | change).items() if v is not None}
    (folder / "config.json").write_text(json.dumps(raw))
    res = run("generate", "hi", "--target", str(folder), "-n", "2")
    assert res.exit_code == 2 and res.stderr.count("\n") == 1 and named in res.stderr, res.stderr
    if "shape" not in named and "not (" not in named:  # the config alone is refused
        with pytest.raises(HFFormatError, match=named.replace("[", r"\[")):
            config_from_hf(raw)
