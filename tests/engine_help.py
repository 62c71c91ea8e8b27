"""What several test files build the same way: a loaded proposer from test models, the backend
that runs them, a pass of one sequence over its past (the engine's own layout), and a model's
reference logits over a whole sequence (the training path)."""

from __future__ import annotations

import copy

import pytest
import torch

from smallem_cli.backends import native
from smallem_cli.backends.engines import Backend
from smallem_cli.engine.family import NONE, LoadedProposer
from smallem_cli.engine.forward import slab_for, transformer_pass
from smallem_cli.engine.target import TargetRunner
from smallem_cli.kv.pool import PagePool, pages_for
from smallem_cli.kv.step import build
from smallem_cli.model.llama import MTPModule, Transformer
from smallem_cli.spec.head import Head


def proposer(
    kind: str,
    target: Transformer | None = None,
    model: Transformer | MTPModule | None = None,
    vocab: torch.Tensor | None = None,
) -> LoadedProposer:
    """ "none", "ngram", "draft" (a draft `model`), "mtp" (an MTP `model` over `target`), or
    "ngram+draft" / "ngram+mtp": the loaded proposer, as `family.load_proposer` makes it."""
    if kind == "none":
        return NONE
    lookup = "ngram" if kind.startswith("ngram") else ""
    base = kind.removeprefix("ngram").removeprefix("+")
    if not base:
        return LoadedProposer("ngram", lookup="ngram")
    assert model is not None
    model.pack()
    if base == "mtp":
        assert target is not None and isinstance(model, MTPModule)
        return LoadedProposer(kind, model, Head(target.pack(), vocab), lookup=lookup)
    assert isinstance(model, Transformer)
    return LoadedProposer(kind, model, Head(model, vocab), lookup=lookup)


def backend(name: str, target: Transformer, *models: Transformer | MTPModule, int8: bool = False) -> Backend:
    """A backend named `name` ("eager", "native", "native-avx2"), prepared for these models."""
    b = Backend(name)
    b.prepare(target.pack(), list(models), None, list(models) if int8 else [])
    return b


def reference_logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """logits [T, V] of tokens [T] through the training path: whole-sequence causal attention."""
    with torch.inference_mode():
        return model.logits(model.hidden(tokens[None]))[0]


def sequence_pass(
    model: Transformer, past: torch.Tensor, new: torch.Tensor, steps: object = None, head: str = "all"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `new` tokens' pass after `past` has been through the model, one sequence in a pool of
    its own (pages in order): with native `steps` (`Backend.steps`) the native passes, else eager
    -> (logits, hidden [len(new), d])."""
    n = past.shape[0] + new.shape[0]
    pool = PagePool(pages_for(n, 16) + 1, 16)
    pool.add(0)
    pool.reserve(0, n)
    t = TargetRunner(model.pack(), slab_for(model, pool.n_pages * 16, past.device), pool, steps)  # type: ignore[arg-type]
    with torch.inference_mode():
        if past.shape[0]:
            transformer_pass(
                model, t.slab, past, build([pool.tables[0]], [0], [past.shape[0]], 16, past.device), "none", t.steps
            )
        b = build([pool.tables[0]], [past.shape[0]], [new.shape[0]], 16, past.device)
        return transformer_pass(model, t.slab, new, b, head, t.steps)


def halved(model: Transformer | MTPModule) -> Transformer | MTPModule:
    """A copy whose weights are float16 values (as a checkpoint's, which the native kernels read
    as they are), packed again."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.half().float())
    return m.pack()


def spy_native(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The tokens of every native batch pass (`NativeSteps.batch`) run from now on."""
    calls: list[int] = []
    real = native.NativeSteps.batch

    def spy(self: native.NativeSteps, tokens: torch.Tensor, *a: object, **kw: object) -> object:
        calls.append(int(tokens.shape[0]))
        return real(self, tokens, *a, **kw)

    monkeypatch.setattr(native.NativeSteps, "batch", spy)
    return calls
