"""A Llama-style decoder and the MTP module. Training runs `Transformer.hidden`; inference runs the
engine's passes on the weights `pack()` lays out. Parameter names follow Hugging Face's Llama."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .weights import Weights, interleave_halves


def rope_tables(cfg: ModelConfig, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_seq_len, head_dim / 2], the angle of each pair (i, i + D/2) of Llama's rotate-half layout;
    `local`: the local layers' (their own base, unscaled, as Gemma 3's)."""
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    # on the CPU whatever the default device: a model built on the meta device (`stored`) gets its real tables
    inv = 1.0 / theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64, device="cpu") / cfg.head_dim)
    if cfg.rope_freqs and not local:  # each pair's frequency divided by its factor (linear: all alike; llama3: by band)
        inv = inv / torch.tensor(cfg.rope_freqs, dtype=torch.float64, device="cpu")
    ang = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64, device="cpu"), inv)
    return ang.cos().float(), ang.sin().float()


def rope_rows(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """A model's cos, sin [max_seq_len, D/2], the local layers' below them where it has some (one table each, which
    the native engine reads as it is)."""
    if not cfg.local_layers:
        return rope_tables(cfg)
    (c, s), (cl, sl) = rope_tables(cfg), rope_tables(cfg, local=True)
    return torch.cat([c, cl]), torch.cat([s, sl])


def llama3_freqs(
    theta: float, head_dim: int, factor: float, low: float, high: float, original: float
) -> tuple[float, ...]:
    """`ModelConfig.rope_freqs` of Llama 3's rule (transformers' and llama.cpp's): wavelengths past original / low
    slowed by `factor`, those under original / high kept, a linear blend of the two speeds between."""
    wavelens = [2 * math.pi * theta ** (i / head_dim) for i in range(0, head_dim, 2)]
    blends = [min(max((original / w - low) / (high - low), 0.0), 1.0) for w in wavelens]
    return tuple(1 / ((1 - s) / factor + s) for s in blends)


def llama3_params(cfg: ModelConfig) -> tuple[float, float, float, int] | None:
    """(factor, low, high, original) whose `llama3_freqs` are `cfg.rope_freqs`, or None. The rule depends on
    original / low and high / low only, so low is 1; between the bands the blend (1/f - 1/factor) / (1 - 1/factor)
    is a * inv_freq - b, with b = 1 / (high - 1) and a / b = original / 2pi."""
    f = cfg.rope_freqs
    top, inv = max(f, default=1.0), [cfg.rope_theta ** (-i / cfg.head_dim) for i in range(0, cfg.head_dim, 2)]
    mid = [(x, (1 / r - 1 / top) / (1 - 1 / top)) for x, r in zip(inv, f, strict=True) if 1 < r < top]
    if len(mid) < 2 or mid[0][0] == mid[-1][0]:
        return None
    (x0, s0), (x1, s1) = mid[0], mid[-1]
    a = (s1 - s0) / (x1 - x0)
    b = a * x0 - s0
    if not (a > 0 and b > 0 and math.isfinite(a / b)):
        return None
    found = top, 1.0, round(1 + 1 / b, 6), round(2 * math.pi * a / b)
    again = llama3_freqs(cfg.rope_theta, cfg.head_dim, *found)
    return found if all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(again, f, strict=True)) else None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos, sin: [T, D/2] for the tokens' positions."""
    half = x.shape[-1] // 2
    x1, x2, c, s = x[..., :half], x[..., half:], cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def attn_scale(cfg: ModelConfig) -> float:
    return cfg.attn_scale or cfg.head_dim**-0.5


def gated(gate: torch.Tensor, up: torch.Tensor, geglu: bool) -> torch.Tensor:
    """The MLP's inner rows: silu(gate) * up, or Gemma's gelu (tanh approximation) * up."""
    return (F.gelu(gate, approximate="tanh") if geglu else F.silu(gate)) * up


