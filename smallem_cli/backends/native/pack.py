"""The native engine's weight layouts: float16 panels (the checkpoint's values), and a
proposer's int8 panels with a scale per row (`matmul.h`'s `Mat`)."""

from __future__ import annotations

import torch


class NativeUnavailable(RuntimeError):
    """The native engine cannot serve this machine or this model (the message says why)."""


def half_exact(w: torch.Tensor, name: str) -> torch.Tensor:
    """w as float16, refusing any weight float16 cannot hold exactly (the model would change)."""
    h = w.detach().to(torch.float16).contiguous()
    if not torch.equal(h.float(), w.detach().float()):
        raise NativeUnavailable(f"{name} is not float16-exact (a model trained or loaded in float32)")
    return h


def panels(w: torch.Tensor, name: str, width: int) -> torch.Tensor:
    """W [out, in] -> float16 panels of `width` output rows (the library's `smallem_panel`), as
    `step.cpp` reads them front to back (`_in_panels`)."""
    return _in_panels(half_exact(w, name), width)


def _in_panels(rows: torch.Tensor, width: int) -> torch.Tensor:
    """[out, in] -> [ceil(out / width), in, width], the last panel padded with zero rows."""
    pad = -rows.shape[0] % width
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    return rows.view(-1, width, rows.shape[1]).transpose(1, 2).contiguous()


def panels8(w: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> int8 panels [ceil(out / width), in, width] (`panels`' layout) and float32
    scales [ceil(out / width) * width]: row n is scale[n] * q[n], q[n] = round(W[n] / scale[n])
    with scale[n] = max |W[n]| / 127 (symmetric, per output row). For a proposer only (`Mat`)."""
    w = w.detach().float()
    top = w.abs().amax(dim=1)
    scale = torch.where(top > 0, top / 127, torch.ones_like(top))
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    pad = -w.shape[0] % width  # the padding rows' scales: 1 (their outputs are never stored)
    return _in_panels(q, width), torch.cat([scale, scale.new_ones(pad)]).contiguous()
