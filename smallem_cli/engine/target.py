"""The target's side of the engine: its passes (native steps where the backend has them, else eager), the prefill,
and the per-sequence work a verdict needs beside the pass (the repetition penalty, the sampled rule)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..backends import native
from ..kv.pool import PagePool
from ..kv.step import BatchStep, build, build_tree, in_order
from ..model.llama import Transformer
from ..spec.sampling import NonFiniteError, context_mask, finite_flag, first_token
from ..spec.verify import Warp, Warper, penalize, verify_sample
from .forward import transformer_pass
from .proposers import Proposer
from .sequence import Seq


def read_back(parts: list[Tensor], flag: int) -> list[int]:
    """The round's one host sync: `parts` concatenated and read -> their values; NonFiniteError where the
    target's finite flag (`spec.sampling.finite_flag`, at index `flag`) says its logits were not."""
    values = torch.cat(parts).tolist()
    if values[flag] != 1:
        raise NonFiniteError("the target's logits are not finite (NaN or inf)")
    return values


@dataclass
class TargetRunner:
    model: Transformer
    slab: Tensor  # its K/V, over the pool's pages
    pool: PagePool
    steps: native.NativeSteps | None = None  # None: eager
    # the layers whose outputs its passes hand on as the states (the proposer's `taps`); (): the last layer's
    taps: tuple[int, ...] = ()

    def step(self, seqs: list[Seq], counts: list[int]) -> BatchStep:
        tables = [self.pool.tables[s.uid] for s in seqs]
        return build(tables, [s.cached for s in seqs], counts, self.pool.page_size, self.slab.device)

    def verify_pass(self, seqs: list[Seq], ids: Tensor, counts: list[int]) -> tuple[Tensor, Tensor, Tensor | None]:
        """ids [N] (counts[b] new tokens of seqs[b], from its cached length) -> logits [N, V], hidden
        [N, d], and from a native step each row's argmax and the finite flag [N + 1] (else None)."""
        if (got := self.one_pass(seqs, ids, counts, heads=counts[0])) is not None:
            return got
        if self.steps is not None:  # the argmaxes and the finite flag computed in the pass
            top = torch.empty(int(ids.shape[0]) + 1, dtype=torch.long)
            logits, hidden = self.steps.batch(ids, None, self.slab, self.step(seqs, counts), "all", top, self.taps)
            return logits, hidden, top
        return *transformer_pass(self.model, self.slab, ids, self.step(seqs, counts), "all", taps=self.taps), None

    def one_pass(
        self, seqs: list[Seq], ids: Tensor, counts: list[int], heads: int
    ) -> tuple[Tensor, Tensor, Tensor | None] | None:
        """`verify_pass` through the native step, for a sequence alone whose pages lie in order, logits of its last
        `heads` rows; else None."""
        if len(seqs) != 1 or self.steps is None:
            return None
        s, T = seqs[0], counts[0]
        table = self.pool.tables[s.uid]
        page = in_order(table, len(table))
        if page is None or not self.steps.serves(s.cached, s.cached + T):
            return None
        base = page * self.pool.page_size
        past = self.slab[:, :, :, base : base + s.cached]  # [L, K or V, Hkv, start, D]: a view
        logits, hidden, _, top = self.steps.step(ids.contiguous(), past, heads, self.taps)
        return logits, hidden, top

    def tree_pass(self, seqs: list[Seq], ids: Tensor, parents: list[list[int]]) -> tuple[Tensor, Tensor]:
        """A pass over each sequence's tree (nodes `parents[b]`, ids flat [N]) after its cache -> logits, hidden."""
        tables = [self.pool.tables[s.uid] for s in seqs]
        every = [list(range(len(p))) for p in parents]
        b = build_tree(tables, [s.cached for s in seqs], parents, every, self.pool.page_size, self.slab.device)
        return transformer_pass(self.model, self.slab, ids, b, "all", self.steps, self.taps)

    def move(self, s: Seq, src: list[int], dst: list[int]) -> None:
        """The K/V of `s`'s positions src moved to its positions dst (an accepted tree path follows the cache)."""
        at = [self.pool.slot(s.uid, s.cached + i) for i in src]
        to = [self.pool.slot(s.uid, s.cached + j) for j in dst]
        dev = self.slab.device
        self.slab.index_copy_(3, torch.tensor(to, device=dev), self.slab.index_select(3, torch.tensor(at, device=dev)))

    def penalize(self, rows: Tensor, s: Seq, fed: Tensor) -> tuple[Tensor, Tensor]:
        """rows [T, V] of a pass over `fed` [T] scored with `s`'s repetition penalty, each over the context up to
        its own position -> (the rows, their argmaxes [T]): with native steps in place, in one call."""
        penalty = s.req.sampling.repetition_penalty
        assert s.seen is not None
        if self.steps is not None:
            return rows, native.penalize_argmax(rows, s.seen, fed, penalty)
        rows = penalize(rows, s.seen, fed, penalty)
        return rows, rows.argmax(-1)

    def verify_sample(self, rows: Tensor, warp: Warp, drafts: Tensor, q: Tensor | None, gen: torch.Generator) -> Tensor:
        """`spec.verify.verify_sample` for one sequence: its rows [m+1, V] -> [m + 2] long: n accepted, then the
        m+1 tokens; with native steps (the temperature and the filters alone: a `Warper`) in one call."""
        if self.steps is not None and isinstance(warp, Warper):
            return native.verify_sample(rows, warp, drafts, q, gen)
        p = warp(rows)  # [m+1, V]
        n, out = verify_sample(drafts[None], (p[:0] if q is None else q)[None], p[None], gen)
        return torch.cat([n, out[0]])


