"""A native target pass over T tokens in one-token passes, v(T), with AMX's tile unit on and off (`amx.h`), the two
alternated in one process: `python scripts/pass_costs.py TARGET [--ts 1,3,5,9,13,33,128] [--rounds 2]`."""

from __future__ import annotations

import argparse
import time

import torch

from smallem_cli.backends.engines import Backend
from smallem_cli.backends.native import kernels
from smallem_cli.engine import family
from smallem_cli.engine.build import build
from smallem_cli.engine.config import EngineConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("--ts", default="1,2,3,4,5,6,9,13,17,33,64,128")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    ts = [int(t) for t in a.ts.split(",")]
    tgt = family.load_target(a.target, torch.device("cpu"), chat=True)
    p = family.load_proposer("none", tgt, torch.device("cpu"))
    backend = Backend("native")
    backend.prepare(tgt.model, p.models, None, [])
    eng = build(EngineConfig(tgt.model, p, backend, 1, 1, tgt.chat.end_ids))
    steps = eng.t.steps
    assert steps is not None, "the native engine is not available here"
    past, ids, lib = eng.t.slab[:, :, :, :64], torch.ones(max(ts), dtype=torch.long), kernels.loaded()
    for _ in range(a.rounds):
        for on in (0, 1):
            if lib.smallem_amx(on) != on:
                print("no AMX tile unit here: the registers' path alone")
            best = {}
            for T in ts:  # each T back to back, as a decode runs its rounds; the least of 5 means of 10
                for _ in range(5):
                    steps.step(ids[:T], past, T)
                times = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    for _ in range(10):
                        steps.step(ids[:T], past, T)
                    times.append((time.perf_counter() - t0) / 10)
                best[T] = min(times)
            costs = " ".join(f"v({T})={best[T] / best[ts[0]]:.2f}" for T in ts)
            print(f"{'amx ' if on else 'regs'} pass({ts[0]}) {best[ts[0]] * 1e3:.3f} ms  {costs}")
    lib.smallem_amx(1)


if __name__ == "__main__":
    main()
