"""What a round verifies one sequence with, natively (`verify.h`): the sampled rule, and the
repetition penalty with each row's argmax; called from the engine's round."""

from __future__ import annotations

import torch

from ...spec.verify import Warper, uniforms
from . import kernels
from .kernels import ptr


def verify_sample(
    logits: torch.Tensor, warp: Warper, drafts: torch.Tensor, q: torch.Tensor | None, generator: torch.Generator | None
) -> torch.Tensor:
    """`verify.verify_sample` for one sequence after `warp`, in one call (`smallem_verify_sample`): raw
    logits [k+1, V] of the verify pass, the guesses [k] and their q [k, V] (None: no guess) -> [k + 2]
    long: n kept, then the k+1 tokens. It draws what `verify_sample` draws, in the same order."""
    lib = kernels.loaded()
    k, V = drafts.shape[0], logits.shape[-1]
    assert logits.shape[0] == k + 1 and logits.dtype == torch.float32 and logits.is_contiguous()
    u = None  # without a guess, nothing to accept: verify_sample draws only the next token
    if k:
        assert q is not None and tuple(q.shape) == (k, V)
        q, drafts = q.float().contiguous(), drafts.contiguous()
        u = torch.rand(1, k, generator=generator)  # as verify_sample's acceptance draws
    u_next = uniforms((1,), generator, logits)  # as its `sample` of the next token
    out, r = torch.empty(k + 2, dtype=torch.long), torch.empty(3 * V)  # r: the C code's scratch, held here
    lib.smallem_verify_sample(
        logits.data_ptr(), k, V, 1.0 / warp.temperature, ptr(drafts) if k else None, ptr(q) if k else None, ptr(u),
        u_next.data_ptr(), r.data_ptr(), out.data_ptr(),
        warp.top_k or 0, 1.0 if warp.top_p is None else warp.top_p, warp.min_p or 0.0,  # 0, 1, 0: off
    )  # fmt: skip
    return out


def penalize_argmax(rows: torch.Tensor, seen: torch.Tensor, fed: torch.Tensor, penalty: float) -> torch.Tensor:
    """`verify.penalize` over one sequence's rows [T, V] of a pass over `fed` [T], in place (the
    same numbers: the same float32 operations), with the context `seen` [V] (bool) -> each
    penalised row's argmax [T] (torch.argmax's choice: the first largest)."""
    lib = kernels.loaded()
    T, V = rows.shape
    assert rows.dtype == torch.float32 and rows.is_contiguous() and seen.dtype == torch.bool and seen.numel() == V
    fed, seen = fed.contiguous(), seen.contiguous()
    top, mark = torch.empty(T, dtype=torch.long), torch.empty(V, dtype=torch.uint8)  # mark: the C code's scratch
    lib.smallem_penalize(ptr(rows), T, V, ptr(seen), ptr(fed), penalty, ptr(top), ptr(mark))
    return top