class Block(nn.Module):
    """Pre-norm attention + gated MLP (SwiGLU, or Gemma's GeGLU with norms on both outputs). `pack` folds all it can
    into single [in, out] matmuls (F.linear takes a slow small-M path) and one complex multiply for rope: every op of
    a small model costs microseconds. A local layer (`ModelConfig.local_layers`) sees the last `window` keys only."""

    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        d, hd = cfg.dim, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, hd
        self.eps, self.scale, self.geglu = cfg.norm_eps, attn_scale(cfg), cfg.geglu
        self.window = cfg.sliding_window if index in cfg.local_layers else 0  # 0: every key
        self.input_layernorm = RMSNorm(d, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(d, cfg.norm_eps)
        self.q_proj = nn.Linear(d, cfg.n_heads * hd, bias=cfg.attn_bias)
        self.k_proj = nn.Linear(d, cfg.n_kv_heads * hd, bias=cfg.attn_bias)
        self.v_proj = nn.Linear(d, cfg.n_kv_heads * hd, bias=cfg.attn_bias)
        # Qwen3's: each head of q and of k normed (over head_dim) before rope
        self.q_norm = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None
        self.o_proj = nn.Linear(cfg.n_heads * hd, d, bias=False)
        self.gate_proj = nn.Linear(d, cfg.hidden_dim, bias=False)
        self.up_proj = nn.Linear(d, cfg.hidden_dim, bias=False)
        self.down_proj = nn.Linear(cfg.hidden_dim, d, bias=False)
        self.attn_output_norm = RMSNorm(d, cfg.norm_eps) if cfg.output_norms else None
        self.mlp_output_norm = RMSNorm(d, cfg.norm_eps) if cfg.output_norms else None
        self.packed: dict[str, torch.Tensor] | None = None

    def pack(self) -> None:
        """The inference weights (the parameters stay as they are, for export)."""
        D, order = self.head_dim, interleave_halves(self.head_dim)
        with torch.no_grad():
            ln1 = self.input_layernorm.weight[:, None]  # norm weights fold into the next matmul
            ln2 = self.post_attention_layernorm.weight[:, None]
            # the attention scale goes into Wq, or into q's norm weights (a norm undoes any scale before it)
            qs = 1.0 if self.q_norm is not None else self.scale
            wq = (self.q_proj.weight.t() * ln1 * qs).unflatten(1, (-1, D))[..., order]
            wk = (self.k_proj.weight.t() * ln1).unflatten(1, (-1, D))[..., order]
            wv = self.v_proj.weight.t() * ln1  # [d, Hkv*D]
            extra: dict[str, torch.Tensor] = {}
            if self.q_proj.bias is not None:  # in the packed row's order, as the weights' columns
                bq, bk = (p.bias.view(-1, D)[:, order].flatten() for p in (self.q_proj, self.k_proj))
                extra["bias"] = torch.cat([bq * qs, bk, self.v_proj.bias]).contiguous()
            if self.q_norm is not None and self.k_norm is not None:
                extra["qn"], extra["kn"] = self.q_norm.weight[order] * self.scale, self.k_norm.weight[order]
            if self.attn_output_norm is not None and self.mlp_output_norm is not None:
                extra["ao"], extra["mo"] = self.attn_output_norm.weight, self.mlp_output_norm.weight
            self.packed = extra | {
                "qkv": torch.cat([wq.flatten(1), wk.flatten(1), wv], dim=1).contiguous(),  # [d, (H+2Hkv)*D]
                "o": self.o_proj.weight.t().contiguous(),  # [H*D, d]
                "gu": (torch.cat([self.gate_proj.weight, self.up_proj.weight]).t() * ln2).contiguous(),  # [d, 2F]
                "down": self.down_proj.weight.t().contiguous(),  # [F, d]
            }

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Inference: x [N, d] -> the packed QKV rows [N, (H+2Hkv)*D] before rope (biases and q/k norms applied)."""
        p = self.packed
        assert p is not None, "call pack() before decoding"
        h = unit_rms(x, self.eps)
        y = h @ p["qkv"] if "bias" not in p else torch.addmm(p["bias"], h, p["qkv"])
        if "qn" not in p:
            return y
        N, (H, Hkv, D) = x.shape[0], (self.n_heads, self.n_kv_heads, self.head_dim)
        q = unit_rms(y[:, : H * D].view(N, H, D), self.eps) * p["qn"]
        k = unit_rms(y[:, H * D : (H + Hkv) * D].view(N, Hkv, D), self.eps) * p["kn"]
        return torch.cat([q.view(N, -1), k.view(N, -1), y[:, (H + Hkv) * D :]], dim=1)

    def residual(self, x: torch.Tensor, a: torch.Tensor, w: str, norm: str) -> torch.Tensor:
        """x + a sub-layer's output a @ packed[w] (the attention's "o", the MLP's "down"), normed first by
        packed[norm] where the model norms its outputs (Gemma's "ao", "mo"), else in one addmm."""
        p = self.packed
        assert p is not None
        if norm not in p:
            return torch.addmm(x, a, p[w])
        out = a @ p[w]
        return x + F.rms_norm(out, (out.shape[-1],), p[norm], self.eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Training: x [B, T, dim] -> [B, T, dim], causal attention over the sequence (a local layer's, over its
        window)."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        h = self.input_layernorm(x)
        q, k = self.q_proj(h).view(B, T, H, D), self.k_proj(h).view(B, T, Hkv, D)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self.v_proj(h).view(B, T, Hkv, D)
        mask = None
        if self.window:  # key j seen from position i when i - window < j <= i
            i = torch.arange(T, device=x.device)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - self.window)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=mask is None,
            enable_gqa=H != Hkv, scale=self.scale,
        )  # fmt: skip
        att = self.o_proj(att.transpose(1, 2).reshape(B, T, H * D))
        x = x + (att if self.attn_output_norm is None else self.attn_output_norm(att))
        h = self.post_attention_layernorm(x)
        mlp = self.down_proj(gated(self.gate_proj(h), self.up_proj(h), self.geglu))
        return x + (mlp if self.mlp_output_norm is None else self.mlp_output_norm(mlp))


_EPS: dict[tuple[float, torch.device, torch.dtype], torch.Tensor] = {}  # `unit_rms`'s eps, as tensors


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in four ops where F.rms_norm's CPU composite costs seven (the eps
    tensor cached: a Python scalar in an in-place op costs a tensor wrap of its own)."""
    t = _EPS.get(key := (eps, x.device, x.dtype))
    if t is None:
        t = _EPS[key] = torch.tensor(eps, device=x.device, dtype=x.dtype)
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)  # [..., 1]
    return x * torch.addcmul(t, n, n, value=1.0 / x.shape[-1]).rsqrt_()


def head_matmul(x: torch.Tensor, w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [M, d] @ w [d, V], `rows` being w transposed: MKL's GEMM for a few rows against a wide matrix
    costs several times its one-row case, where the transposed product does not."""
    if x.dim() == 2 and x.shape[0] >= 3:
        return (rows @ x.t()).t().contiguous()  # [M, V]
    return x @ w


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # built on the meta device (`stored`), no init: normal_'s meta kernel imports torch._dynamo, a second or more
        shape = (cfg.vocab_size, cfg.dim)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape) if torch.empty(0).is_meta else None)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.source: Weights | None = None  # the files its weights lie in, read from there (`stored`)
        self.pack_on_load = False  # `pack` was asked for before `materialize`: it packs once they are read
        rope_cos, rope_sin = rope_rows(cfg)
        self.register_buffer("rope_cos", rope_cos, persistent=False)
        self.register_buffer("rope_sin", rope_sin, persistent=False)
        self.head_t: torch.Tensor | None = None  # [dim, vocab], set by pack()
        self.head_rows: torch.Tensor | None = None  # [vocab, dim], set by pack() (`head_matmul`)
        self.rope_packed: torch.Tensor | None = None  # complex [max_seq_len, (H+2Hkv)*D/2]
        self.rope_packed_local: torch.Tensor | None = None  # the local layers' (`ModelConfig.local_layers`)

    @classmethod
    def stored(cls, cfg: ModelConfig, weights: Weights) -> Transformer:
        """A model whose parameters stay in their files (`weights`, in their own bytes), read a tensor at a time by
        the native backend; the eager path loads them in float32 the first time it runs (`materialize`)."""
        with torch.device("meta"):  # shapes only: nothing is allocated
            model = cls(cfg)
        model.source = weights
        return model.eval()

    @property
    def cos(self) -> torch.Tensor:  # [max_seq_len, D/2]; the local layers': `cos_local`
        return self.rope_cos[: self.cfg.max_seq_len]

    @property
    def sin(self) -> torch.Tensor:
        return self.rope_sin[: self.cfg.max_seq_len]

    @property
    def cos_local(self) -> torch.Tensor:
        return self.rope_cos[-self.cfg.max_seq_len :]

    @property
    def sin_local(self) -> torch.Tensor:
        return self.rope_sin[-self.cfg.max_seq_len :]

    @property
    def lazy(self) -> bool:
        """Its parameters are still in their files (`stored`, before `materialize`)."""
        return self.embed_tokens.weight.is_meta

    @property
    def device(self) -> torch.device:
        return self.source.device if self.lazy and self.source is not None else self.embed_tokens.weight.device

    def materialize(self) -> Transformer:
        """The parameters read from `source` in float32 (4 bytes a weight: the eager path's reference, and what
        training and export read); a model already in memory as it is."""
        if self.lazy:
            assert self.source is not None
            with torch.no_grad():
                self.load_state_dict({n: self.source.floats(n) for n in self.source}, assign=True)
            self.to(self.source.device)
            if self.pack_on_load:
                self.pack()
        return self

    def eager(self) -> Transformer:
        """`materialize`d and `pack`ed: what the eager passes run."""
        return self if self.materialize().rope_packed is not None else self.pack()

    def init_weights(self, seed: int = 0) -> None:
        """GPT-2 style init; residual projections scaled down with depth."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                residual = name.endswith(("o_proj.weight", "down_proj.weight"))
                std = 0.02 / (2 * self.cfg.n_layers) ** 0.5 if residual else 0.02
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    @property
    def head_name(self) -> str:
        """The parameter its output head's rows are: the tied token embedding, or lm_head's."""
        return "embed_tokens.weight" if self.cfg.tie_embeddings else "lm_head.weight"

    def floats(self, name: str) -> torch.Tensor:
        """A parameter's values in float32, read from its file where the weights stay there (`stored`)."""
        if self.lazy and self.source is not None:
            return self.source.floats(name)
        return self.get_parameter(name).detach().float()

    @property
    def head_weight(self) -> torch.Tensor:
        """The output head's rows [vocab, dim]: the tied token embedding, or lm_head's."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack(self) -> Transformer:
        """The eager path's layout (`Block.pack`, the head with the final norm folded in, the rotary table); a `lazy`
        model's waits for `materialize`."""
        if self.lazy:
            self.pack_on_load = True
            return self
        for blk in self.layers:
            blk.pack()  # type: ignore[operator]
        # [dim, vocab], the final norm folded in
        self.head_t = (self.head_weight.detach().t() * self.norm.weight.detach()[:, None]).contiguous()
        self.head_rows = self.head_t.t().contiguous()  # [vocab, dim]: the same, for passes over a few rows
        # e^{jθ} per (position, column pair) of a packed QKV row: q's and k's pairs (i, i + D/2), v's 1 + 0j
        self.rope_packed = self._rope_rows(False)
        self.rope_packed_local = self._rope_rows(True) if self.cfg.local_layers else self.rope_packed
        return self

    def _rope_rows(self, local: bool) -> torch.Tensor:
        c = self.cfg
        cos, sin = (self.cos_local, self.sin_local) if local else (self.cos, self.sin)
        turn = torch.complex(cos, sin)  # [max_seq_len, D/2]
        ones = torch.ones_like(turn).repeat(1, c.n_kv_heads)
        return torch.cat([turn.repeat(1, c.n_heads + c.n_kv_heads), ones], dim=1)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The tokens' embedding rows, times `ModelConfig.embed_scale` where the model scales them (Gemma's)."""
        x = F.embedding(tokens, self.materialize().embed_tokens.weight)
        return x if self.cfg.embed_scale == 1.0 else x * self.cfg.embed_scale

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and output head: [..., dim] -> [..., vocab]. The MTP module shares it."""
        self.materialize()
        if self.head_t is not None and self.head_rows is not None:
            return head_matmul(unit_rms(h, self.cfg.norm_eps), self.head_t, self.head_rows)
        return F.linear(self.norm(h), self.head_weight)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """Training trunk: tokens [B, T] -> final hidden states [B, T, dim] (before the final norm)."""
        T = tokens.shape[1]
        x = self.embed(tokens)
        for blk in self.layers:
            local = blk.window > 0  # type: ignore[operator]
            x = blk(x, (self.cos_local if local else self.cos)[:T], (self.sin_local if local else self.sin)[:T])
        return x


