"""GGUF in: `--target FILE.gguf` (architecture llama) runs what the file holds, exactly.

Every file here is written by the test itself: the tiny on-disk family (conftest) exported with our
own `export_gguf`, or written with the `gguf` package's writer from the same tensors (quantized with
`gguf.quants.quantize`, or with one thing changed that must be refused). Needs the `llamacpp` extra's
`gguf` package: without it the tests skip, saying so, except the one that checks the refusal.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import Family
from engine_help import sequence_pass
from test_kquants import quant_close
from test_native import one_sequence
from typer.testing import CliRunner

from smallem_cli.backends.engines import Backend
from smallem_cli.cli.app import app
from smallem_cli.engine import family as F
from smallem_cli.engine.family import NONE
from smallem_cli.engine.generate import generate
from smallem_cli.interop.gguf import (
    GGUFReadError,
    add_llama_metadata,
    export_gguf,
    gguf_name,
    gguf_tensors,
    gguf_vocab,
    load_gguf,
)
from smallem_cli.model import checkpoint
from smallem_cli.model.chat import messages, render
from smallem_cli.model.tokenizer import load_tokenizer
from smallem_cli.model.weights import permute_rope

EXTRA = "pip install 'smallem[gguf]'"
CPU = torch.device("cpu")
PROMPTS = ([5, 17, 42, 9, 1, 33, 60], list(range(3, 40)), [0, 250, 7])
TEXTS = ("And God said, Let there be light: and there was light.", "  12345 ,; é 😀\n\tend", "<|endoftext|>x")
no_native = shutil.which("g++") is None or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512")


def need() -> Any:
    return pytest.importorskip("gguf", reason=f"gguf is not installed (the llamacpp extra: {EXTRA})")


def write(
    path: Path,
    family: Family,
    *,
    quant: str | None = None,
    arch: str = "llama",
    pre: str = "gpt-2",
    kv: Callable[[Any], None] | None = None,
    edit: Callable[[dict[str, np.ndarray]], None] | None = None,
    vocab: Callable[[list[str], list[str]], None] | None = None,
) -> dict[str, np.ndarray]:
    """The family's target as a GGUF file written with gguf's own writer: matrices as `quant` (a
    GGMLQuantizationType name; None: f32), `kv` adding metadata, `edit` changing the tensors first,
    `vocab` the tokens and merges.
    Returns what was written, by llama.cpp name (quantized matrices as their raw blocks)."""
    gguf = need()
    model, _ = checkpoint.load_model(family.target)
    cfg = model.cfg
    arrays = gguf_tensors(model, "f32")
    if edit:
        edit(arrays)
    tokens, kinds, merges, eot = gguf_vocab(family.tokenizer, cfg.vocab_size)
    if vocab:
        vocab(tokens, merges)
    w = gguf.GGUFWriter(str(path), arch)
    add_llama_metadata(w, cfg, (tokens, kinds, merges, eot), pre)
    if kv:
        kv(w)
    written = {}
    for name, arr in arrays.items():
        if quant and arr.ndim == 2:
            qtype = gguf.GGMLQuantizationType[quant]
            arr = gguf.quants.quantize(arr, qtype)
            w.add_tensor(name, arr, raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)
        written[name] = arr
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def exported(family: Family, tmp_path: Path, dtype: str = "f32") -> Path:
    need()
    out = tmp_path / f"target-{dtype}.gguf"
    export_gguf(family.target, out, family.tokenizer, dtype=dtype)
    return out


def run(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def refused(res: Any, *words: str) -> None:
    """One `error:` line on stderr, exit 2, naming `words`; no traceback."""
    assert res.exit_code == 2, (res.output, res.exception)
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error:"), res.stderr
    assert all(w in res.stderr for w in words), res.stderr


# --- the model ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_exported_file_loads_back_exactly(family: Family, tmp_path: Path, dtype: str) -> None:
    """Our export read back: every parameter equal to the checkpoint's (its values are float16
    already, so f16 loses nothing), the same logits to the bit, the same greedy tokens."""
    path = exported(family, tmp_path, dtype)
    got = F.load_target(path, CPU)
    got.model.materialize()
    ref = F.load_target(family.target, CPU)
    ref.model.materialize()
    assert got.tokenizer is None and got.gguf == (("F16", "F32") if dtype == "f16" else ("F32",))
    assert got.model.cfg == dataclasses.replace(ref.model.cfg, mtp=False) and got.model.cfg.tie_embeddings
    a, b = got.model.state_dict(), ref.model.state_dict()
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    x = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        assert torch.equal(got.model.logits(got.model.hidden(x)), ref.model.logits(ref.model.hidden(x)))
    for p in PROMPTS:
        assert generate(got.model, NONE, p, 40, 0)[0] == generate(ref.model, NONE, p, 40, 0)[0], p


def test_untied_head_and_rope_permutation_undone(family: Family, tmp_path: Path) -> None:
    """An `output.weight` makes the head untied and is read as such; Wq and Wk come back in the
    rotate-half layout (the file holds llama.cpp's adjacent pairs)."""
    model, _ = checkpoint.load_model(family.target)
    head = np.random.default_rng(0).standard_normal((model.cfg.vocab_size, model.cfg.dim)).astype(np.float32)
    written = write(tmp_path / "u.gguf", family, edit=lambda t: t.__setitem__("output.weight", head))
    got = load_gguf(tmp_path / "u.gguf").model.materialize()
    assert not got.cfg.tie_embeddings and torch.equal(got.lm_head.weight, torch.from_numpy(head))
    q, k = got.layers[0].q_proj.weight, got.layers[0].k_proj.weight
    assert torch.equal(q, model.layers[0].q_proj.weight) and torch.equal(k, model.layers[0].k_proj.weight)
    assert not torch.equal(torch.from_numpy(written["blk.0.attn_q.weight"]), q)  # the file's order differs
    assert torch.equal(permute_rope(q, got.cfg.n_heads), torch.from_numpy(written["blk.0.attn_q.weight"]))


@pytest.mark.parametrize("quant", ["BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_quantized_file_loads_to_gguf_dequantized_values(family: Family, tmp_path: Path, quant: str) -> None:
    """Each parameter is exactly gguf's own dequantization of the file's blocks (Wq, Wk un-permuted),
    and, quantized, differs from the float32 original: the comparison sees the values."""
    gguf = need()
    written = write(tmp_path / "q.gguf", family, quant=quant)
    got = load_gguf(tmp_path / "q.gguf")
    got.model.materialize()
    assert got.types == tuple(sorted({quant, "F32"}))
    model, _ = checkpoint.load_model(family.target)
    cfg, ours, orig = model.cfg, got.model.state_dict(), model.state_dict()
    qtype = gguf.GGMLQuantizationType[quant]
    for key, v in ours.items():
        raw = written[gguf_name(key)]
        want = torch.from_numpy(gguf.quants.dequantize(raw, qtype).copy()) if v.dim() == 2 else torch.from_numpy(raw)
        if key.endswith(("q_proj.weight", "k_proj.weight")):
            v = permute_rope(v, cfg.n_heads if key.endswith("q_proj.weight") else cfg.n_kv_heads)
        assert v.dtype == torch.float32 and torch.equal(v, want), key
    if quant != "BF16":  # the family's float16 weights lose bits in 8 or 4; bf16 may hold some exactly
        assert not torch.equal(ours["layers.0.up_proj.weight"], orig["layers.0.up_proj.weight"])


# --- the tokenizer and the chat format ----------------------------------------------------------
def test_tokenizer_round_trips(family: Family, tmp_path: Path) -> None:
    """The tokenizer rebuilt from the metadata encodes and decodes as tokenizer.json does, and has its
    vocabulary (so its fingerprint is the family's: the family's drafts are accepted as proposers)."""
    got = F.load_target(exported(family, tmp_path), CPU)
    got.model.materialize()
    ref = load_tokenizer(family.tokenizer)
    corpus = (family.dir / "corpus.txt").read_text(encoding="utf-8")
    for text in (*TEXTS, corpus):
        ids = ref.encode(text).ids
        assert got.tok.encode(text).ids == ids and got.tok.decode(ids) == ref.decode(ids), text[:40]
    assert got.tok.get_vocab(with_added_tokens=True) == ref.get_vocab(with_added_tokens=True)
    assert got.fingerprint == family.fingerprint
    assert F.load_proposer(str(family.draft), got, CPU).name == "draft-2l"


def test_pre_tokenizers(family: Family, tmp_path: Path) -> None:
    """smollm and qwen2 split digits one by one before the byte-level split; gpt2 does not; another is refused."""

    def twelve(tokens: list[str], merges: list[str]) -> None:  # a merge of two digits, as real vocabularies have
        used = {part for m in merges for part in m.split(" ")}
        j = next(j for j, m in enumerate(merges) if m.replace(" ", "") not in used)  # a merge nothing builds on
        tokens[tokens.index(merges[j].replace(" ", ""))], merges[j] = "12", "1 2"

    write(tmp_path / "s.gguf", family, pre="smollm", vocab=twelve)
    write(tmp_path / "g.gguf", family, pre="gpt2", vocab=twelve)
    smol, plain = load_gguf(tmp_path / "s.gguf").tokenizer, load_gguf(tmp_path / "g.gguf").tokenizer
    assert smol.encode("year 1234").tokens[-4:] == ["1", "2", "3", "4"]
    assert plain.encode("year 1234").tokens[-3:] == ["12", "3", "4"]
    write(tmp_path / "q.gguf", family, pre="qwen2", vocab=twelve)  # Qwen's split: digits one by one too
    assert load_gguf(tmp_path / "q.gguf").tokenizer.encode("year 1234").tokens[-4:] == ["1", "2", "3", "4"]
    write(tmp_path / "l.gguf", family, pre="llama-bpe", vocab=twelve)
    with pytest.raises(GGUFReadError, match=r"tokenizer\.ggml\.pre 'llama-bpe'"):
        load_gguf(tmp_path / "l.gguf")


def test_end_ids_template_and_bos_from_metadata(family: Family, tmp_path: Path) -> None:
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"

    def kv(w: Any) -> None:
        w.add_eot_token_id(7)
        w.add_eom_token_id(9)
        w.add_chat_template(template)
        w.add_add_bos_token(True)

    write(tmp_path / "c.gguf", family, kv=kv)
    tgt = F.load_target(tmp_path / "c.gguf", CPU)
    tgt.model.materialize()
    tokens = json.loads(family.tokenizer.read_text(encoding="utf-8"))["model"]["vocab"]
    assert tgt.chat.end_ids == (0, 7, 9) and tgt.chat.template == template
    assert tgt.chat.bos == tgt.chat.eos == "<|endoftext|>"
    assert render(tgt.chat, messages("hi")) == "<|endoftext|>[user] hi<|endoftext|>"
    assert tgt.tok.encode("In").ids == [0, tokens["In"]]  # add_bos_token: llama.cpp puts BOS first
    plain = load_gguf(exported(family, tmp_path)).chat  # our export: <|endoftext|> ends, no template
    assert plain.end_ids == (0,) and plain.template is None


# --- the commands -------------------------------------------------------------------------------
def test_generate_batch_eval_take_a_gguf_target(family: Family, tmp_path: Path) -> None:
    """`generate`, `batch` and `eval` run a GGUF target; its tokens are the checkpoint's."""
    path = exported(family, tmp_path)
    args = ["In the beginning", "-n", "20", "--json"]
    got = run("generate", *args, "--target", str(path))
    ref = run("generate", *args, "--target", str(family.target), "--proposer", "none")
    assert got.exit_code == 0 and ref.exit_code == 0, (got.output, got.exception)
    assert json.loads(got.stdout)["tokens"] == json.loads(ref.stdout)["tokens"]
    assert json.loads(got.stdout)["stats"]["proposer"] == "none"  # no shipped proposer beside a GGUF file
    spec = run("generate", *args, "--target", str(path), "--proposer", str(family.draft), "-k", "3")
    assert spec.exit_code == 0 and json.loads(spec.stdout)["tokens"] == json.loads(ref.stdout)["tokens"]
    res = CliRunner().invoke(app, ["batch", "--target", str(path), "-n", "8"], input="In the\nAnd God\n")
    assert res.exit_code == 0, (res.output, res.exception)
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(lines) == 2 and all("tokens" in line for line in lines)
    data = tmp_path / "data"
    data.mkdir()
    (data / "val.txt").write_text((family.dir / "corpus.txt").read_text(encoding="utf-8"), encoding="utf-8")
    ev = run("eval", "--target", str(path), "--data", str(data), "--json")
    assert not (data / "val.bin").exists()  # nothing cached for a tokenizer that has no file
    ev_ref = run("eval", "--target", str(family.target), "--data", str(data), "--json", "--draft", str(family.draft))
    assert ev.exit_code == 0 and ev_ref.exit_code == 0, (ev.output, ev.exception)
    loss = {m["name"]: m for m in json.loads(ev_ref.stdout)["models"]}["target"]
    assert json.loads(ev.stdout)["models"][0] | {"training": {}} == loss | {"training": {}}


def test_a_gguf_draft_proposes_for_a_gguf_target(family: Family, tmp_path: Path) -> None:
    """llama.cpp's `-md`: a draft model as a GGUF file of the target's vocabulary (draft-2l, and a Q8_0 copy of the
    target) proposes; the greedy tokens are the target's alone, on both engines. Another vocabulary is refused."""
    target = exported(family, tmp_path)
    draft, copy = tmp_path / "draft.gguf", tmp_path / "q8.gguf"
    export_gguf(family.draft, draft, family.tokenizer)
    write(copy, family, quant="Q8_0")
    args = ["In the beginning", "-n", "24", "--json", "--target", str(target)]
    alone = run("generate", *args)
    assert alone.exit_code == 0, (alone.output, alone.exception)
    for engine in ("eager", "native"):
        for d in (draft, copy):
            spec = run("generate", *args, "--proposer", str(d), "-k", "3", "--engine", engine)
            assert spec.exit_code == 0, (spec.output, spec.exception)
            got = json.loads(spec.stdout)
            assert got["tokens"] == json.loads(alone.stdout)["tokens"] and got["stats"]["acceptance_rate"] > 0
    smol = Path(__file__).parents[1] / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if smol.is_file():  # `make smollm2`: a real model of another vocabulary
        refused(run("generate", *args, "--proposer", str(smol)), "does not share the target's tokenizer")


@pytest.mark.skipif(no_native, reason="the native engine needs g++ and an AVX2 CPU")
def test_backend_is_named_honestly(family: Family, tmp_path: Path) -> None:
    """An f16 file runs native on its float16 weights; a Q8_0 one on its dequantized values, which
    only float32 holds, and the run says so, beside a float16 draft too."""
    f16 = exported(family, tmp_path, "f16")
    q8 = tmp_path / "q8.gguf"
    write(q8, family, quant="Q8_0")
    args = ["In the beginning", "-n", "12", "--json", "--engine", "native"]

    def backend(*extra: str) -> str:
        res = run("generate", *args, *extra)
        assert res.exit_code == 0, (res.output, res.exception)
        return json.loads(res.stdout)["stats"]["backend"]

    assert backend("--target", str(f16)) == "native"
    assert backend("--target", str(q8)) == "native (q8_0)"  # the embedding too: its rows dequantized as read
    assert backend("--target", str(q8), "--proposer", str(family.draft)) == "native (f16+q8_0)"


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0", "Q4_1"])
def test_native_reads_the_blocks_as_stored(family: Family, tmp_path: Path, quant: str) -> None:
    """A quantized file's matrices run native as its blocks (`model.quant`), not as float32: the
    pass over T tokens, one sequence's step and the flat batch's, is the eager pass over the
    dequantized values to the int16 rounding of each product's inputs (`test_kquants.quant_close`),
    with more rows than a tile of blocks holds (12)."""
    write(tmp_path / "q.gguf", family, quant=quant)
    model = load_gguf(tmp_path / "q.gguf").model.materialize().pack()
    backend = Backend("native")
    assert backend.prepare(model, []) == f"native ({quant.lower()})"  # the embedding's rows too
    steps = backend.steps(model)
    assert steps is not None
    L = model.cfg.n_layers  # products deep: the logits 4 L + 1, the hidden states 4 L, the last layer's K/V 4 L - 3
    tokens = torch.randint(0, model.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    for T in (1, 5, 16):
        past, new = tokens[:20], tokens[20 : 20 + T]
        a, c = one_sequence(model, past, new), one_sequence(model, past, new, steps)
        assert all(quant_close(x, y, n) for x, y, n in zip(a, c, (4 * L + 1, 4 * L, 4 * L - 3), strict=True)), T
        flat_a, flat_c = sequence_pass(model, past, new), sequence_pass(model, past, new, steps)
        assert quant_close(flat_a[0], flat_c[0], 4 * L + 1) and quant_close(flat_a[1], flat_c[1], 4 * L)


# --- refusals -----------------------------------------------------------------------------------
def _truncated(path: Path, at: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * at)])


@pytest.mark.parametrize("at", [0.0, 0.001, 0.05, 0.5, 0.999])
def test_truncated_file_is_refused(family: Family, tmp_path: Path, at: float) -> None:
    path = exported(family, tmp_path)
    _truncated(path, at)
    refused(run("generate", "hi", "--target", str(path)), str(path))


def test_counts_past_the_end_are_refused_at_once(tmp_path: Path) -> None:
    """A header whose counts or lengths exceed the file is refused before gguf's reader trusts them
    (it would loop over a count of 2^40 items, or read past the file)."""
    need()
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a"
    cases = {
        "array": head + struct.pack("<IIQ", 9, 0, 1 << 40) + bytes(16),  # 2^40 uint8 in a 16-byte tail
        "strings": head + struct.pack("<IIQ", 9, 8, 1 << 40) + bytes(16),
        "entries": b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 40),
        "key": b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1 << 50),
        "dims": b"GGUF" + struct.pack("<IQQQ", 3, 1, 0, 1) + b"t" + struct.pack("<I", 1 << 30) + bytes(64),
    }
    for name, data in cases.items():
        (tmp_path / f"{name}.gguf").write_bytes(data)
        refused(run("generate", "hi", "--target", str(tmp_path / f"{name}.gguf")), "truncated or corrupt")


