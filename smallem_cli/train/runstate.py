"""A training run's resume state, `run_dir/state.safetensors`: loading it runs no code.

Tensors (weights, optimizer moments, torch's RNG state) are safetensors; the rest (position, optimizer groups, settings)
is JSON in the same file's metadata, so the two never disagree. A state truncated, foreign or altered is a RunStateError
naming the file, never a half-loaded run; a save is atomic. The pickled `state.pt` of older versions is refused:
unpickling runs code."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .. import atomic
from ..errors import one_line

FORMAT, VERSION = "smallem-run-state", "1"


class RunStateError(ValueError):
    """A resume state that cannot be loaded into this run."""


@dataclass
class Position:  # where a run stands: optimizer steps, training tokens and seconds so far
    step: int = 0
    tokens: int = 0
    elapsed: float = 0.0


def save(run_dir: Path, modules: dict[str, torch.nn.Module], opt: torch.optim.Optimizer, pos: Position,
         settings: dict) -> None:  # fmt: skip
    """Write the state atomically (flushed to disk before the rename: a crash cannot leave an empty state)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {"rng.torch": torch.get_rng_state()}
    for name, mod in modules.items():
        tensors |= {f"module.{name}.{k}": v.detach().contiguous() for k, v in mod.state_dict().items()}
    sd = opt.state_dict()  # AdamW's: every per-parameter entry a tensor
    tensors |= {f"opt.{i}.{k}": v.detach().contiguous() for i, st in sd["state"].items() for k, v in st.items()}
    meta = {
        "format": FORMAT, "version": VERSION, "position": json.dumps(asdict(pos)),
        "modules": json.dumps(sorted(modules)), "optimizer": json.dumps({"param_groups": sd["param_groups"]}),
        "settings": json.dumps(settings, sort_keys=True),
    }  # fmt: skip
    path = run_dir / "state.safetensors"
    atomic.replace_with(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta), sync=True)


def load(run_dir: Path, modules: dict[str, torch.nn.Module], opt: torch.optim.Optimizer) -> Position | None:
    """Restore modules, optimizer and RNG from `run_dir`'s state -> its Position, or None if there is
    none. Everything is checked before anything is changed."""
    path = run_dir / "state.safetensors"
    if not path.exists():
        if (legacy := run_dir / "state.pt").exists():
            raise RunStateError(
                f"{legacy} is a resume state in the old pickle format, which smallem no longer loads "
                "(a pickle can run code): delete it to train afresh, or pass another --run-dir"
            )
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise RunStateError(f"{path} is not a smallem run state (version {VERSION})")
        tensors = load_file(str(path))
        pos = _position(json.loads(meta["position"]))
        names = json.loads(meta["modules"])
        groups = json.loads(meta["optimizer"])["param_groups"]
    except RunStateError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError, KeyError, TypeError) as e:
        raise RunStateError(f"cannot read the run state {path}: {one_line(str(e))}") from None
    if names != sorted(modules):
        raise RunStateError(f"{path} is the state of a run of {names}, not {sorted(modules)}: pass another --run-dir")
    if any(not torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point()):
        raise RunStateError(f"{path}: the state holds NaN or infinity")
    states = {name: _prefixed(tensors, f"module.{name}.") for name in modules}
    for name, mod in modules.items():
        found, expected = states[name], mod.state_dict()
        missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
        if missing or extra:
            raise RunStateError(f"{path}: {name} does not fit this run (missing {missing[:3]}, unexpected {extra[:3]})")
        for k, v in expected.items():
            if (got := found[k]).shape != v.shape or got.dtype != v.dtype:
                raise RunStateError(f"{path}: {name}.{k} is {got.dtype} {tuple(got.shape)}, not {tuple(v.shape)}")
    opt_state = _opt_state(path, tensors, opt)
    rng = tensors.get("rng.torch")
    if rng is None or rng.dtype != torch.uint8 or rng.shape != torch.get_rng_state().shape:
        raise RunStateError(f"{path}: no valid RNG state")
    try:
        for g in groups:
            g["betas"] = tuple(g["betas"])
        for name, mod in modules.items():
            mod.load_state_dict(states[name])
        opt.load_state_dict({"state": opt_state, "param_groups": groups})
        torch.set_rng_state(rng)
    except (ValueError, RuntimeError, KeyError, TypeError) as e:
        raise RunStateError(f"{path} does not fit this run: {one_line(str(e))}") from None
    return pos


def _position(raw: Any) -> Position:
    step, tokens, elapsed = raw["step"], raw["tokens"], raw["elapsed"]
    if any(type(v) is not int or v < 0 for v in (step, tokens)):  # a bool is no count
        raise ValueError(f"bad step or token count in {raw!r}")
    if type(elapsed) not in (int, float) or not math.isfinite(elapsed) or elapsed < 0:
        raise ValueError(f"bad elapsed seconds {elapsed!r}")
    return Position(step, tokens, float(elapsed))


def _prefixed(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}


def _opt_state(path: Path, tensors: dict[str, torch.Tensor], opt: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """The optimizer's per-parameter state, each moment checked against its parameter's shape."""
    params = [p for g in opt.param_groups for p in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    for key, t in _prefixed(tensors, "opt.").items():
        i, _, k = key.partition(".")
        if not i.isdigit() or int(i) >= len(params):
            raise RunStateError(f"{path}: optimizer state for an unknown parameter {key!r}")
        want = () if k == "step" else params[int(i)].shape
        if t.shape != want:
            raise RunStateError(f"{path}: optimizer {k} of parameter {i} has shape {tuple(t.shape)}, not {tuple(want)}")
        state.setdefault(int(i), {})[k] = t
    for i, st in state.items():  # AdamW's
        if lacks := {"step", "exp_avg", "exp_avg_sq"} - set(st):
            raise RunStateError(f"{path} does not fit this run: parameter {i}'s optimizer state lacks {sorted(lacks)}")
    return state
