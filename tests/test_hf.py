"""Hugging Face interchange: smallem must compute exactly what transformers computes.

Tiny random LlamaForCausalLM models (vocab 96, width 32, 2 layers, 4 heads) are built from
configs, saved, and read back with `load_hf`; smallem checkpoints go the other way with
`export_hf`. Everything is offline.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from conftest import Family, kv_close  # noqa: E402
from engine_help import proposer  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from smallem_cli.cli.app import app  # noqa: E402
from smallem_cli.config import PRESETS, ModelConfig  # noqa: E402
from smallem_cli.defaults import default_k  # noqa: E402
from smallem_cli.engine.family import NONE  # noqa: E402
from smallem_cli.engine.forward import slab_for, transformer_pass  # noqa: E402
from smallem_cli.engine.generate import generate  # noqa: E402
from smallem_cli.interop.hf import ExportError, HFFormatError, config_from_hf, export_hf, is_hf_dir, load_hf  # noqa: E402
from smallem_cli.kv.pool import PagePool, pages_for  # noqa: E402
from smallem_cli.kv.step import build, in_order  # noqa: E402
from smallem_cli.model import checkpoint  # noqa: E402
from smallem_cli.model.llama import MTPModule, Transformer  # noqa: E402

VOCAB = 96
EOT = "<|endoftext|>"

# name -> (num_key_value_heads, tie_word_embeddings, rope_theta)
VARIANTS = {
    "gqa-untied-theta5000": (2, False, 5000.0),
    "mha-tied": (4, True, 10000.0),
    "gqa-tied-theta50": (2, True, 50.0),
}


def write_tokenizer(path: Path) -> Path:
    """A WordLevel tokenizer covering the whole vocab: EOT is id 0, then w1 .. w95."""
    vocab = {EOT: 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOT))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([EOT])
    tok.save(str(path))
    return path


def hf_llama(kv_heads: int, tied: bool, theta: float, seed: int = 0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        intermediate_size=64,
        max_position_embeddings=128,
        rope_theta=theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=None,
        eos_token_id=None,  # so generate() never stops early
        pad_token_id=None,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # not all ones, so that a swapped norm would show
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:  # std 0.35: wide enough that greedy decoding does not settle on one repeated token
                p.normal_(0, 0.35)
    return model


def hf_logits(model: transformers.PreTrainedModel, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens[None]).logits[0].float()


class Paged:
    """One sequence's passes through the engine's paged layout (`engine.forward`): its pages are
    reserved one at a time as it grows, each followed by one for a second sequence, so its page
    table is out of order and every pass takes the general paged path (not one range of slots)."""

    def __init__(self, m: Transformer, n_tokens: int, page_size: int = 16) -> None:
        self.m, self.page_size, self.pos = m, page_size, 0
        self.pool = PagePool(2 * pages_for(n_tokens, page_size), page_size)
        self.pool.add(0)
        self.pool.add(1)
        self.slab = slab_for(m, self.pool.n_pages * page_size, torch.device("cpu"))

    def feed(self, new: torch.Tensor, head: str = "all") -> torch.Tensor:
        """The logits of `new` after what was fed before ("last": its last row only)."""
        n = self.pos + new.shape[0]
        while self.pool.need(0, n):
            self.pool.reserve(0, (len(self.pool.tables[0]) + 1) * self.page_size)
            self.pool.reserve(1, (len(self.pool.tables[1]) + 1) * self.page_size)
        b = build([self.pool.tables[0]], [self.pos], [new.shape[0]], self.page_size, new.device)
        self.pos = n
        with torch.inference_mode():
            return transformer_pass(self.m, self.slab, new, b, head)[0]


def incremental_logits(m: Transformer, tokens: torch.Tensor, prefill: int, chunks: tuple[int, ...]) -> torch.Tensor:
    """Logits of every position through the paged cache: a prefill, then the chunk sizes in turn."""
    paged = Paged(m, len(tokens))
    out, pos, i = [], 0, 0
    while pos < len(tokens):
        n = prefill if pos == 0 else chunks[i % len(chunks)]
        i += pos > 0
        out.append(paged.feed(tokens[pos : pos + n]))
        pos += n
    assert in_order(paged.pool.tables[0], len(paged.pool.tables[0])) is None  # the general paged path
    return torch.cat(out)


def smallem_greedy(m: Transformer, prompt: torch.Tensor, n: int) -> list[int]:
    """The plain greedy loop over the paged cache: prefill, then feed back the argmax one token at a time."""
    paged = Paged(m, len(prompt) + n)
    logits = paged.feed(prompt, head="last")
    out: list[int] = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = paged.feed(torch.tensor([out[-1]]))
    return out


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def hf_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tok_path: Path):
    """(HF model, its saved folder with a tokenizer.json)."""
    model = hf_llama(*VARIANTS[request.param])
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_bytes(tok_path.read_bytes())
    return model, folder


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


# --- reading HF folders --------------------------------------------------------------------


def test_load_hf_logits_match_transformers(hf_folder, tok_path: Path) -> None:
    hf, folder = hf_folder
    assert is_hf_dir(folder) and not is_hf_dir(tok_path.parent)
    m, fingerprint = load_hf(folder)
    m.materialize()
    assert fingerprint == checkpoint.tokenizer_fingerprint(tok_path)
    assert m.cfg.tie_embeddings == hf.config.tie_word_embeddings and (m.lm_head is None) == m.cfg.tie_embeddings
    x = tokens(64)
    ref = hf_logits(hf, x)
    with torch.no_grad():
        full = m.logits(m.hidden(x[None]))[0]
    torch.testing.assert_close(full, ref, atol=1e-4, rtol=0)
    m.pack()  # the inference path: fused weights, paged cache, prefill 40 then chunks of 3 and 1
    assert kv_close(incremental_logits(m, x, 40, (3, 1)), ref)  # the cache's float16


def test_greedy_matches_transformers_generate(hf_folder) -> None:
    hf, folder = hf_folder
    m, _ = load_hf(folder)
    m.materialize()
    m.pack()
    prompt = tokens(12, seed=2)
    with torch.no_grad():
        ref = hf.generate(
            prompt[None], attention_mask=torch.ones(1, 12, dtype=torch.long), do_sample=False, max_new_tokens=50
        )
    ref = ref[0, 12:].tolist()
    assert smallem_greedy(m, prompt, 50) == ref
    assert generate(m, NONE, prompt.tolist(), 50, 0)[0] == ref  # the engine's own loop, as `generate` runs it
    assert len(ref) == 50 and len(set(ref)) > 10  # a real test, not one repeated token


def test_sharded_bf16_folder(tmp_path: Path, tok_path: Path) -> None:
    hf = hf_llama(2, False, 5000.0)
    with torch.no_grad():  # the reference: float32 with bf16-rounded weights (a bf16 HF model
        for p in hf.parameters():  # would also round its rotary table, which smallem does not)
            p.copy_(p.to(torch.bfloat16).float())
    copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    (tmp_path / "tokenizer.json").write_bytes(tok_path.read_bytes())
    m, _ = load_hf(tmp_path)
    m.materialize()
    assert all(p.dtype == torch.float32 for p in m.parameters())
    x = tokens(32)
    with torch.no_grad():
        torch.testing.assert_close(m.logits(m.hidden(x[None]))[0], hf_logits(hf, x), atol=1e-4, rtol=0)


def test_v4_style_config_reads_the_same(hf_folder) -> None:
    _, folder = hf_folder
    v5 = json.loads((folder / "config.json").read_text())
    assert "rope_parameters" in v5  # what the installed transformers writes
    v4 = {k: v for k, v in v5.items() if k not in ("rope_parameters", "dtype")}
    v4 |= {"rope_theta": v5["rope_parameters"]["rope_theta"], "rope_scaling": None, "torch_dtype": "float32"}
    assert config_from_hf(v4) == config_from_hf(v5)
    v4.pop("num_key_value_heads")  # absent means multi-head attention
    assert config_from_hf(v4).n_kv_heads == 4


def test_folder_problems_are_named(tmp_path: Path, tok_path: Path) -> None:
    hf_llama(2, False, 5000.0).save_pretrained(tmp_path)
    with pytest.raises(HFFormatError, match=r"tokenizer\.json"):
        load_hf(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes(tok_path.read_bytes())
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    weights["model.layers.0.rotary_emb.inv_freq"] = torch.zeros(4)  # old transformers' buffer: ignored
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFFormatError, match=r"up_proj\.weight.*q_proj\.bias"):
        load_hf(tmp_path)
    del weights["model.layers.0.self_attn.q_proj.bias"]
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(32, 64)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        HFFormatError, match=r"model\.layers\.1\.mlp\.up_proj\.weight has shape \(32, 64\), not \(64, 32\)"
    ):
        load_hf(tmp_path)
    with pytest.raises(HFFormatError, match=r"config\.json"):
        load_hf(tmp_path.parent)


def _edit(cfg: dict, change: dict) -> dict:
    out = copy.deepcopy(cfg)
    for k, v in change.items():
        if v is KeyError:
            out.pop(k)
        else:
            out[k] = v
    return out


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"rope_scaling": {"type": "yarn", "factor": 2.0}}, "rope type 'yarn'"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "low_freq_factor"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "rope_theta": 1e4}, "rope_parameters"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"model_type": "mistral"}, "model_type='mistral'"),
        ({"architectures": ["MistralForCausalLM"]}, "architectures"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
        ({"hidden_size": KeyError}, "required field hidden_size"),
        ({"vocab_size": KeyError}, "required field vocab_size"),
        ({"model_type": KeyError}, "required field model_type"),
    ],
)
def test_unsupported_config_fields_are_named(change: dict, named: str) -> None:
    base = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    ).to_dict()
    config_from_hf(base)  # the unedited config is fine
    with pytest.raises(HFFormatError, match=named.replace("(", r"\(").replace("[", r"\[")):
        config_from_hf(_edit(base, change))


def test_refused_config_in_a_folder(tmp_path: Path, tok_path: Path) -> None:
    hf_llama(2, False, 5000.0).save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes(tok_path.read_bytes())
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"rope_scaling": {"type": "dynamic", "factor": 2.0}}))
    with pytest.raises(HFFormatError, match=r"rope_scaling=\{'type': 'dynamic'"):
        load_hf(tmp_path)


# --- writing HF folders --------------------------------------------------------------------


def smallem_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    m = Transformer(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(
                1 + 0.3 * torch.randn(p.shape, generator=g)
                if "norm" in name
                else 0.2 * torch.randn(p.shape, generator=g)
            )
    return m.eval()


@pytest.mark.parametrize(("tied", "dtype"), [(False, torch.float32), (True, torch.float16)])
def test_export_loads_in_transformers(tmp_path: Path, tok_path: Path, tied: bool, dtype: torch.dtype) -> None:
    cfg = ModelConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=128,
        rope_theta=500.0, tie_embeddings=tied,
    )  # fmt: skip
    ckpt = tmp_path / "model.safetensors"
    checkpoint.save(ckpt, smallem_model(cfg), tokenizer=checkpoint.tokenizer_fingerprint(tok_path), dtype=dtype)
    ours, _ = checkpoint.load_model(ckpt)  # float32, rounded to the stored dtype
    out = tmp_path / "hf"
    export_hf(ckpt, out, tok_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "model.safetensors"]  # no temp folder left
    hf_cfg = json.loads((out / "config.json").read_text())
    assert hf_cfg["tie_word_embeddings"] is tied and hf_cfg["torch_dtype"] == str(dtype).removeprefix("torch.")
    assert hf_cfg["eos_token_id"] == hf_cfg["bos_token_id"] == 0
    assert ("lm_head.weight" in load_file(out / "model.safetensors")) is not tied

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = tokens(64)
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(hf, x), ours.logits(ours.hidden(x[None]))[0], atol=1e-4, rtol=0)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == EOT and tok.eos_token_id == 0
    assert tok("w5 w17 w95")["input_ids"] == [5, 17, 95]

    with pytest.raises(FileExistsError):
        export_hf(ckpt, out, tok_path)
    export_hf(ckpt, out, tok_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "model.safetensors"]


def test_export_round_trip_is_exact(tmp_path: Path, tok_path: Path) -> None:
    cfg = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=4, hidden_dim=64, max_seq_len=128)
    ckpt = tmp_path / "m.safetensors"
    checkpoint.save(ckpt, smallem_model(cfg, seed=3), dtype=torch.float32)
    ours, _ = checkpoint.load_model(ckpt)
    export_hf(ckpt, tmp_path / "hf", tok_path)
    back, fingerprint = load_hf(tmp_path / "hf")
    back.materialize()
    assert back.cfg == cfg and fingerprint == checkpoint.tokenizer_fingerprint(tok_path)
    x = tokens(64)
    with torch.no_grad():
        assert torch.equal(back.logits(back.hidden(x[None])), ours.logits(ours.hidden(x[None])))


def test_export_refusals(tmp_path: Path, tok_path: Path) -> None:
    mtp_ckpt = tmp_path / "mtp.safetensors"
    checkpoint.save(mtp_ckpt, MTPModule(PRESETS["tiny"]))
    with pytest.raises(ExportError, match="MTP"):
        export_hf(mtp_ckpt, tmp_path / "out", tok_path)
    ckpt = tmp_path / "m.safetensors"
    checkpoint.save(
        ckpt,
        Transformer(ModelConfig(vocab_size=VOCAB, dim=32, n_layers=1, n_heads=4, hidden_dim=64)),
        tokenizer="0" * 16,
    )
    with pytest.raises(ExportError, match="another tokenizer"):
        export_hf(ckpt, tmp_path / "out", tok_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "mtp.safetensors"]


def test_interrupted_export_leaves_the_old_folder(tmp_path: Path, tok_path: Path, monkeypatch) -> None:
    cfg = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=1, n_heads=4, hidden_dim=64)
    ckpt = tmp_path / "m.safetensors"
    checkpoint.save(ckpt, smallem_model(cfg))
    (tmp_path / "out").mkdir()  # an empty folder is fine to export into
    export_hf(ckpt, tmp_path / "out", tok_path)
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("smallem_cli.interop.hf.shutil.copyfile", crash)  # dies after the weights are written
    with pytest.raises(KeyboardInterrupt):
        export_hf(ckpt, tmp_path / "out", tok_path, overwrite=True)
    with pytest.raises(KeyboardInterrupt):
        export_hf(ckpt, tmp_path / "new", tok_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "out"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    with pytest.raises(FileExistsError):
        export_hf(ckpt, ckpt, tok_path, overwrite=True)  # a file is never replaced by a folder


# --- speculative generation ------------------------------------------------------------------
def test_speculative_generation_matches_transformers_generate(tmp_path: Path, tok_path: Path) -> None:
    """An HF target with two HF drafts of its vocabulary, through smallem's speculative loop (greedy):
    the tokens are transformers' greedy ones, whatever the draft and k."""
    hf = hf_llama(2, False, 5000.0)
    # Draft 1: the target's first layer alone (its embeddings, norm and head): agrees often, not always.
    cut_cfg = copy.deepcopy(hf.config)
    cut_cfg.num_hidden_layers = 1
    cut = transformers.LlamaForCausalLM(cut_cfg).eval()
    cut.load_state_dict({k: v for k, v in hf.state_dict().items() if ".layers.1." not in k})
    # Draft 2: narrower, one layer, multi-head, its own random weights.
    torch.manual_seed(7)
    narrow = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            intermediate_size=32, max_position_embeddings=128, tie_word_embeddings=True,
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )
    ).eval()  # fmt: skip
    folders = {}
    for name, model in (("target", hf), ("cut", cut), ("narrow", narrow)):
        folders[name] = tmp_path / name
        model.save_pretrained(folders[name])
        (folders[name] / "tokenizer.json").write_bytes(tok_path.read_bytes())

    target, fp = load_hf(folders["target"])
    target.materialize()
    target.pack()
    prompt = tokens(12, seed=2)
    with torch.no_grad():
        ref = hf.generate(
            prompt[None], attention_mask=torch.ones(1, 12, dtype=torch.long), do_sample=False, max_new_tokens=50
        )[0, 12:].tolist()
    assert len(ref) == 50 and len(set(ref)) > 10
    rates = {}
    for name in ("cut", "narrow"):
        draft, draft_fp = load_hf(folders[name])
        draft.materialize()
        assert draft_fp == fp and draft.cfg.vocab_size == VOCAB and draft.cfg.n_layers == 1
        draft.pack()
        for k in (1, 3):
            out, stats = generate(target, proposer("draft", model=draft), prompt.tolist(), 50, k)
            assert out == ref, (name, k)
            assert stats.new_tokens == 50 and stats.proposed > 0
            rates[name, k] = stats.acceptance_rate
    assert rates["cut", 1] > 0 and rates["cut", 3] > 0  # the cut draft's guesses are kept sometimes


def test_bench_peer_hf_side_by_side(family: Family, tmp_path: Path) -> None:
    """`smallem bench --peer hf`: transformers runs the same exported weights on the same
    prompts, its greedy text equals ours, and our figures are the bench's own rows."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"tokens": list(range(5 + i, 17 + i)), "text": ""}) for i in range(2)))
    args = ["bench", "--target", str(family.target), "--proposers", "draft-2l", "--prompts", str(prompts)]
    args += ["-n", "12", "--repeats", "1", "--modes", "greedy", "--peer", "hf", "--json"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, (res.stderr, res.exception)
    out = json.loads(res.stdout)
    tps = {(r["proposer"], r["k"]): r["tokens_per_s"] for r in out["rows"]}
    peer = {r["peer"]: r for r in out["peer"]}
    assert list(peer) == ["transformers generate()", "transformers assisted (draft-2l)"]
    assert all(r["identical"] == "2/2" and r["tokens_per_s"] > 0 for r in peer.values())
    assert peer["transformers generate()"]["ours_tokens_per_s"] == tps[("none", 0)]
    ours = tps[("draft-2l", default_k("draft-2l", greedy=True))]
    assert peer["transformers assisted (draft-2l)"]["ours_tokens_per_s"] == ours