def prefill(t: TargetRunner, proposer: Proposer, seqs: list[Seq]) -> list[int | None]:
    """Fill the target's cache for `seqs` -> each one's first new token (None if recomputed: already emitted)."""
    dev = t.slab.device
    fresh = [s.n_generated == 0 for s in seqs]
    fed = [
        torch.tensor(s.tokens[s.cached :] if f else s.tokens[s.cached : -1], dtype=torch.long, device=dev)
        for s, f in zip(seqs, fresh, strict=True)
    ]
    counts = [x.shape[0] for x in fed]
    got = t.one_pass(seqs, torch.cat(fed), counts, heads=1)  # a prompt alone: the model's step
    if got is not None:
        logits, hidden = got[0], got[1]  # [1, V]: the last position's alone; [N, d]
    else:  # logits [B, V] of each sequence's last position, hidden [N, d]
        logits, hidden = transformer_pass(
            t.model, t.slab, torch.cat(fed), t.step(seqs, counts), "last", t.steps, t.taps
        )
    firsts = []
    states = list(hidden.split(counts))
    for i, (s, f) in enumerate(zip(seqs, fresh, strict=True)):
        s.cached += counts[i]
        if s.req.session is not None:  # its proposer starts over the whole conversation, not this part
            s.states = [*(s.states or []), states[i].clone()]
            states[i] = torch.cat(s.states)
            fed[i] = torch.tensor(s.tokens[: s.cached], dtype=torch.long, device=dev)
        if f:  # drawn from the prompt's last logits
            s.last, s.seen = first_token(logits[i : i + 1], fed[i], s.warp, s.gen, s.req.sampling.repetition_penalty)
        else:  # recomputed: its next token was emitted before the preemption
            s.last = torch.tensor(s.tokens[-1:], dtype=torch.long, device=dev)
            if s.req.sampling.penalized:
                s.seen = context_mask(torch.tensor(s.tokens, device=dev), logits.shape[-1])
        firsts.append(s.last.view(1))
    values = read_back([*firsts, finite_flag(logits)], flag=-1)
    proposer.start(seqs, fed, states)
    return [v if f else None for v, f in zip(values[:-1], fresh, strict=True)]
