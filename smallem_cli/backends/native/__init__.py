"""The native engine (`--engine native`): a decode pass in C++ over the model's own weights, read from its files a
tensor at a time (`model.weights`) into the kernels' layout. A one-token pass is bound by reading the weights, so
`step.cpp` reads each matrix in panels, in the narrowest of float16, bfloat16 and float32 that holds its values exactly
(`narrowest`), accumulating in float32: such a model is computed as it is. A quantized file's matrices are read as its
blocks (`blocks.py`, `qmatmul.h`), in integer dot products against the inputs quantized to int16 per block of 32
(llama.cpp: to int8): the eager pass's to the inputs' rounding. A proposer's may be int8 (`--proposer-weights int8`,
`panels8`); the target's never are, so the text is the target's. A failure leaves the model eager."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from ...kv.step import BatchStep, visible
from ...model import quant
from ...model.eagle import EagleHead
from ...model.llama import MTPModule, Transformer, attn_scale
from ...model.weights import interleave_halves, permute_rope
from ...spec.verify import Penalty, Warper, uniforms
from . import blocks as qblocks
from . import kernels
from .kernels import ENGINES, Log, NativeUnavailable, library, ptr

MAX_T = 64  # the longest one-sequence step (verify passes, a draft's catch-up); longer ones take the batch pass
_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class _Mat(ctypes.Structure):
    """A matrix in panels (`matmul.h`'s `Mat`): float16, bfloat16 or float32, int8 with its rows'
    scales, or a quantized file's blocks (W_Q: `nseg` segments of rows, `blocks.QSeg`)."""

    _fields_ = [("w", _P), ("scale", _P), ("kind", _I), ("seg", _P), ("nseg", _I)]


class _LayerW(ctypes.Structure):
    _fields_ = [
        *[(n, _Mat) for n in ("qkv", "o", "gu", "down")],
        *[(n, _P) for n in ("g1", "g2", "bias", "gq", "gk", "g3", "g4")], ("window", _I),
    ]  # fmt: skip


class _ModelW(ctypes.Structure):
    _fields_ = [
        *[(n, _I) for n in ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "hidden", "vocab")], ("eps", _F),
        ("layers", _P), ("embed", _P), ("head", _Mat), ("g_final", _P), ("table", _P), ("wh", _Mat), ("g_h", _P),
        ("embed_kind", _I), ("embed_panels", _I), ("embed_d", _P), ("embed_m", _P), ("embed_block", _I),
        ("embed_scale", _F), ("qscale", _F), ("geglu", _I), ("rope_local", ctypes.c_int64),
        ("taps", _P), ("n_taps", _I), ("tap_out", _P),
    ]  # fmt: skip


class _Chain(ctypes.Structure):
    """`smallem_chain`'s arguments (step.cpp's `Chain`, where each is described)."""

    _fields_ = [
        ("head", _Mat), ("N", _I), ("g_final", _P), ("ids", _P), ("feed", _P), ("feed_h", _P), ("m", _I), ("k", _I),
        ("cos_t", _P), ("sin_t", _P), ("view", _P), ("st", _P), ("L", _I), ("u", _P), ("inv_t", _F), ("tokens", _P),
        ("tops", _P), ("q", _P), ("scratch", _P), ("step_scratch", _I), ("threads", _I), ("seen", _P),
        ("penalty", _F), ("mark", _P), ("min_top", _F),
    ]  # fmt: skip


KV_DTYPE = torch.float16  # the K/V cache's type, vec.h's kv_t (why: there)
KINDS = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}  # matmul.h's W_F16, W_BF16, W_F32
KIND_NAMES = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
W_Q = 3  # matmul.h's blocks (`model.quant`)


def narrowest(w: Tensor) -> Tensor:
    """w in the narrowest of float16, bfloat16 and float32 that holds every value exactly."""
    if w.dtype in (torch.float16, torch.bfloat16):  # as a file stores it: nothing narrower holds it
        return w.detach().contiguous()
    w = w.detach().float()
    for dtype in (torch.float16, torch.bfloat16):
        if torch.equal((t := w.to(dtype)).float(), w):
            return t.contiguous()
    return w.contiguous()


