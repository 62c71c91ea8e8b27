"""GGUF export and the llama.cpp peer: llama.cpp must compute what smallem computes.

The tiny on-disk family (conftest) is exported with `smallem export --format gguf` and read
back with the `gguf` package's reader; where llama-cpp-python is installed, llama.cpp runs
the file and its greedy tokens must be ours. Both packages are the optional `llamacpp`
extra: the tests that need one skip without it (saying which), the others run everywhere.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Family
from typer.testing import CliRunner

from smallem_cli.bench import run as bench
from smallem_cli.cli.app import app
from smallem_cli.interop.gguf import gguf_name
from smallem_cli.model import checkpoint
from smallem_cli.model.llama import apply_rope, rope_tables
from smallem_cli.model.weights import interleave_halves, permute_rope

EXTRA = "pip install 'smallem[gguf]'"


def need(module: str) -> Any:
    return pytest.importorskip(module, reason=f"{module} is not installed (the llamacpp extra: {EXTRA})")


def export(family: Family, out: Path, *extra: str) -> object:
    return CliRunner().invoke(app, ["export", str(family.target), str(out), "--format", "gguf", *extra])


def fields(reader: object) -> dict[str, object]:
    return {k: f.contents() for k, f in reader.fields.items()}  # type: ignore[attr-defined]


# --- the permutation of Wq and Wk (no extra needed) --------------------------------------------
def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `permute_rope`: llama.cpp's adjacent pairs -> rotate-half rows."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d, *w.shape[1:])[:, torch.argsort(interleave_halves(d))].reshape(w.shape)


def ggml_rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """llama.cpp's `llama` rope (adjacent pairs x_2i, x_2i+1), written from its definition. x: [T, H, D]."""
    D = x.shape[-1]
    ang = pos[:, None].double() * theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # [T, D/2]
    cos, sin = ang.cos().float()[:, None], ang.sin().float()[:, None]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_rope_permutation_round_trips_and_keeps_attention(heads: int) -> None:
    """permute_rope is a row permutation within each head, undone by unpermute_rope, and
    q·k under llama.cpp's rope with permuted weights equals q·k under smallem's rope."""
    from smallem_cli.config import ModelConfig

    D, dim, T = 8, 16, 6
    g = torch.Generator().manual_seed(0)
    w = torch.randn(heads * D, dim, generator=g)
    p = permute_rope(w, heads)
    assert torch.equal(unpermute_rope(p, heads), w) and not torch.equal(p, w)
    assert sorted(map(tuple, p.tolist())) == sorted(map(tuple, w.tolist()))  # the same rows, reordered
    assert torch.equal(p[:D][1], w[:D][D // 2])  # rows i and i+D/2 of a head: now side by side
    cfg = ModelConfig(vocab_size=8, dim=heads * D, n_heads=heads, n_kv_heads=heads, rope_theta=500.0)
    cos, sin = rope_tables(cfg)
    x = torch.randn(T, dim, generator=g)
    ours = apply_rope((x @ w.t()).view(1, T, heads, D), cos[:T], sin[:T])[0]
    theirs = ggml_rope((x @ p.t()).view(T, heads, D), torch.arange(T), cfg.rope_theta)
    scores = torch.einsum("thd,shd->hts", ours, ours)  # q and k alike: every q·k of the sequence
    assert torch.allclose(torch.einsum("thd,shd->hts", theirs, theirs), scores, atol=1e-4, rtol=1e-5)


def test_gguf_names() -> None:
    assert gguf_name("embed_tokens.weight") == "token_embd.weight"
    assert gguf_name("layers.3.q_proj.weight") == "blk.3.attn_q.weight"
    assert gguf_name("layers.0.post_attention_layernorm.weight") == "blk.0.ffn_norm.weight"
    assert gguf_name("norm.weight") == "output_norm.weight"


# --- the file, read back ---------------------------------------------------------------------
def test_export_gguf_reads_back(family: Family, tmp_path: Path) -> None:
    """Names, shapes, dtypes, values (Wq and Wk permuted), hyperparameters and tokenizer of the file."""
    gguf = need("gguf")
    out = tmp_path / "target.gguf"
    res = export(family, out)
    assert res.exit_code == 0, res.output
    model, _ = checkpoint.load_model(family.target)
    cfg = model.cfg
    r = gguf.GGUFReader(out)
    meta = fields(r)
    assert meta["general.architecture"] == "llama" and meta["general.file_type"] == 0
    want = {
        "llama.vocab_size": cfg.vocab_size,
        "llama.context_length": cfg.max_seq_len,
        "llama.embedding_length": cfg.dim,
        "llama.block_count": cfg.n_layers,
        "llama.feed_forward_length": cfg.hidden_dim,
        "llama.attention.head_count": cfg.n_heads,
        "llama.attention.head_count_kv": cfg.n_kv_heads,
        "llama.rope.dimension_count": cfg.head_dim,
        "llama.rope.freq_base": cfg.rope_theta,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
    }
    assert {k: meta[k] for k in want} == want
    assert meta["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg.norm_eps)
    tok = json.loads(family.tokenizer.read_text(encoding="utf-8"))
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == cfg.vocab_size and tokens[0] == "<|endoftext|>" and types[0] == 3
    assert all(tokens[i] == t and types[i] == 1 for t, i in tok["model"]["vocab"].items() if i)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    assert meta["tokenizer.ggml.merges"] == merges

    tensors = {t.name: t for t in r.tensors}
    state = model.state_dict()
    assert set(tensors) == {gguf_name(k) for k in state} and "output.weight" not in tensors  # tied head
    for key, v in state.items():
        t = tensors[gguf_name(key)]
        assert t.tensor_type.name == "F32" and tuple(t.data.shape) == tuple(v.shape), key
        assert [int(n) for n in t.shape] == list(reversed(v.shape))  # GGUF lists ggml's dims: innermost first
        got = torch.from_numpy(t.data.copy())
        if key.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.n_heads if key.endswith("q_proj.weight") else cfg.n_kv_heads
            assert not torch.equal(got, v) and torch.equal(unpermute_rope(got, heads), v), key
        else:
            assert torch.equal(got, v), key


def test_export_gguf_f16(family: Family, tmp_path: Path) -> None:
    """--dtype f16: matrices in float16, norm weights kept float32 (as llama.cpp wants them)."""
    gguf = need("gguf")
    out = tmp_path / "t16.gguf"
    assert export(family, out, "--dtype", "f16").exit_code == 0
    r = gguf.GGUFReader(out)
    assert fields(r)["general.file_type"] == 1
    model, _ = checkpoint.load_model(family.target)
    for key, v in model.state_dict().items():
        t = next(t for t in r.tensors if t.name == gguf_name(key))
        assert t.tensor_type.name == ("F16" if v.dim() == 2 else "F32"), key
        if key.endswith("v_proj.weight"):
            assert torch.equal(torch.from_numpy(t.data.copy()), v.half())


def test_export_gguf_refusals(family: Family, tmp_path: Path) -> None:
    """An existing file is replaced only with --overwrite; the input never; one error line each."""
    need("gguf")
    out = tmp_path / "m.gguf"
    assert export(family, out).exit_code == 0
    before = out.read_bytes()

    def refused(res: object, words: str) -> None:
        assert res.exit_code == 2, res.output  # type: ignore[attr-defined]
        assert res.stderr.count("\n") == 1 and words in res.stderr, res.stderr  # type: ignore[attr-defined]

    refused(export(family, out, "--dtype", "f16"), "--overwrite")
    assert out.read_bytes() == before
    assert export(family, out, "--dtype", "f16", "--overwrite").exit_code == 0
    assert out.read_bytes() != before
    ckpt = family.target.read_bytes()
    over_input = ["export", str(family.target), str(family.target), "--format", "gguf", "--overwrite"]
    refused(CliRunner().invoke(app, over_input), "input")
    assert family.target.read_bytes() == ckpt
    refused(export(family, tmp_path), "folder")
    refused(export(family, tmp_path / "x.gguf", "--dtype", "bf8"), "dtype")
    refused(CliRunner().invoke(app, ["export", str(family.target), str(tmp_path / "h"), "--dtype", "f16"]), "--dtype")
    refused(CliRunner().invoke(app, ["export", str(family.target), str(tmp_path / "h"), "--format", "onnx"]), "format")
    refused(CliRunner().invoke(app, ["export", str(family.mtp), str(tmp_path / "mtp.gguf"), "--format", "gguf"]), "mtp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # no temporary file left


def test_export_gguf_without_the_package(family: Family, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the gguf package: one line naming the extra, and nothing written."""
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    res = export(family, tmp_path / "m.gguf")
    assert res.exit_code == 2 and res.stderr.count("\n") == 1 and "smallem[gguf]" in res.stderr
    assert list(tmp_path.iterdir()) == []


def test_peer_llamacpp_refused_without_the_extra(family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    timed: list[object] = []
    monkeypatch.setattr(bench, "run_bench", lambda *a, **kw: timed.append(a))
    res = CliRunner().invoke(app, ["bench", "--target", str(family.target), "--peer", "llamacpp"])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1 and "needs llama_cpp" in res.stderr
    bad = CliRunner().invoke(app, ["bench", "--target", str(family.target), "--peer", "sglang"])
    assert bad.exit_code == 2 and "unknown peer" in bad.stderr and timed == []


# --- llama.cpp itself --------------------------------------------------------------------------
def test_llamacpp_greedy_tokens_are_ours(family: Family, tmp_path: Path) -> None:
    """llama.cpp on the f32 file: the tiny target's greedy tokens, token for token."""
    need("gguf")
    need("llama_cpp")
    from smallem_cli.bench.peer import LlamaCpp
    from smallem_cli.engine.family import NONE
    from smallem_cli.engine.generate import generate

    out = tmp_path / "t.gguf"
    assert export(family, out).exit_code == 0
    model, _ = checkpoint.load_model(family.target)
    model.pack()
    peer = LlamaCpp(out, model.cfg.max_seq_len, 1, model.cfg.vocab_size)
    try:
        for prompt in ([5, 17, 42, 9, 1, 33, 60], list(range(3, 40)), [0, 250, 7]):
            ref, _ = generate(model, NONE, prompt, 60, 0)
            assert peer.generate(prompt, 60) == ref, prompt
        costs = peer.pass_seconds([5, 17, 42], [1, 2, 9], reps=3)
        assert set(costs) == {1, 2, 9} and min(costs.values()) > 0
    finally:
        peer.close()


def test_bench_peer_llamacpp(family: Family, tmp_path: Path) -> None:
    """`smallem bench --peer llamacpp`: f32 and f16 rows, f32's tokens identical to ours, pass costs."""
    need("gguf")
    need("llama_cpp")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"tokens": list(range(5 + i, 17 + i)), "text": ""}) for i in range(2)))
    args = ["bench", "--target", str(family.target), "--proposers", "draft-2l", "--prompts", str(prompts)]
    args += ["-n", "12", "--repeats", "1", "--modes", "greedy", "--engines", "eager", "--peer", "llamacpp"]
    res = CliRunner().invoke(app, [*args, "--json"])
    assert res.exit_code == 0, (res.stderr, res.exception)
    peer = {r["peer"].split(" (")[0]: r for r in json.loads(res.stdout)["peer"]}
    assert list(peer) == ["llama.cpp f32", "llama.cpp f16"]
    assert peer["llama.cpp f32"]["identical"] == "2/2" and peer["llama.cpp f32"]["ours_identical"] == "2/2"
    for r in peer.values():
        assert r["tokens_per_s"] > 0 and r["ours_tokens_per_s"] > 0 and r["one_pass_ms"] > 0
        assert set(r["pass_cost"]) == set(r["ours_pass_cost"]) == {"2", "3", "5", "9"}
    table = CliRunner().invoke(app, args)
    assert table.exit_code == 0 and "llama.cpp f32" in table.stdout and "one-token pass ms" in table.stdout


@pytest.mark.parametrize("quant", [None, "Q8_0"])
def test_bench_peer_llamacpp_runs_a_gguf_target_itself(family: Family, tmp_path: Path, quant: str | None) -> None:
    """A GGUF target is benched against llama.cpp on the file itself (a row named by its tensor types),
    then on its values stored anew as f32 and f16; on float32 values llama.cpp's tokens are ours."""
    need("gguf")
    need("llama_cpp")
    from test_gguf_load import write as write_file

    path = tmp_path / "t.gguf"
    write_file(path, family, quant=quant)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"tokens": list(range(5 + i, 17 + i)), "text": ""}) for i in range(2)))
    args = ["bench", "--target", str(path), "--proposers", "ngram", "--prompts", str(prompts), "-n", "12"]
    args += ["--repeats", "1", "--modes", "greedy", "--engines", "eager", "--peer", "llamacpp", "--json"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, (res.stderr, res.exception)
    peer = {r["peer"].split(" (")[0]: r for r in json.loads(res.stdout)["peer"]}
    own = "llama.cpp F32" if quant is None else "llama.cpp F32/Q8_0"
    assert list(peer) == [own, "llama.cpp f32", "llama.cpp f16"]  # the file, then its values stored anew
    assert all(r["tokens_per_s"] > 0 and r["ours_identical"] == "2/2" for r in peer.values())
    assert peer["llama.cpp f32"]["identical"] == "2/2"  # its dequantized values, exactly
    if quant is None:
        assert peer[own]["identical"] == "2/2"
