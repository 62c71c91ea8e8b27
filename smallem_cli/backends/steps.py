"""Which decode step a pass runs: the native engine's, or eager (None).

A model may hold native steps beside its eager path: `model.native` (`native/`, the float16
kernels) and `model.native_avx2` (their AVX2 build, beside the AVX-512 one, to compare). Both
take the same inputs (tokens or the MTP's states, the rope rows of the new positions, the past
as a view of the slab), write the new K/V into the slab right after the past they read (the
caller reserved those positions) and return them as a view there, so every caller asks here for
the one that is switched on (`switch`, below) and runs it the same way. A pass with a head
returns one more tensor, [rows + 1] long: each row's argmax, then 1 if every logit is finite
(a greedy verification reads it, and runs no reduction of its own over the logits).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from ..model.cache import PagedKVCache, Step

StepFn = Callable[..., tuple[torch.Tensor, ...]]
_ALL: weakref.WeakSet[Any] = weakref.WeakSet()  # every model's steps, both builds (`switch`)


class Steps(Protocol):
    """What `native.NativeSteps` offers."""

    kind: str  # "native" or "native-avx2": the engine that `switch` turns on
    enabled: bool
    positions: int  # the context: no pass may reach past it
    min_past: int  # the shortest past a step serves

    def get(self, T: int, head: bool, last: bool) -> StepFn | None: ...

    def trig(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def register(steps: Steps) -> None:
    _ALL.add(steps)


def switch(engine: str | None) -> None:
    """Turn on one engine's steps in every model of this process ("eager": none of them), or
    with None all of them (a model with both runs the widest). Bench: every engine, one run."""
    for steps in list(_ALL):
        steps.enabled = engine is None or steps.kind == engine


def active_steps(model: object) -> Steps | None:
    """The steps switched on for this model (the widest build first), or None: eager."""
    for steps in (getattr(model, "native", None), getattr(model, "native_avx2", None)):
        if steps is not None and steps.enabled:
            return steps
    return None


def compiled_step(steps: Steps | None, cache: PagedKVCache, step: Step, head: bool, last: bool) -> StepFn | None:
    """The step for this pass of a sequence of `cache`, or None (eager): its pages must lie as
    one view of the slab (consecutive), and `compiled_for` must find a step."""
    if step.view is None:
        return None
    return compiled_for(steps, step.start, step.length, head, last)


def compiled_for(steps: Steps | None, start: int, length: int, head: bool, last: bool) -> StepFn | None:
    """The step for a pass over positions start .. length - 1, or None (eager) when there is
    none or it cannot serve it: a step needs a past of at least `steps.min_past` positions
    (laid out as one view: the caller checks) and positions inside the context (the slab holds
    a page more, but past the context the rope tables run short, and a step checks no shapes:
    it would read out of bounds)."""
    if steps is None or not steps.enabled or start < steps.min_past or length > steps.positions:
        return None
    return steps.get(length - start, head, last)