def test_refusals_one_line_each(family: Family, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = need()
    good = exported(family, tmp_path)

    def gen(path: Path, *extra: str) -> Any:
        return run("generate", "hi", "--target", str(path), *extra)

    magic = tmp_path / "magic.gguf"
    magic.write_bytes(b"GGUX" + good.read_bytes()[4:])
    refused(gen(magic), "not a GGUF file")
    write(tmp_path / "phi.gguf", family, arch="phi3")
    refused(gen(tmp_path / "phi.gguf"), "architecture 'phi3'")

    def scaled(w: Any) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)

    write(tmp_path / "rope.gguf", family, kv=scaled)
    refused(gen(tmp_path / "rope.gguf"), "llama.rope.scaling.type='yarn'")
    lie = np.zeros((32, 32), dtype=np.float32)  # Wk is [n_kv_heads * head_dim = 16, 32]
    write(tmp_path / "lie.gguf", family, edit=lambda t: t.__setitem__("blk.1.attn_k.weight", lie))
    refused(gen(tmp_path / "lie.gguf"), "blk.1.attn_k.weight has shape (32, 32)", "(16, 32)")
    write(tmp_path / "gone.gguf", family, edit=lambda t: t.pop("blk.0.ffn_up.weight"))
    refused(gen(tmp_path / "gone.gguf"), "missing ['blk.0.ffn_up.weight']")
    write(tmp_path / "q5.gguf", family, quant="MXFP4")
    refused(gen(tmp_path / "q5.gguf"), "type MXFP4")
    write(tmp_path / "nan.gguf", family, edit=lambda t: t["blk.0.ffn_up.weight"].__setitem__((0, 0), np.nan))
    refused(gen(tmp_path / "nan.gguf"), "NaN")
    refused(gen(good, "--tokenizer", str(family.tokenizer)), "holds its own tokenizer")
    refused(gen(good, "--proposer", "draft-2l"), "GGUF target", "ships none")
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    refused(gen(good), "smallem[gguf]")


def test_a_checkpoint_named_gguf_is_not_misread(family: Family, tmp_path: Path) -> None:
    """Detection is by name or magic: a smallem checkpoint still loads as one (no GGUF magic, other name)."""
    assert F.load_target(family.target, CPU).gguf == () and F.default_proposer(family.target, True) != "none"
    path = exported(family, tmp_path)
    renamed = tmp_path / "model.bin"
    renamed.write_bytes(path.read_bytes())  # the magic alone says GGUF
    assert F.load_target(renamed, CPU).gguf == ("F32",) and F.default_proposer(renamed, True) == "none"
