"""GGUF's 5-bit types and k-quants read as their blocks (`model.quant`): Q5_0, Q5_1, Q4_K, Q5_K, Q6_K.

What is checked: each type's `values` are `gguf.quants.dequantize`'s bit for bit, on random raw blocks (any finite
float16 scales: subnormals, both signs, the largest); `cat` joins rows of different types (a Q4_K_M file's fused
q/k/v mixes Q4_K and Q6_K) to the same values; a K-quant's factored scales are its d and m bit for bit; and a tiny
model written as a GGUF file of such blocks runs native as its blocks, its passes the eager ones to the int16 rounding
of each product's inputs (`quant_close`), a row's logits the same bits whatever the number of rows in the pass and in
either build (the verification pass and a one-token pass agree: speculation's greedy tokens are the target's alone).
The integer products themselves, to the bit: test_qmatmul.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import Family
from engine_help import proposer, sequence_pass
from test_native import no_native, one_sequence

from smallem_cli.backends.engines import Backend
from smallem_cli.config import ModelConfig
from smallem_cli.engine.family import NONE
from smallem_cli.engine.generate import generate
from smallem_cli.interop.gguf import add_llama_metadata, gguf_tensors, gguf_vocab, load_gguf
from smallem_cli.model import quant
from smallem_cli.model.llama import Transformer

NEW = ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
HALVES = {  # where each type's float16 fields lie in a block: d (and m, or dmin)
    "Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
    "Q6_K": (208,),
}  # fmt: skip


def need() -> Any:
    return pytest.importorskip("gguf", reason="gguf is not installed (the llamacpp extra)")


def raw_blocks(kind: str, N: int, K: int, rng: np.random.Generator, sizes: tuple[float, ...] = ()) -> np.ndarray:
    """Random bytes laid out as `kind`'s blocks of a [N, K] matrix, its float16 fields finite: any finite float16,
    or about `sizes` (one a field, in HALVES' order)."""
    size, per = quant.KINDS[kind]
    b = rng.integers(0, 256, (N, K // per, size), dtype=np.uint8)
    for i, at in enumerate(HALVES[kind]):
        if sizes:
            h = (sizes[i] * rng.uniform(0.5, 1.5, (N, K // per))).astype(np.float16)
        else:  # random bits, the exponent's all-ones (infinity, NaN) turned to all-zeros (subnormals)
            bits = rng.integers(0, 1 << 16, (N, K // per), dtype=np.uint16)
            h = np.where(bits & 0x7C00 == 0x7C00, bits & ~np.uint16(0x7C00), bits).view(np.float16)
        b[..., at : at + 2] = h[..., None].view(np.uint8)
    return b.reshape(N, -1)


def dequantized(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> torch.Tensor:
    gguf = need()
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(shape).copy())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.float32 and torch.equal(a.view(torch.int32), b.view(torch.int32))


# --- the blocks -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", [*NEW, "Q8_0", "Q4_0", "Q4_1"])
def test_values_are_ggufs_dequantization(kind: str) -> None:
    rng = np.random.default_rng(sorted(quant.KINDS).index(kind))
    raw = raw_blocks(kind, 6, 512, rng)
    b = quant.from_gguf(raw, kind, (6, 512))
    assert same_bits(b.values(), dequantized(raw, kind, (6, 512)))
    assert b.q.dtype == torch.int8 and b.kinds == {kind}
    assert b.block == (16 if kind == "Q6_K" else 32) and b.d.shape == (6, 512 // b.block)
    assert (b.m is not None) == (kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"))
    assert 0 <= int(b.q.min()) + quant.BIAS[kind] and int(b.q.max()) + quant.BIAS[kind] < (
        16 if kind in quant.NIBBLES else 256
    )
    f = b.factors  # a K-quant's scales as the file factors them: the same float32 values
    assert (f is not None) == kind.endswith("_K")
    if f is not None:
        per = quant.SUPER // b.block
        assert same_bits(f.d.float().repeat_interleave(per, dim=1) * f.sc.float(), b.d.float())
        if b.m is not None:
            assert f.dmin is not None and f.mn is not None
            assert same_bits(f.dmin.float().repeat_interleave(per, dim=1) * f.mn.float(), b.m.float())
    # the file's own float16 stays so; a k-quant's d * scale needs float32 (random ones are not float16's)
    assert b.d.dtype == (torch.float32 if kind.endswith("_K") else torch.float16)
    moved = b.rows(lambda r: r.flip(0))
    assert moved.block == b.block and same_bits(moved.values(), b.values().flip(0))


def test_kquant_scales_that_float16_holds_stay_float16() -> None:
    """d * scale exact in float16 (d = 1, dmin = 0.25: integers and quarters up to 63): kept in half the bytes."""
    raw = raw_blocks("Q4_K", 4, 256, np.random.default_rng(0))
    raw.reshape(4, 1, 144)[..., 0:4] = np.array([1.0, 0.25], dtype=np.float16).view(np.uint8)
    b = quant.from_gguf(raw, "Q4_K", (4, 256))
    assert b.d.dtype == torch.float16 and b.m is not None and b.m.dtype == torch.float16
    assert same_bits(b.values(), dequantized(raw, "Q4_K", (4, 256)))


@pytest.mark.parametrize(
    ("kinds", "block", "dtype"),
    [
        (("Q4_K", "Q6_K", "Q4_K"), 16, torch.float32),  # a Q4_K_M file's fused q/k/v
        (("Q8_0", "Q4_1", "Q6_K", "Q5_K"), 16, torch.float32),
        (("Q5_0", "Q5_1", "Q5_K"), 32, torch.float32),
        (("Q8_0", "Q5_1", "Q4_0"), 32, torch.float16),  # float16 types alone stay as they were
    ],
)
def test_rows_of_different_types_join(kinds: tuple[str, ...], block: int, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(len(kinds))
    parts, want = [], []
    for i, kind in enumerate(kinds):
        raw = raw_blocks(kind, 3 + i, 256, rng)
        parts.append(quant.from_gguf(raw, kind, (3 + i, 256)))
        want.append(dequantized(raw, kind, (3 + i, 256)))
    b = quant.cat(parts)
    assert (b.block, b.d.dtype, b.kinds) == (block, dtype, frozenset(kinds))
    assert b.factors is None  # factors only for rows of one K-quant type
    assert b.m is None or b.m.dtype == dtype
    assert same_bits(b.values(), torch.cat(want))


# --- a model of them, native ----------------------------------------------------------------------
CFG = ModelConfig(  # widths multiples of 256 (a k-quant's super-block), the family's tokenizer of 300 tokens
    vocab_size=300, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=512, max_seq_len=128,
    tie_embeddings=False,
)  # fmt: skip
# a type by llama.cpp name (its last part, or the whole name): Q4_K_M's mix, and one of the 5-bit types with the
# older ones, rows of different types and block lengths in each fused matrix
MIXES = {
    # no output.weight: the head is the embedding's blocks, read back as its rows too (`qmatmul.h`'s `q_row`)
    "tied": {
        "attn_q.weight": "Q4_0", "attn_k.weight": "Q4_1", "attn_v.weight": "Q8_0", "attn_output.weight": "Q6_K",
        "ffn_gate.weight": "Q5_K", "ffn_up.weight": "Q5_1", "ffn_down.weight": "Q5_0", "token_embd.weight": "Q4_K",
    },
    "q4_k_m": {
        "attn_q.weight": "Q4_K", "attn_k.weight": "Q4_K", "attn_v.weight": "Q6_K", "attn_output.weight": "Q4_K",
        "ffn_gate.weight": "Q4_K", "ffn_up.weight": "Q4_K", "ffn_down.weight": "Q6_K", "output.weight": "Q6_K",
        "token_embd.weight": "Q4_K", "blk.1.ffn_down.weight": "Q5_K",
    },
    "five_bits": {
        "attn_q.weight": "Q5_0", "attn_k.weight": "Q5_1", "attn_v.weight": "Q5_K", "attn_output.weight": "Q5_K",
        "ffn_gate.weight": "Q5_1", "ffn_up.weight": "Q5_0", "ffn_down.weight": "Q5_K", "output.weight": "Q8_0",
        "token_embd.weight": "Q5_0", "blk.1.ffn_gate.weight": "Q4_1", "blk.1.ffn_up.weight": "Q6_K",
    },
}  # fmt: skip
STD = 0.1  # about the weights' spread
# Each quantized product's inputs are rounded to int16 a block of 32 (`qmatmul.h`): an error uniform within +-sx/2,
# sx = max|x| / 32639, so an rms error of max|x| / (32639 sqrt 12); for normal-like inputs max|x| is about 2.37 times
# their rms (the mean largest of 32 normal magnitudes), so each product's output is off by about DELTA of its rms. A
# pass's outputs lie P products deep (4 a layer, then the head); their errors at most add: P DELTA. That rounding is
# now smaller than the two engines' own: float32 sums in another order, over random weights whose products cancel
# (an error of about K 2^-24 of a product's rms, 3e-5 at K = 512), and the K/V cache's float16, where two near values
# may round either side (up to half an ulp, 2^-12): each product is allowed both.
DELTA = 2.37 / (32639 * 12**0.5) + 2**-12


def quant_close(a: torch.Tensor, b: torch.Tensor, products: int) -> bool:
    """b equal to a to the rounding of `products` quantized products in a row (relative rms; DELTA each)."""
    return a.shape == b.shape and float((a.float() - b.float()).norm()) <= products * DELTA * float(a.float().norm())


def sizes(kind: str) -> tuple[float, ...]:
    """d (and m or dmin) that give weights of about STD's spread, centred (on average, for a k-quant)."""
    spread = {"Q8_0": 74, "Q4_0": 4.6, "Q5_0": 9.2, "Q4_1": 4.6, "Q5_1": 9.2, "Q4_K": 145, "Q5_K": 290, "Q6_K": 1370}
    d = STD / spread[kind]
    return {"Q4_1": (d, -7.5 * d), "Q5_1": (d, -15.5 * d), "Q4_K": (d, 7.5 * d), "Q5_K": (d, 15.5 * d)}.get(kind, (d,))


def write_mix(path: Path, family: Family, mix: dict[str, str]) -> set[str]:
    """A GGUF file of CFG: every matrix random blocks of its type in `mix`, norms as a fresh model's -> the types of
    the matrices it multiplies by (the embedding aside, but for a tied head's)."""
    gguf = need()
    arrays = gguf_tensors(Transformer(CFG), "f32")
    if "output.weight" not in mix:  # tied: the embedding is the head
        del arrays["output.weight"]
    w = gguf.GGUFWriter(str(path), "llama")
    add_llama_metadata(w, CFG, gguf_vocab(family.tokenizer, CFG.vocab_size))
    rng, kinds = np.random.default_rng(7), set()
    for name, arr in arrays.items():
        if arr.ndim == 2:
            kind = mix[name] if name in mix else mix[name.split(".", 2)[2]]  # blk.N.attn_q.weight
            raw = raw_blocks(kind, arr.shape[0], arr.shape[1], rng, sizes(kind))
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])
            if name != "token_embd.weight" or "output.weight" not in arrays:
                kinds.add(kind)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return kinds


@pytest.fixture(scope="module", params=sorted(MIXES))
def loaded(request: pytest.FixtureRequest, family: Family, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(the model read from a file of MIXES[param], its native backend, the file)."""
    path = tmp_path_factory.mktemp("kquants") / f"{request.param}.gguf"
    kinds = write_mix(path, family, MIXES[request.param])
    model = load_gguf(path).model.pack()
    backend = Backend("native")
    name = backend.prepare(model, [])
    # every matrix the model multiplies by as its blocks, and the embedding's rows dequantized as they are read
    assert name == f"native ({'+'.join(sorted(k.lower() for k in kinds))})", name
    return model, backend, path


@pytest.mark.skipif(no_native, reason="the native engine needs g++ and an AVX2 CPU")
def test_native_passes_are_the_eager_ones(loaded: Any) -> None:
    """The one-sequence step and the flat pass over T tokens, with more rows than a tile of blocks holds, match the
    eager pass over the dequantized values to the int16 rounding of each product's inputs (`quant_close`: the logits
    4 L + 1 products deep, the hidden states 4 L, the deepest layer's K/V 4 (L - 1) + 1)."""
    model, backend, _ = loaded
    steps = backend.steps(model)
    assert steps is not None
    L = CFG.n_layers
    tokens = torch.randint(0, CFG.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    for T in (1, 13):
        past, new = tokens[:20], tokens[20 : 20 + T]
        a, c = one_sequence(model, past, new), one_sequence(model, past, new, steps)
        assert quant_close(a[0], c[0], 4 * L + 1) and quant_close(a[1], c[1], 4 * L), T
        assert quant_close(a[2], c[2], 4 * L - 3), T
        flat_a, flat_c = sequence_pass(model, past, new), sequence_pass(model, past, new, steps)
        assert quant_close(flat_a[0], flat_c[0], 4 * L + 1) and quant_close(flat_a[1], flat_c[1], 4 * L), T


@pytest.mark.skipif(no_native, reason="the native engine needs g++ and an AVX2 CPU")
def test_speculations_greedy_tokens_are_the_targets_alone(loaded: Any) -> None:
    """A copy of the model drafting for it: each draft token is the target's own next token, so every one is
    accepted, the verification pass (k + 1 rows) scoring each row as the draft's one-token pass did, and the tokens
    are the target's alone."""
    model, backend, path = loaded
    draft = load_gguf(path).model.pack()
    both = Backend("native")
    both.prepare(model, [draft])
    for prompt in ([5, 17, 42, 9, 1, 33, 60], [0, 250, 7]):
        alone, _ = generate(model, NONE, prompt, 12, 0, backend=backend)
        spec, stats = generate(model, proposer("draft", model, draft), prompt, 12, 4, backend=both)
        assert spec == alone and len(set(alone)) > 1, prompt
        assert stats.accepted == stats.proposed > 0, stats


@pytest.mark.skipif(no_native, reason="the native engine needs g++ and an AVX2 CPU")
def test_a_rows_logits_do_not_depend_on_the_rows_beside_it(loaded: Any) -> None:
    """A pass over 13 tokens (two groups of rows on AVX-512, three on AVX2) gives each row the bits a pass over that
    token alone gives it, after the same past: the verification pass and a one-token pass agree."""
    model, backend, _ = loaded
    steps = backend.steps(model)
    tokens = torch.randint(0, CFG.vocab_size, (33,), generator=torch.Generator().manual_seed(2))
    P, T = 20, 13
    whole, _, _ = one_sequence(model, tokens[:P], tokens[P : P + T], steps)
    flat, _ = sequence_pass(model, tokens[:P], tokens[P : P + T], steps)
    assert same_bits(flat, whole)
    for j in range(T):
        one, _, _ = one_sequence(model, tokens[: P + j], tokens[P + j : P + j + 1], steps)
        assert same_bits(one[0], whole[j]), j
    avx2 = Backend("native-avx2")  # panels of 8, the integer sums without VNNI: the same bits
    avx2.prepare(model, [])
    assert same_bits(one_sequence(model, tokens[:P], tokens[P : P + T], avx2.steps(model))[0], whole)