class MTPModule(nn.Module):
    """DeepSeek-V3 multi-token prediction, token i+2 from h_i and token i+1: norm(h_i) ‖ norm(embed(t_{i+1}))
    -> linear 2d->d -> one block -> the target's final norm and head (embedding and head: the target's)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = Block(cfg)
        self.proj_t: torch.Tensor | None = None
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # (embedding, its projected rows)

    def pack(self) -> MTPModule:
        self.block.pack()
        w = torch.cat([self.hnorm.weight, self.enorm.weight]).detach()[:, None]  # norms fold in
        self.proj_t = (self.eh_proj.weight.detach().t() * w).contiguous()  # [2d, d]
        return self

    def forward(self, h: torch.Tensor, e: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Training: h, e [B, T, dim] (hidden at i, embedding of token i+1) -> hidden [B, T, dim] for token i+2."""
        x = self.eh_proj(torch.cat([self.hnorm(h), self.enorm(e)], dim=-1))
        return self.block(x, cos, sin)

    def token_table(self, embed: torch.Tensor) -> torch.Tensor:
        """norm(embed(t)) @ W_e for every token t: [vocab, dim], built once per embedding."""
        assert self.proj_t is not None, "call pack() before decoding"
        if self._table is None or self._table[0] is not embed:
            with torch.no_grad():
                self._table = embed, unit_rms(embed.detach(), self.cfg.norm_eps) @ self.proj_t[self.cfg.dim :]
        return self._table[1]
