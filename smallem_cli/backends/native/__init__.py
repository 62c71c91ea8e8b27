"""The native engine (`--engine native`): a decode pass in C++ over the checkpoint's float16 weights.

A one-token pass of the target is bound by reading its weights: 36 MB as the eager engine's float32,
more than this machine's L3; 18 MB as the float16 they are stored in. Inductor's float16 products
were slower than its float32 ones (docs/decisions.md), so `step.cpp` has its own, over weights packed
in panels at load: converted to float32 in registers and accumulated in float32, so float16-valued
weights (every checkpoint Smallem ships or exports) are computed as they are. A proposer loaded with
`--proposer-weights int8` reads int8 with a scale per row (`pack.panels8`), half the bytes; the
target's are always its own values, so the text is the target's.

A step reads the past as a strided view of the slab and writes the new K/V right after it, for every
T, with one library built and cached once (`kernels`). Anything that fails (no compiler, no
AVX2/F16C/FMA, weights float16 cannot hold, a shape the kernels do not tile) leaves the model eager,
with one line through `log`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch

from ...engine.batch import BatchStep, visible
from ...model.llama import MTPModule, Transformer, permute_rope
from ...spec.verify import Penalty
from .kernels import ENGINES, Log, library, ptr
from .pack import NativeUnavailable, half_exact, panels, panels8

MAX_T = 64  # the longest pass served (verify passes, a draft's catch-up); longer ones run eager
StepFn = Callable[..., tuple[torch.Tensor, ...]]


class _Mat(ctypes.Structure):
    """A matrix in panels (`matmul.h`'s `Mat`): float16, or int8 with its rows' scales."""

    _fields_ = [("w", ctypes.c_void_p), ("scale", ctypes.c_void_p)]


class _LayerW(ctypes.Structure):
    _fields_ = [*[(n, _Mat) for n in ("qkv", "o", "gu", "down")], *[(n, ctypes.c_void_p) for n in ("g1", "g2")]]


class _ModelW(ctypes.Structure):
    _fields_ = [
        *[(n, ctypes.c_int) for n in ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "hidden", "vocab")],
        ("eps", ctypes.c_float),
        *[(n, ctypes.c_void_p) for n in ("layers", "embed")],
        ("head", _Mat),
        *[(n, ctypes.c_void_p) for n in ("g_final", "table")],
        ("wh", _Mat),
        ("g_h", ctypes.c_void_p),
    ]


class NativeSteps:
    """A model's native decode passes, for every T: a flat batch's (`batch`), one sequence's over one
    view of the slab (`step_for`), a proposer's chain in one call (`chain`). int8: its matrices as int8."""

    def __init__(
        self,
        model: Transformer | MTPModule,
        target: Transformer,
        log: Log,
        root: Path,
        engine: str = "native",
        int8: bool = False,
    ) -> None:
        self.lib = library(root, log, ENGINES[engine])
        self.width = self.lib.smallem_panel()  # a panel's output rows, as this library reads them
        self.score_rows = self.lib.smallem_score_rows()  # rows of attention scores a thread's scratch holds
        self.int8 = int8  # a proposer's matrices as int8 (`panels8`): fewer bytes a guess; the target's never
        c = model.cfg
        if c.dim % 8 or c.head_dim % 8 or c.hidden_dim % 8 or c.n_heads % c.n_kv_heads:
            raise NativeUnavailable("the model's widths are not multiples of 8")
        own = target if isinstance(model, MTPModule) else model  # the MTP module turns (and guesses) as its target
        assert own.rope_cos is not None and own.rope_sin is not None, "pack() the model first"
        self.rope = (own.rope_cos, own.rope_sin)  # cos, sin [context, P] of the packed QKV row's pairs
        self._rope_row = own.rope_cos.stride(0) * own.rope_cos.element_size()  # bytes a position (`chain`)
        self.positions = min(c.max_seq_len, target.cfg.max_seq_len)
        self.mtp = isinstance(model, MTPModule)
        self.keep: list[torch.Tensor] = []  # every tensor the C struct points at, alive as long as it
        blocks = [model.block] if isinstance(model, MTPModule) else list(model.layers)
        layers = (_LayerW * len(blocks))()
        for i, b in enumerate(blocks):
            H, Hkv = b.n_heads, b.n_kv_heads
            qkv = torch.cat([permute_rope(b.q_proj.weight, H), permute_rope(b.k_proj.weight, Hkv), b.v_proj.weight])
            mats = [qkv, b.o_proj.weight, torch.cat([b.gate_proj.weight, b.up_proj.weight]), b.down_proj.weight]
            norms = [w.weight.detach().float().contiguous() for w in (b.input_layernorm, b.post_attention_layernorm)]
            self.keep += norms
            layers[i] = _LayerW(*[self._mat(w, f"layer {i}") for w in mats], *[w.data_ptr() for w in norms])
        n_layers = c.n_layers if not self.mtp else 1
        mw = _ModelW(n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.hidden_dim, c.vocab_size, c.norm_eps)
        mw.layers = ctypes.cast(layers, ctypes.c_void_p)
        # a chain's head rows in panels, by ids (held, so that their id stays theirs); a draft's
        # whole head is the one its passes read
        self._heads: dict[int, tuple[torch.Tensor | None, _Mat]] = {}
        if isinstance(model, MTPModule):
            table = model.token_table(target.embed_tokens.weight).detach().contiguous()
            g_h = model.hnorm.weight.detach().float().contiguous()
            self.keep += [table, g_h]
            mw.wh = self._mat(model.eh_proj.weight[:, : c.dim], "eh_proj")  # [d, d]: the h half
            mw.table, mw.g_h = table.data_ptr(), g_h.data_ptr()
        else:
            embed = half_exact(model.embed_tokens.weight, "embed_tokens")
            g = model.norm.weight.detach().float().contiguous()
            self.keep += [embed, g]
            mw.head = self._mat(model.head_weight, "head")
            mw.embed, mw.g_final = embed.data_ptr(), g.data_ptr()
            self._heads[id(None)] = (None, mw.head)
        self.layers_c, self.mw = layers, mw
        self.cfg = c
        self._scratch: dict[tuple[int, int, int], torch.Tensor] = {}  # by (T, threads, extra floats)
        self._batch_scratch = torch.empty(0)  # a batch pass's (`batch`), for its largest batch so far
        # The head and final norm a chain of guesses reads (`chain`): the target's for the MTP
        # module, a draft's own; packed at the chain's first call, per cut of the head.
        self.head_src = own.head_weight.detach()
        self.g_final = own.norm.weight.detach().float().contiguous()

    def _mat(self, w: torch.Tensor, name: str) -> _Mat:
        """W [out, in] in panels, held: float16 (refused if not float16-exact), or int8 (`int8`)."""
        if self.int8:
            q, scale = panels8(w, self.width)
            self.keep += [q, scale]
            return _Mat(q.data_ptr(), scale.data_ptr())
        h = panels(w, name, self.width)
        self.keep.append(h)
        return _Mat(h.data_ptr(), None)

    def trig(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, P] of a pass's new positions, start .. length - 1."""
        return self.rope[0][start:length], self.rope[1][start:length]

    def step_for(self, start: int, length: int, head: bool, last: bool) -> StepFn | None:
        """The step for a pass over positions start .. length - 1 whose past is one view of the slab;
        None for a pass longer than MAX_T or past the context (the slab holds a page more, but the rope
        tables stop there and a step checks no shapes)."""
        if start < 0 or length > self.positions:
            return None
        return self.get(length - start, head, last)

    def get(self, T: int, head: bool, last: bool) -> StepFn | None:
        if T > MAX_T:
            return None
        if self.mtp:
            return lambda h, tokens, cos, sin, past: self._run(tokens, h, cos, sin, past, False, last)
        return lambda tokens, cos, sin, past: self._run(tokens, None, cos, sin, past, head, last)

    def _need(self, T: int, threads: int) -> int:
        """Floats of smallem_step's scratch for a pass over T tokens."""
        c = self.cfg
        Q, F = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.hidden_dim
        return T * (c.dim + Q + c.n_heads * c.head_dim + 3 * F) + threads * self.score_rows * (self.positions + T + 8)

    def _scratch_for(self, T: int, threads: int, more: int = 0) -> torch.Tensor:
        """The C code's scratch for a pass over T tokens (plus `more` floats), made once per size."""
        key = (T, threads, more)
        if key not in self._scratch:
            self._scratch[key] = torch.empty(self._need(T, threads) + more)
        return self._scratch[key]

    def chain(
        self,
        ids: torch.Tensor | None,
        k: int,
        view: torch.Tensor,
        L: int,
        start: torch.Tensor | tuple[torch.Tensor, torch.Tensor | None],
        inv_t: float | None = None,
        u: torch.Tensor | None = None,
        penalty: Penalty | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A proposer's chain (`smallem_chain`): k guesses, with the head cut to `ids` (None: whole).
        `start`: the state [1, d] guess 1 is made from (the MTP module's, or a draft's final state), or
        the entries a round confirmed, fed first: (tokens [m], the MTP module's target states [m, d] or
        None), their K/V kept at L .. L+m-1. `view` [layers, 2, Hkv, >= L+m+k-1, D]: the model's cache,
        positions L.. reserved. Greedy -> (tokens [k], their probabilities [k]); sampled (1/T, float64
        uniforms u [k]) -> (tokens [k], q [k, V], zero outside a cut head). `penalty`: `verify.Penalty`."""
        assert k >= 1
        if id(ids) not in self._heads:  # the cut head's rows, in panels, once per head
            rows = self.head_src if ids is None else self.head_src[ids]
            self._heads[id(ids)] = (ids, self._mat(rows, "the proposer's head"))
        ids_t, rows = self._heads[id(ids)]
        c, threads = self.cfg, torch.get_num_threads()
        N = c.vocab_size if ids_t is None else ids_t.numel()
        if isinstance(start, tuple):
            out, (feed, feed_h) = None, start
            feed, feed_h = feed.contiguous(), None if feed_h is None else feed_h.contiguous()
            m = feed.shape[0]
        else:
            out, feed, feed_h, m = start.contiguous(), None, None, 0
        T = max(m, 1)  # the widest step of the call
        need = self._need(T, threads)
        more = 3 * c.dim + N + m * c.dim
        scratch = self._scratch_for(T, threads, more)
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
        row = self._rope_row  # cos, sin from position L: by address
        strides = (ctypes.c_int64 * 4)(*view.stride()[:4])
        self.lib.smallem_chain(
            ctypes.addressof(self.mw), rows.w, rows.scale, N, self.g_final.data_ptr(), ptr(ids_t), ptr(out),
            ptr(feed), ptr(feed_h), m, k, self.rope[0].data_ptr() + L * row, self.rope[1].data_ptr() + L * row,
            view.data_ptr(), ctypes.addressof(strides), L, ptr(u), 0.0 if inv_t is None else inv_t,
            tokens.data_ptr(), tops.data_ptr(), ptr(q), scratch.data_ptr(), need, threads,
            ptr(seen), 1.0 if penalty is None else penalty.factor, ptr(mark),
        )  # fmt: skip
        return (tokens, q) if q is not None else (tokens, tops)

    def batch(
        self, tokens: torch.Tensor, h: torch.Tensor | None, slab: torch.Tensor, b: BatchStep, head: str = "none"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A pass over a flat batch (`smallem_batch_step`): tokens [N] (and the MTP module's target
        states h [N, d]) at `b`'s positions, K/V written into `slab` [L, 2, Hkv, slots, D] at b.slots,
        each row attending to what its mask shows (`batch.visible`). head: "all" rows, each sequence's
        "last", or "none" (`forward.transformer_pass`'s) -> (logits [N, V], [B, V] or [0, V], hidden [N, d])."""
        c, threads = self.cfg, torch.get_num_threads()
        N = tokens.shape[0]
        vis, first, count = (t.contiguous() for t in visible(b))
        keys = int(count.max())
        cos, sin = self.rope[0][b.positions], self.rope[1][b.positions]  # [N, P]
        rows = b.last.contiguous() if head == "last" else None  # gathered; "all": the last N rows are all
        R = 0 if head == "none" or self.mtp else N if head == "all" else len(b.counts)
        x, logits = torch.empty(N, c.dim), torch.empty(R, c.vocab_size)
        h = None if h is None else h.contiguous()  # held here: the C code reads it
        tokens, slots = tokens.contiguous(), b.slots.contiguous()
        assert slab.is_contiguous() and keys <= self.positions + N
        need = self._need(N, threads)
        if self._batch_scratch.numel() < need:  # one buffer for every batch size, grown as needed
            self._batch_scratch = torch.empty(need)
        scratch = self._batch_scratch
        strides = (ctypes.c_int64 * 4)(*slab.stride()[:4])
        self.lib.smallem_batch_step(
            ctypes.addressof(self.mw), tokens.data_ptr(), ptr(h), N, cos.data_ptr(), sin.data_ptr(), slab.data_ptr(),
            ctypes.addressof(strides), slots.data_ptr(), vis.data_ptr(), first.data_ptr(), count.data_ptr(), keys,
            x.data_ptr(), logits.data_ptr(), R, ptr(rows), scratch.data_ptr(), threads, None,
        )  # fmt: skip
        return logits, x

    def _run(
        self,
        tokens: torch.Tensor,
        h: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past: torch.Tensor,
        head: bool,
        last: bool,
    ) -> tuple[torch.Tensor, ...]:
        c = self.cfg
        T, S = tokens.shape[0], past.shape[3]
        L = 1 if self.mtp else c.n_layers
        threads = torch.get_num_threads()
        scratch = self._scratch_for(T, threads)
        x = torch.empty(T, c.dim)
        # the new K/V [L, 2, Hkv, T, D]: in the slab, right after the past, which must hold them
        at = past.storage_offset() + S * past.stride(3)
        dims = zip(past.shape[:3], past.stride()[:3], strict=True)
        reach = at + sum((n - 1) * s for n, s in dims) + (T - 1) * past.stride(3) + c.head_dim
        if reach > past.untyped_storage().nbytes() // past.element_size():  # the C code would write past the slab
            raise ValueError(f"no room in the slab for {T} positions after a past of {S}")
        new = past.as_strided((L, 2, c.n_kv_heads, T, c.head_dim), past.stride(), at)
        t_head = (1 if last else T) if head else 0
        logits = torch.empty(t_head, c.vocab_size)
        top = torch.empty(t_head + 1, dtype=torch.long) if t_head else None  # each row's argmax, the finite flag
        assert past.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous() and tokens.is_contiguous()
        strides = (ctypes.c_int64 * 4)(*past.stride()[:4])
        h = None if h is None else h.contiguous()  # held here: the C code reads it
        self.lib.smallem_step(
            ctypes.addressof(self.mw), tokens.data_ptr(), ptr(h), T, cos.data_ptr(), sin.data_ptr(), past.data_ptr(),
            ctypes.addressof(strides), S, x.data_ptr(), logits.data_ptr(), t_head, new.data_ptr(),
            ctypes.addressof(strides), scratch.data_ptr(), threads, ptr(top),  # new's strides: the slab's too
        )  # fmt: skip
        out = x[-1:] if last else x
        if self.mtp:
            return out, new
        if top is None:  # no head (or no row of it)
            return x[:0], out, new
        return logits, out, new, top


# re-exported: the engine calls native.verify_sample and native.penalize_argmax
from .sampled import penalize_argmax as penalize_argmax  # noqa: E402
from .sampled import verify_sample as verify_sample  # noqa: E402