def panels(rows: Tensor, width: int) -> Tensor:
    """W [out, in] -> [ceil(out / width), in, width] (`step.cpp`'s panels), the last padded with zero rows."""
    if pad := -rows.shape[0] % width:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    return rows.view(-1, width, rows.shape[1]).transpose(1, 2).contiguous()


def panels8(w: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """W [out, in] -> int8 panels and float32 scales [ceil(out / width) * width]: row n is
    scale[n] * q[n], scale[n] = max |W[n]| / 127 (symmetric, per output row)."""
    w = w.detach().float()
    top = w.abs().amax(dim=1)
    scale = torch.where(top > 0, top / 127, torch.ones_like(top))
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    pad = -w.shape[0] % width  # the padding rows' scales: 1 (their outputs are never stored)
    return panels(q, width), torch.cat([scale, scale.new_ones(pad)]).contiguous()


class NativeSteps:
    """A model's native decode passes: a flat batch's (`batch`), one sequence's (`step`), a proposer's chain."""

    def __init__(
        self, model: Transformer | MTPModule, target: Transformer, log: Log, root: Path, engine: str, int8: bool
    ) -> None:
        self.lib = library(root, log, ENGINES[engine])
        self.width = self.lib.smallem_panel()  # a panel's output rows, as this library reads them
        self.score_rows = self.lib.smallem_score_rows()  # rows of attention scores a thread's scratch holds
        self.int8 = int8
        self.cfg = c = model.cfg
        if c.dim % 8 or c.head_dim % 8 or c.hidden_dim % 8 or c.n_heads % c.n_kv_heads:
            raise NativeUnavailable("the model's widths are not multiples of 8")
        self.mtp = isinstance(model, MTPModule)
        own = target if self.mtp else model  # the MTP module turns (and drafts) as its target
        # cos, sin [context, D/2] (each head's pairs turn alike), the local layers' below them: the model's own tables
        self.rope = (own.rope_cos.contiguous(), own.rope_sin.contiguous())
        self.positions = min(c.max_seq_len, target.cfg.max_seq_len)
        self.model = model
        self.keep: list[Tensor] = []  # every tensor the C structs point at, alive as long as they
        self.kinds: set[str] = set()  # what its matrices are read as (int8 aside): f16, ..., q4_1
        # the head first: the largest matrix, read while little else is held, so that its read does not set the peak
        head = None if isinstance(model, MTPModule) else self._rows([(model.head_name, 0)])
        names = ["block"] if self.mtp else [f"layers.{i}" for i in range(c.n_layers)]
        self.layers_c = (_LayerW * len(names))()
        for i, at in enumerate(names):
            qkv = [(f"{at}.{n}_proj.weight", heads) for n, heads in (("q", c.n_heads), ("k", c.n_kv_heads), ("v", 0))]
            gate_up = [(f"{at}.gate_proj.weight", 0), (f"{at}.up_proj.weight", 0)]
            mats = [qkv, [(f"{at}.o_proj.weight", 0)], gate_up, [(f"{at}.down_proj.weight", 0)]]
            norms = [self._held(floats(model, f"{at}.{n}_layernorm.weight")) for n in ("input", "post_attention")]
            bias = gq = gk = None  # Qwen2's q/k/v biases, Qwen3's q/k norms: in the packed row's order, or none
            if c.attn_bias:
                bq, bk, bv = (floats(model, f"{at}.{n}_proj.bias") for n in "qkv")
                bias = self._held(torch.cat([permute_rope(bq, c.n_heads), permute_rope(bk, c.n_kv_heads), bv]))
            if c.qk_norm:
                order = interleave_halves(c.head_dim)
                gq, gk = (self._held(floats(model, f"{at}.{n}_norm.weight")[order].contiguous()) for n in "qk")
            outs = [None, None]  # Gemma's norms of the attention's output and the MLP's
            if c.output_norms:
                outs = [self._held(floats(model, f"{at}.{n}_output_norm.weight")) for n in ("attn", "mlp")]
            window = c.sliding_window if not self.mtp and i in c.local_layers else 0
            self.layers_c[i] = _LayerW(*[self._rows(m) for m in mats], *norms, bias, gq, gk, *outs, window)
        self.mw = mw = _ModelW(len(names), c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.hidden_dim, c.vocab_size)
        mw.eps, mw.layers = c.norm_eps, ctypes.cast(self.layers_c, ctypes.c_void_p)
        mw.embed_scale, mw.qscale, mw.geglu = c.embed_scale, attn_scale(c), int(c.geglu)
        mw.rope_local = own.cos.numel() if c.local_layers else 0  # the local tables' offset, in floats
        # a chain's head rows in panels, by id(ids) (ids held, so that their id stays theirs)
        self._heads: dict[int, tuple[Tensor | None, _Mat]] = {}
        if isinstance(model, MTPModule):
            mw.wh = self._mat(model.eh_proj.weight[:, : c.dim].contiguous())  # [d, d]: the h half
            table = model.token_table(floats(target, "embed_tokens.weight"))
            mw.table = self._held(table.detach().contiguous())
            mw.g_h = self._held(floats(model, "hnorm.weight"))
        else:
            assert head is not None
            mw.head = head
            if c.tie_embeddings and mw.head.kind in (*KINDS.values(), W_Q) and not mw.head.scale:  # the head's rows
                mw.embed, mw.embed_kind, mw.embed_panels = mw.head.w, mw.head.kind, 1
            elif isinstance(embed := own_bytes(model, "embed_tokens.weight"), quant.Blocked):  # a byte a weight
                mw.embed, mw.embed_kind, mw.embed_block = self._held(embed.q.contiguous()), W_Q, embed.block
                mw.embed_d = self._held(embed.d.float().contiguous())
                mw.embed_m = None if embed.m is None else self._held(embed.m.float().contiguous())
                self.kinds.update(k.lower() for k in embed.kinds)
            else:
                embed = narrowest(embed)
                mw.embed, mw.embed_kind = self._held(embed), KINDS[embed.dtype]
                self.kinds.add(KIND_NAMES[embed.dtype])
            mw.g_final = self._held(floats(model, "norm.weight"))
            self._heads[id(None)] = (None, mw.head)
        self._scratch = torch.empty(0)  # the C code's, for the largest pass so far
        # what a chain reads: the target's head and norm for the MTP module, a draft's or an EAGLE head's own
        self.head_of = (model, "lm_head.weight") if isinstance(model, EagleHead) else (own, own.head_name)
        self.g_final = floats(self.head_of[0], "norm.weight")
        self._taps: dict[tuple[int, ...], Tensor] = {}  # the layers a pass copies out, as the C code reads them

    def _held(self, t: Tensor) -> int:
        self.keep.append(t)
        return t.data_ptr()

    def _rows(self, parts: list[tuple[str, int]]) -> _Mat:
        """These parameters' rows one below the other (a part with heads > 0 in the rope's pairs, `permute_rope`), in
        panels, held: as a quantized file stored them where it stored every part so (`model.quant`), else as `_mat`."""

        got = [own_bytes(self.model, name, heads) for name, heads in parts]
        turned = [b for b in got if isinstance(b, quant.Blocked)]
        if self.int8 or len(turned) < len(got):
            return self._mat(torch.cat([b.values() if isinstance(b, quant.Blocked) else b for b in got]))
        segs = [qblocks.pack(b, self.width, self._held) for b in qblocks.segments(turned)]
        self.kinds.update(k.lower() for b in turned for k in b.kinds)
        return _Mat(segs[0].w, None, W_Q, self._held(qblocks.held_array(segs)), len(segs))

    def _mat(self, w: Tensor) -> _Mat:
        if self.int8:
            q, scale = panels8(w, self.width)
            return _Mat(self._held(q), self._held(scale), 0)
        t = narrowest(w)
        self.kinds.add(KIND_NAMES[t.dtype])
        return _Mat(self._held(panels(t, self.width)), None, KINDS[t.dtype])

    def serves(self, start: int, end: int) -> bool:
        """Whether `step` takes a pass over positions start .. end - 1 (the rope tables stop at the context)."""
        return not self.mtp and end <= self.positions and end - start <= MAX_T

    def _scratch_for(self, T: int, threads: int, more: int = 0) -> tuple[Tensor, int]:
        """The C code's scratch, grown as needed, for T tokens and `more` floats -> (it, the floats a pass takes)."""
        c = self.cfg
        Q, F = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.hidden_dim
        need = T * (c.dim + Q + c.n_heads * c.head_dim + 3 * F) + threads * self.score_rows * (self.positions + T + 8)
        if self._scratch.numel() < need + more:
            self._scratch = torch.empty(need + more)
        return self._scratch, need

    def chain(
        self, ids: Tensor | None, k: int, view: Tensor, L: int, fed: tuple[Tensor, Tensor | None],
        inv_t: float | None = None, u: Tensor | None = None, penalty: Penalty | None = None, min_top: float = 0.0,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """A proposer's chain (`smallem_chain`): the entries a round confirmed `fed` (tokens [m >= 1], the MTP
        module's target states [m, d] or None; their K/V written at L .. L+m-1), then k draft tokens, the head cut
        to `ids` (None: whole); `view` [layers, 2, Hkv, >= L+m+k-1, D]. Greedy -> (tokens [k], their
        probabilities [k]); sampled (1/T, float64 uniforms u [k]) -> (tokens [k], q [k, V]). Where the head's top
        probability for the next draft token is under `min_top`, the chain ends before it: it and those after, -1."""
        assert k >= 1 and fed[0].shape[0] >= 1
        if id(ids) not in self._heads:  # the cut head's rows, in panels, once per head
            rows = floats(*self.head_of)  # an EAGLE head's own are already its N rows
            cut = ids is not None and rows.shape[0] != ids.numel()
            self._heads[id(ids)] = (ids, self._mat(rows[ids] if cut else rows))
        ids_t, rows = self._heads[id(ids)]
        c, threads = self.cfg, torch.get_num_threads()
        N = c.vocab_size if ids_t is None else ids_t.numel()
        feed, feed_h = fed[0].contiguous(), None if fed[1] is None else fed[1].contiguous()
        m = feed.shape[0]
        scratch, need = self._scratch_for(m, threads, 3 * c.dim + N + m * c.dim)  # the widest step: m
        tokens, tops = torch.empty(k, dtype=torch.long), torch.empty(k)
        q = None  # greedy: no q (the C code reads it only with u)
        if u is not None:
            q = torch.empty(k, N) if ids_t is None else torch.zeros(k, c.vocab_size)
            u = u.contiguous()
            assert tuple(u.shape) == (k,) and u.dtype == torch.float64 and inv_t is not None
        assert L + m + k - 1 <= self.positions
        seen = mark = None  # the penalty's context [V] and the C code's scratch for it
        if penalty is not None:
            seen, mark = penalty.seen.contiguous(), torch.empty(c.vocab_size, dtype=torch.uint8)
            assert seen.dtype == torch.bool and seen.numel() == c.vocab_size
        at = L * self.rope[0].stride(0) * self.rope[0].element_size()  # cos, sin from position L on: by address
        assert view.dtype == KV_DTYPE and view.stride(-1) == 1
        strides = (ctypes.c_int64 * 4)(*view.stride()[:4])
        args = _Chain(
            rows, N, self.g_final.data_ptr(), ptr(ids_t), ptr(feed), ptr(feed_h), m, k, self.rope[0].data_ptr() + at,
            self.rope[1].data_ptr() + at, view.data_ptr(), ctypes.addressof(strides), L, ptr(u),
            0.0 if inv_t is None else inv_t, tokens.data_ptr(), tops.data_ptr(), ptr(q), scratch.data_ptr(), need,
            threads, ptr(seen), 1.0 if penalty is None else penalty.factor, ptr(mark), min_top,
        )  # fmt: skip
        self.lib.smallem_chain(ctypes.addressof(self.mw), ctypes.addressof(args))
        return (tokens, q) if q is not None else (tokens, tops)

    def batch(
        self,
        tokens: Tensor,
        h: Tensor | None,
        slab: Tensor,
        b: BatchStep,
        head: str = "none",
        top: Tensor | None = None,
        taps: tuple[int, ...] = (),
    ) -> tuple[Tensor, Tensor]:
        """A pass over a flat batch (`smallem_batch_step`): tokens [N] (and the MTP module's states h [N, d]) at `b`'s
        positions, K/V into `slab` [L, 2, Hkv, slots, D] -> (logits of `head`'s rows, hidden [N, d], or with `taps`
        the outputs of those layers [N, len(taps) * d]); `top` [rows + 1] long, if given, takes each logits row's
        argmax and the finite flag (no pass over them in torch afterwards)."""
        c, threads, N = self.cfg, torch.get_num_threads(), tokens.shape[0]
        vis, first, count = (t.contiguous() for t in visible(b))
        keys = int(count.max())
        rows = b.last.contiguous() if head == "last" else None  # gathered; "all": the last N rows are all
        R = 0 if head == "none" or self.mtp else N if head == "all" else len(b.counts)
        x, logits = torch.empty(N, c.dim), torch.empty(R, c.vocab_size)
        h = None if h is None else h.contiguous()  # held here: the C code reads it
        tokens, slots, positions = tokens.contiguous(), b.slots.contiguous(), b.positions.contiguous()
        # a row at position P sees P + 1 keys: within the context, its rotation is in the C code's tables
        assert slab.is_contiguous() and slab.dtype == KV_DTYPE and keys <= self.positions
        scratch, _ = self._scratch_for(N, threads)
        strides = (ctypes.c_int64 * 4)(*slab.stride()[:4])
        tapped = self._tap(taps, N)
        self.lib.smallem_batch_step(
            ctypes.addressof(self.mw), tokens.data_ptr(), ptr(h), N, positions.data_ptr(), self.rope[0].data_ptr(),
            self.rope[1].data_ptr(), slab.data_ptr(),
            ctypes.addressof(strides), slots.data_ptr(), vis.data_ptr(), first.data_ptr(), count.data_ptr(), keys,
            x.data_ptr(), logits.data_ptr(), R, ptr(rows), scratch.data_ptr(), threads, ptr(top),
        )  # fmt: skip
        self.mw.n_taps = 0
        return logits, x if tapped is None else tapped

    def _tap(self, taps: tuple[int, ...], T: int) -> Tensor | None:
        """The next pass copies the outputs of layers `taps` out (() : none) -> their buffer [T, len(taps) * d]."""
        if not taps:
            return None
        if taps not in self._taps:
            self._taps[taps] = torch.tensor(taps, dtype=torch.int32)
        out = torch.empty(T, len(taps) * self.cfg.dim)
        self.mw.taps, self.mw.n_taps, self.mw.tap_out = self._taps[taps].data_ptr(), len(taps), out.data_ptr()
        return out

    def step(
        self, tokens: Tensor, past: Tensor, heads: int, taps: tuple[int, ...] = ()
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """The target's pass (`smallem_step`) over tokens [T] after `past` [L, 2, Hkv, S, D], a view of the slab ->
        (logits of the last `heads` rows [heads, V], hidden [T, d] (`batch`'s taps), the new K/V after the past,
        their argmaxes and the finite flag [heads + 1], or None without heads)."""
        c, T, S, threads = self.cfg, tokens.shape[0], past.shape[3], torch.get_num_threads()
        scratch, _ = self._scratch_for(T, threads)
        x = torch.empty(T, c.dim)
        # the new K/V [L, 2, Hkv, T, D]: in the slab, right after the past, which must hold them
        at = past.storage_offset() + S * past.stride(3)
        dims = zip(past.shape[:3], past.stride()[:3], strict=True)
        reach = at + sum((n - 1) * s for n, s in dims) + (T - 1) * past.stride(3) + c.head_dim
        if reach > past.untyped_storage().nbytes() // past.element_size():  # the C code would write past the slab
            raise ValueError(f"no room in the slab for {T} positions after a past of {S}")
        new = past.as_strided((c.n_layers, 2, c.n_kv_heads, T, c.head_dim), past.stride(), at)
        t_head = min(heads, T)
        logits = torch.empty(t_head, c.vocab_size)
        top = torch.empty(t_head + 1, dtype=torch.long) if t_head else None  # each row's argmax, the finite flag
        cos, sin = self.rope[0][S : S + T], self.rope[1][S : S + T]  # [T, P]
        assert past.stride(-1) == 1 and past.dtype == KV_DTYPE and tokens.is_contiguous()
        assert cos.is_contiguous() and sin.is_contiguous()
        strides = (ctypes.c_int64 * 4)(*past.stride()[:4])
        tapped = self._tap(taps, T)
        self.lib.smallem_step(
            ctypes.addressof(self.mw), tokens.data_ptr(), None, T, cos.data_ptr(), sin.data_ptr(), past.data_ptr(),
            ctypes.addressof(strides), S, x.data_ptr(), logits.data_ptr(), t_head, new.data_ptr(),
            ctypes.addressof(strides), scratch.data_ptr(), threads, ptr(top),  # new's strides: the slab's too
        )  # fmt: skip
        self.mw.n_taps = 0
        return logits, x if tapped is None else tapped, new, top


def own_bytes(model: Transformer | MTPModule, name: str, pairs: int = 0) -> Tensor | quant.Blocked:
    """A parameter as its file stores it (float16 stays float16, blocks stay blocks), read now, where the model's
    weights lie in files (`Transformer.stored`); else the one in memory. With `pairs` heads, its rows in rope pair
    order (`permute_rope`)."""
    source = model.source if isinstance(model, Transformer) else None
    if source is not None:
        return source[name].read(pairs)
    w = model.get_parameter(name).detach()
    return permute_rope(w, pairs) if pairs else w


def floats(model: Transformer | MTPModule, name: str) -> Tensor:
    """A parameter's values in float32 (a vector's, or a matrix read once to be laid out)."""
    w = own_bytes(model, name)
    return (w.values() if isinstance(w, quant.Blocked) else w.float()).contiguous()


def verify_sample(
    logits: Tensor, warp: Warper, drafts: Tensor, q: Tensor | None, generator: torch.Generator | None
) -> Tensor:
    """`verify.verify_sample` for one sequence after `warp` (`verify.h`), drawing what it draws in the same
    order: logits [k+1, V], draft tokens [k], their q [k, V] -> [k + 2] long: n accepted, then the k+1 tokens."""
    k, V = drafts.shape[0], logits.shape[-1]
    assert logits.shape[0] == k + 1 and logits.dtype == torch.float32 and logits.is_contiguous()
    u = None  # without a draft token, nothing to accept: verify_sample draws only the next token
    if k:
        assert q is not None and tuple(q.shape) == (k, V)
        q, drafts = q.float().contiguous(), drafts.contiguous()
        u = torch.rand(1, k, generator=generator)  # as verify_sample's acceptance draws
    u_next = uniforms((1,), generator, logits)  # as its `sample` of the next token
    out, r = torch.empty(k + 2, dtype=torch.long), torch.empty(3 * V)  # r: the C code's scratch, held here
    kernels.loaded().smallem_verify_sample(
        logits.data_ptr(), k, V, 1.0 / warp.temperature, ptr(drafts) if k else None, ptr(q) if k else None, ptr(u),
        u_next.data_ptr(), r.data_ptr(), out.data_ptr(),
        warp.top_k or 0, 1.0 if warp.top_p is None else warp.top_p, warp.min_p or 0.0,  # 0, 1, 0: off
    )  # fmt: skip
    return out


def penalize_argmax(rows: Tensor, seen: Tensor, fed: Tensor, penalty: float) -> Tensor:
    """`verify.penalize` in place (the same float32 operations) over rows [T, V] of a pass over `fed` [T],
    context `seen` [V] -> each row's argmax [T] (the first largest, as torch.argmax)."""
    T, V = rows.shape
    assert rows.dtype == torch.float32 and rows.is_contiguous() and seen.dtype == torch.bool and seen.numel() == V
    fed, seen = fed.contiguous(), seen.contiguous()
    top, mark = torch.empty(T, dtype=torch.long), torch.empty(V, dtype=torch.uint8)  # mark: the C code's scratch
    kernels.loaded().smallem_penalize(ptr(rows), T, V, ptr(seen), ptr(fed), penalty, ptr(top), ptr(mark))
    return top
