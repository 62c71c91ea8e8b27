"""Which decode step a pass runs: the native engine's, the compiled engine's, or eager (None).

A model may hold steps beside its eager path: `model.native` (`native/`, the
float16 kernels; `model.native_avx2` their AVX2 build, beside the AVX-512 one, to compare) and
`model.compiled` (`aot.py`, inductor's graphs). All take the same
inputs (tokens or the MTP's states, the rope rows of the new positions, the past as a view
of the slab) and return the new K/V (for the caller to write, unless the steps write them in
place: `in_place`), so every caller asks here for the one that is switched on (`switch`,
below) and runs it the same way. A native pass with a
head returns one more tensor, [rows + 1] long: each row's argmax, then 1 if every logit is
finite (a greedy verification reads it, and runs no reduction of its own over the logits).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from .cache import PagedKVCache, Step

MIN_PAST = 2  # a step needs this many past positions (the graphs' tracer special-cases sizes 0 and 1)
StepFn = Callable[..., tuple[torch.Tensor, ...]]
_ALL: weakref.WeakSet[Any] = weakref.WeakSet()  # every model's steps, both engines (`switch`)


class Steps(Protocol):
    """What `aot.CompiledSteps` and `native.NativeSteps` both offer."""

    kind: str  # "compiled", "native" or "native-avx2": the engine that `switch` turns on
    enabled: bool
    positions: int  # the context: no pass may reach past it
    slab_shape: tuple[int, ...] | None  # the slab layout the steps need, None: any
    min_past: int  # the shortest past a step serves (MIN_PAST for graphs, 0 for native steps)
    # the steps write the new K/V into the slab themselves, right after the past they read (the
    # caller reserved those positions), and return them as a view there: native steps. Else
    # (graphs: the cache is read-only inside them) the caller writes what they return.
    in_place: bool

    def get(self, T: int, head: bool, last: bool) -> StepFn | None: ...

    def trig(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def register(steps: Steps) -> None:
    _ALL.add(steps)


def switch(engine: str | None) -> None:
    """Turn on one engine's steps in every model of this process ("eager": none of them), or
    with None all of them (a model with both runs the native ones). Bench: every engine, one run."""
    for steps in list(_ALL):
        steps.enabled = engine is None or steps.kind == engine


def active_steps(model: object) -> Steps | None:
    """The steps switched on for this model (the native engine's first), or None: eager."""
    for steps in (
        getattr(model, "native", None),
        getattr(model, "native_avx2", None),
        getattr(model, "compiled", None),
    ):
        if steps is not None and steps.enabled:
            return steps
    return None


def whole_context(steps: Steps | None, n_pages: int, page_size: int) -> int:
    """Pages of a cache for steps built for one slab layout: the whole context (else n_pages)."""
    if steps is None or steps.slab_shape is None:
        return n_pages
    return max(n_pages, steps.slab_shape[-2] // page_size)


def compiled_step(steps: Steps | None, cache: PagedKVCache, step: Step, head: bool, last: bool) -> StepFn | None:
    """The step for this pass of a sequence of `cache`, or None (eager): its pages must lie as
    one view of the slab (consecutive), and `compiled_for` must find a step."""
    if step.view is None:
        return None
    return compiled_for(steps, tuple(cache.kv.shape), step.start, step.length, head, last)


def compiled_for(
    steps: Steps | None, slab_shape: tuple[int, ...], start: int, length: int, head: bool, last: bool
) -> StepFn | None:
    """The step for a pass over positions start .. length - 1, or None (eager) when there is
    none or it cannot serve it.

    A compiled graph assumes the slab layout it was built for; a step needs a past of at
    least `steps.min_past` positions (laid out as one view: the caller checks) and positions inside
    the context (the slab holds a page more, but past the context the rope tables run short,
    and a step checks no shapes: it would read out of bounds).
    """
    if steps is None or not steps.enabled or start < steps.min_past or length > steps.positions:
        return None
    if steps.slab_shape is not None and slab_shape != steps.slab_shape:
        return None
    return steps.get(length - start, head, last)
