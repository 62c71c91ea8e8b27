"""The native kernels' integer products of a quantized file's matrices (`qmatmul.h`, `native/blocks.py`), to the bit.

What is checked: for every block type, and for fused matrices of segments of different types (a Q4_K_M file's
q/k/v), the product of a few input rows is exactly the formula qmatmul.h states: each row's blocks of 32 rounded to
int16 (xq = round(x / sx), sx = max|x| / XQ_MAX, a block of zeros all zero), each weight block's exact integer dot
product, then in block order c = fma(float(dot), d * sx, c) and, with offsets, c = fma(m, sx * sum(xq), c), every
rounding float32's. Computed here in torch, each fused multiply-add in float64 rounded to odd (exact for the product,
a single float32 rounding at the end); the same bits from the AVX-512 build with VNNI and without it, and from the
AVX2 build; a row with a NaN gives NaN in that row alone."""

from __future__ import annotations

import ctypes
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from test_kquants import need, raw_blocks, sizes
from test_native import no_native

from smallem_cli.backends import native
from smallem_cli.backends.engines import cache_root
from smallem_cli.backends.native import blocks, kernels
from smallem_cli.model import quant

pytestmark = pytest.mark.skipif(no_native, reason="the native engine needs g++ and an AVX2 CPU")
XQ_MAX = 127 * 256 + 127  # the largest |xq| (qmatmul.h): xq = 256 hi + lo in two signed bytes (amx.h)


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 a * b + c rounded once, as the hardware's fused multiply-add: the product of two float32 is exact in
    float64; the sum rounded to odd there (the error of the rounded sum, TwoSum, tells which neighbour) and then to
    float32 rounds as the exact sum would, float64 having more than 24 + 1 bits."""
    a, b, c = torch.broadcast_tensors(a.double(), b.double(), c.double())
    p = a * b
    s = p + c
    z = s - p
    err = (p - (s - z)) + (c - z)
    even = (s.view(torch.int64) & 1) == 0
    away = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, -float("inf")))
    return torch.where((err != 0) & even, torch.nextafter(s, away), s).float()


def expected(parts: list[quant.Blocked], x: torch.Tensor) -> torch.Tensor:
    """y [M, N] as qmatmul.h computes it, the parts' rows one below the other."""
    M, K = x.shape
    blocks32 = x.view(M, K // 32, 32)
    sx = blocks32.abs().amax(-1) / XQ_MAX
    xq = torch.where(sx[..., None] > 0, torch.round(blocks32 / sx[..., None]).clamp(-XQ_MAX, XQ_MAX), 0).long()
    outs = []
    for b in parts:
        B, N = b.block, b.q.shape[0]
        xb = xq.view(M, K // B, B)
        sxb = sx.repeat_interleave(32 // B, dim=1)  # [M, blocks]
        dots = torch.einsum("mbk,nbk->mnb", xb, b.q.long().view(N, K // B, B)).float()
        scales = b.d.float()[None] * sxb[:, None]  # d * sx, float32
        sums = sxb * xb.sum(-1).float()  # sx * sum(xq), float32
        c = torch.zeros(M, N)
        for i in range(K // B):
            c = fma(dots[..., i], scales[..., i], c)
            if b.m is not None:
                c = fma(b.m.float()[None, :, i], sums[:, None, i], c)
        outs.append(c)
    return torch.cat(outs, dim=1)


def product(lib: ctypes.CDLL, parts: list[quant.Blocked], x: torch.Tensor, threads: int = 2) -> torch.Tensor:
    """The library's product (`smallem_matmul`) of x [M, K] and the parts' rows, packed as the engine packs them."""
    held: list[torch.Tensor] = []

    def hold(t: torch.Tensor) -> int:
        held.append(t)
        return t.data_ptr()

    segs = [blocks.pack(b, lib.smallem_panel(), hold) for b in blocks.segments(parts)]
    table = blocks.held_array(segs)
    mat = native._Mat(segs[0].w, None, native.W_Q, table.data_ptr(), len(segs))
    (M, K), N = x.shape, sum(p.q.shape[0] for p in parts)
    y = torch.full((M, N), 7.0)
    fn = lib.smallem_matmul
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int] * 3, ctypes.c_void_p, ctypes.c_int]
    fn(ctypes.addressof(mat), x.data_ptr(), M, N, K, y.data_ptr(), threads)
    return y


@pytest.fixture(scope="module")
def libraries() -> dict[str, ctypes.CDLL]:
    """Every build this CPU runs: the widest, the AVX2 one, and where the widest uses VNNI, an AVX-512 one without."""
    root: Path = cache_root()
    libs = {isa: kernels.library(root, print, isa) for isa in {kernels.best_isa(), "avx2"}}
    if kernels.best_isa() == "avx512" and kernels.vnni():
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(kernels, "_LIBS", {})
            mp.setattr(kernels, "vnni", lambda cpuinfo=None: False)
            libs["avx512 without vnni"] = kernels.library(root, print, "avx512")
    return libs


MATRICES = [
    *[(kind,) for kind in quant.KINDS],
    ("Q4_K", "Q4_K", "Q6_K"),  # a Q4_K_M file's q, k, v: a 4-bit segment of two parts, then a 6-bit one
    ("Q5_0", "Q5_1", "Q5_K", "Q8_0", "Q4_0", "Q4_1"),  # a segment each, bytes and nibbles, offsets and none
]


@pytest.mark.parametrize("kinds", MATRICES, ids="+".join)
def test_the_product_is_the_formula_to_the_bit(libraries: dict[str, ctypes.CDLL], kinds: tuple[str, ...]) -> None:
    need()
    rng = np.random.default_rng(len(kinds) * 31 + sorted(quant.KINDS).index(kinds[-1]))
    K, parts = 512, []
    for i, kind in enumerate(kinds):
        N = 21 + 8 * i  # panels of 16 (or 8) and a padded last one
        parts.append(quant.from_gguf(raw_blocks(kind, N, K, rng, sizes(kind)), kind, (N, K)))
    for M in (1, 2, 5, 13):  # rows in registers, panels in registers, two groups of rows
        spread = np.repeat(10 ** rng.uniform(-3, 2, (M, K // 32)), 32, axis=1)  # blocks of very different sizes
        x = torch.from_numpy((rng.standard_normal((M, K)) * spread).astype(np.float32))
        x[0, 64:96] = 0  # a block of zeros
        want = expected(parts, x)
        for name, lib in libraries.items():
            got = product(lib, parts, x)
            assert torch.equal(got, want), (name, M, float((got - want).abs().max()))
    if parts[0].factors is not None:  # a K-quant's scales as float32 (the kernels' other way to read them)
        plain = [dataclasses.replace(b, factors=None) for b in parts]
        assert all(torch.equal(product(lib, plain, x), want) for lib in libraries.values())
    x[1, 100] = float("nan")  # a NaN makes its row NaN, and no other
    others = [r for r in range(x.shape[0]) if r != 1]
    for name, lib in libraries.items():
        got = product(lib, parts, x)
        assert bool(got[1].isnan().all()) and torch.equal(got[others], want[others]), name


def packed_bytes(b: quant.Blocked) -> int:
    held: list[torch.Tensor] = []

    def hold(t: torch.Tensor) -> int:
        held.append(t)
        return t.data_ptr()

    blocks.pack(b, 16, hold)
    return sum(t.numel() * t.element_size() for t in held)


def test_bytes_a_weight() -> None:
    """What the kernels read of each type: its unsigned q in 8 or 4 bits, and its scales as stored."""
    need()
    rng = np.random.default_rng(0)
    N, K = 32, 1024
    got = {}
    for kind in quant.KINDS:
        b = quant.from_gguf(raw_blocks(kind, N, K, rng, sizes(kind)), kind, (N, K))
        got[kind] = packed_bytes(b) / (N * K)
    want = {"Q8_0": 1 + 2 / 32, "Q4_0": 0.5 + 2 / 32, "Q4_1": 0.5 + 4 / 32, "Q5_0": 1 + 2 / 32, "Q5_1": 1 + 4 / 32}
    want |= {"Q4_K": 0.5 + 2 / 32 + 4 / 256, "Q5_K": 1 + 2 / 32 + 4 / 256, "Q6_K": 1 + 1 / 16 + 2 / 256}
    assert got == pytest.approx(want, abs=1e-9)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_the_tile_units_product_is_the_same_formula(libraries: dict[str, ctypes.CDLL], kind: str) -> None:
    """Where the CPU has AMX, products of several rows go to its tile unit (`amx.h`): the same bits as the formula,
    for nibbles and bytes, blocks of 32 and of 16, in groups of rows and of panels of every size, and the registers'
    path gives them too with the tile unit turned off."""
    need()
    lib = libraries[kernels.best_isa()]
    if not lib.smallem_amx(1):
        pytest.skip("this CPU (or Linux) offers no AMX tile unit")
    rng = np.random.default_rng(7)
    N, K = 16 * 14 + 3, 256  # 15 panels: each thread's 7 or 8 in fours, threes and ones, the last padded
    parts = [quant.from_gguf(raw_blocks(kind, N, K, rng, sizes(kind)), kind, (N, K))]
    # another build in this process with the tile unit (the tiles' configuration is the thread's, not a library's)
    other = next((b for name, b in libraries.items() if b is not lib and b.smallem_amx(1)), None)
    try:
        for M in (5, 8, 9, 16, 17):
            x = torch.from_numpy(rng.standard_normal((M, K)).astype(np.float32))
            want = expected(parts, x)
            assert torch.equal(product(lib, parts, x), want), M
            if other is not None:  # tiles of other shapes configured in between
                assert torch.equal(product(other, parts, x[:6]), want[:6])
                assert torch.equal(product(lib, parts, x), want), M
            lib.smallem_amx(0)
            assert torch.equal(product(lib, parts, x), want), M
            lib.smallem_amx(1)
    finally:
        lib.smallem_amx(1)


def test_cpu_features_are_read_from_the_cpus_flags() -> None:
    assert kernels.vnni("processor\t: 0\nflags\t\t: fpu avx512f avx512bw avx512_vnni\n")
    assert not kernels.vnni("flags\t\t: fpu avx512f avx512bw avx512vnni_like\nbugs\t\t: avx512_vnni\n")
    assert kernels.amx("flags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n")
    assert not kernels.amx("flags\t\t: fpu avx512f amx_tile\n")
    assert "-mavx512bw" in kernels.isa_flags("avx512") and kernels.isa_flags("avx2") == []
