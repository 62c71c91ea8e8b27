"""The MTP module's greedy chain of guesses as one compiled graph.

A round's guesses run one after the other: the head picks guess 1 from the module's state
after its catch-up, then each further guess feeds the last one back through the module's
block. Step by step, each guess costs a compiled step call, a cache append and write,
rotary slices, a head product and an argmax, each a round trip through Python: on this
CPU that overhead was more than the block's own arithmetic. Here the k heads and the k-1
chained steps are one graph:

    inputs   out [1, d] (the module's state after the catch-up), cos, sin [k-1, P] of the
             chained positions, past [1, K or V, kv heads, S, D] (the module's cache, read only)
    outputs  guesses [k], long, and the module's probability of each [k] (its top
             probability: how sure it was, for adaptive depth's p-min)

The chained entries' K/V never reach the cache: they live inside the graph and die with
it, as they do on the eager path, where `MTPProposer.accept` drops them (only the target's
true states are kept). With adaptive depth the whole chain runs and the guesses after
the first doubtful one are dropped on the host: one sync a round, where the step-by-step
loop syncs at every guess.

Sampled (`MTPSampledChain`, at the temperature alone: a proposer's q ignores top-k, top-p
and min-p, `verify.proposal`), each guess is drawn inside the graph by `verify.pick` (the
inverse CDF) on uniform draws u [k] made outside from the run's generator, as `verify.sample`
draws them; the graph returns the guesses and the distributions q [k, N] they were drawn
from, which verification needs.

The native engine runs a proposer's chain as one C++ call instead (`NativeSteps.chain`, for
the MTP module and for drafts); `native_chain` and `run_chain` below reserve its positions
and read its guesses, for either proposer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .cache import PagedKVCache
from .graphs import MTPStep, _rope, unit_rms
from .model import MTPModule, Transformer
from .native import MAX_T, NativeSteps
from .steps import active_steps
from .verify import Penalty, Warper, pick, uniforms

if TYPE_CHECKING:
    from .proposers import Head, Warp


class MTPChain(MTPStep):
    """k greedy guesses: head(out) -> x_1; step(out, x_1) -> out_2; head(out_2) -> x_2; ...

    The module's buffers are `MTPStep`'s (its token table, its h projection, its block), plus
    the proposer's head.
    """

    def __init__(self, mtp: MTPModule, embed: torch.Tensor, head_w: torch.Tensor, ids: torch.Tensor | None, k: int):
        super().__init__(mtp, embed, last=True)
        self.k = k
        self.register_buffer("head_w", head_w)  # [d, N]: the proposer's head (maybe cut to N rows)
        self.register_buffer("ids", ids if ids is not None else torch.arange(head_w.shape[1]))  # [N] -> token id

    def pick(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """State [1, d] -> (token [1], its probability [1]) under the (final-normed) head."""
        logits = unit_rms(x, self.eps) @ self.head_w  # [1, N]
        top, i = torch.softmax(logits, dim=-1).max(-1)
        return self.ids[i], top

    def step(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past: torch.Tensor, chain: list[torch.Tensor]
    ) -> torch.Tensor:
        """One token [1, d] at the chain's next position: attends to the past and to the chain
        so far (`chain` gets its K/V, [K or V, Hkv, D]) -> [1, d]. `_Layer.forward` with the
        chain's entries as keys beside the past's, never concatenated with it (a copy of the
        past per guess)."""
        L = self.layer
        H, Hkv, D = L.n_heads, L.n_kv_heads, L.head_dim
        G = H // Hkv
        y = _rope(unit_rms(x, L.eps) @ L.qkv, cos, sin)  # [1, (H+2Hkv)*D]
        chain.append(y[0, H * D :].view(2, Hkv, D))
        kv = torch.stack(chain, dim=2)  # [K or V, Hkv, i, D]: this chain's entries, itself last
        q = y[0, : H * D].view(Hkv, G, 1, D)
        s_past = (q * past[0][:, None]).sum(-1)  # [Hkv, G, S]
        s_new = (q * kv[0][:, None]).sum(-1)  # [Hkv, G, i]
        S = past.shape[2]
        p = torch.softmax(torch.cat([s_past, s_new], dim=-1), dim=-1)  # [Hkv, G, S+i]
        o = (p[..., :S, None] * past[1][:, None]).sum(-2) + (p[..., S:, None] * kv[1][:, None]).sum(-2)  # [Hkv, G, D]
        x = x + o.reshape(1, H * D) @ L.o
        gu = unit_rms(x, L.eps) @ L.gu  # [1, 2F]
        f = gu.shape[-1] // 2
        return x + (F.silu(gu[:, :f]) * gu[:, f:]) @ L.down

    def run(
        self,
        out: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past: torch.Tensor,
        pick: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The chain from state out [1, d]: pick(i, state) -> (guess i [1], what goes with it [1, ...]),
        each guess fed back as the pair (state, guess) -> (guesses [k], the picks' companions, stacked)."""
        guesses, extras, chain = [], [], []
        for i in range(self.k):
            if i:
                x = F.embedding(guesses[-1], self.table) + unit_rms(out, self.eps) @ self.proj_h  # [1, d]
                out = self.step(x, cos[i - 1 : i], sin[i - 1 : i], past[0], chain)
            tok, extra = pick(i, out)
            guesses.append(tok)
            extras.append(extra)
        return torch.cat(guesses), torch.cat(extras)

    def forward(  # type: ignore[override]
        self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """out [1, d] -> (guesses [k], the module's probability of each [k])."""
        return self.run(out, cos, sin, past, lambda _, state: self.pick(state))


class MTPSampledChain(MTPChain):
    """k sampled guesses: q_j = softmax(head(out_j) / T), x_j = pick(q_j, u_j)."""

    def forward(  # type: ignore[override]
        self,
        out: torch.Tensor,
        inv_temperature: torch.Tensor,
        u: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """out [1, d], inv_temperature [1], u [k] float64 -> (guesses [k], q [k, N])."""

        def draw(i: int, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q = torch.softmax(unit_rms(state, self.eps) @ self.head_w * inv_temperature, dim=-1)  # [1, N]
            return self.ids[pick(q, u[i : i + 1])], q

        return self.run(out, cos, sin, past, draw)


Start = torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]  # `NativeSteps.chain`'s `start`


def native_chain(
    model: Transformer | MTPModule,
    cache: PagedKVCache,
    seq: int,
    head: Head,
    k: int,
    start: Start,
    penalty: Penalty | None = None,
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """The native engine's chain of k guesses for a proposer's model (`NativeSteps.chain`,
    greedy or sampled) from `start`: a state [1, d], or the entries the round confirmed (tokens
    [m], the MTP module's target states or None), fed in the same call; each guess scored with
    the repetition `penalty` where given. Their m positions and the chain's k-1 are appended to
    the model's cache (the caller keeps or drops the chain's). None: no native steps, or a
    cache it cannot serve."""
    steps, L = active_steps(model), cache.length(seq)
    m = start[0].shape[0] if isinstance(start, tuple) else 0
    if k < 1 or not isinstance(steps, NativeSteps) or L < steps.min_past or L + m + k - 1 > steps.positions:
        return None
    if isinstance(start, tuple) and not 0 < m <= MAX_T:  # no catch-up, or one longer than a native pass serves
        return None
    where = cache.append(seq, m + k - 1)
    if where.view is None:  # pages out of order: the step-by-step path
        cache.keep(seq, L)
        return None
    view = where.view
    return lambda *sampled: steps.chain(head.ids, k, view, L, start, *sampled, penalty=penalty)


def run_chain(
    chain: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    head: Head,
    k: int,
    warp: Warp | None,
    generator: torch.Generator | None,
    p_min: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chain's k guesses (its start and penalty bound): greedy (cut at the first guess less sure
    than p_min: one sync), or sampled at the warp's temperature alone (q over the vocabulary)."""
    if warp is None:
        tokens, tops = chain()
        if p_min:  # keep the guesses before the first doubtful one: one sync
            sure = [t >= p_min for t in tops.tolist()]
            tokens = tokens[: sure.index(False) if False in sure else k]
        return tokens, None
    assert isinstance(warp, Warper)
    tokens, q = chain(1.0 / warp.temperature, uniforms((k,), generator, head.w))
    return tokens, head.expand(q)


def chains(warp: Warp | None, p_min: float) -> bool:
    """Whether a chain can draw this round's guesses: greedy, or sampled (at the temperature
    alone: `verify.proposal`) without p-min."""
    return warp is None or (isinstance(warp, Warper) and not p_min)
