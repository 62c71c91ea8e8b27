"""A proposer's chain of k guesses in one native call (`NativeSteps.chain`, for the MTP module
and for drafts): `native_chain` reserves its positions in the proposer's cache, `run_chain` reads
its guesses.

Step by step, each guess costs a step call, a cache append and write, rotary slices, a head
product and an argmax, each a round trip through Python: on a CPU that overhead was more than
a small block's own arithmetic. In one call the chained entries' K/V are written after the true
states, and the proposer drops them once the target has computed the real states for their
positions (`accept`). With adaptive depth the whole chain runs and the guesses after the first
doubtful one are dropped on the host: one sync a round, where the step-by-step loop syncs at
every guess.

Sampled, at the temperature alone (a proposer's q ignores top-k, top-p and min-p,
`verify.proposal`), each guess is drawn inside the call on uniform draws u [k] made outside
from the run's generator, as `verify.sample` draws them; the call returns the guesses and the
distributions q [k, N] they were drawn from, which verification needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..backends.native import MAX_T, NativeSteps
from ..backends.steps import active_steps
from ..model.cache import PagedKVCache
from ..model.llama import MTPModule, Transformer
from .verify import Penalty, Warper, uniforms

if TYPE_CHECKING:
    from .head import Head
    from .verify import Warp


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
