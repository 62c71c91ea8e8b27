"""A sweep of an EAGLE head's early stop (`defaults.EAGLE_MIN_TOP`) and k on chat prompts, greedy, against the
target alone in the same run: `python scripts/sweep_eagle.py TARGET [HEAD] --min-top 0.2,0.35,0.5 -k 3,4,6`."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from smallem_cli import defaults
from smallem_cli.backends.engines import Backend
from smallem_cli.engine import family
from smallem_cli.engine.build import build
from smallem_cli.engine.config import EngineConfig
from smallem_cli.engine.request import Request
from smallem_cli.model.chat import chat_ids
from smallem_cli.spec.sampling import Sampling


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target", type=Path)
    ap.add_argument("head", nargs="?", default="eagle")
    ap.add_argument("--prompts", type=Path, default=Path("prompts/chat.jsonl"))
    ap.add_argument("--min-top", default="0.3")
    ap.add_argument("-k", default="4")
    ap.add_argument("-n", type=int, default=128)
    a = ap.parse_args()
    dev = torch.device("cpu")
    tgt = family.load_target(a.target, dev, chat=True)
    p = family.load_proposer(a.head, tgt, dev)
    backend = Backend("native")
    backend.prepare(tgt.model, p.models, None, p.models if p.int8 else [])
    prompts = [chat_ids(tgt.tok, tgt.chat, json.loads(line)["messages"]) for line in a.prompts.read_text().splitlines()]

    def run(proposer: family.LoadedProposer, k: int) -> tuple[float, float, list[list[int]]]:
        toks, passes, out, spent = 0, 0, [], 0.0
        for i, ids in enumerate(prompts):
            eng = build(EngineConfig(tgt.model, proposer, backend, k, 1, tgt.chat.end_ids))
            t0 = time.perf_counter()
            (f,) = eng.run([Request(i, i, tuple(ids), a.n, Sampling())])
            spent += time.perf_counter() - t0
            toks += len(f.tokens)
            passes += int(f.stats["target_passes"])
            out.append(f.tokens)
        return toks / spent, toks / max(passes, 1), out

    base, _, ref = run(family.NONE, 0)
    print(f"none: {base:.1f} tok/s")
    for mt in (float(x) for x in a.min_top.split(",")):
        defaults.EAGLE_MIN_TOP = mt
        for k in (int(x) for x in a.k.split(",")):
            tps, per, out = run(p, k)
            same = sum(x == y for x, y in zip(out, ref, strict=True))
            print(f"min_top {mt} k {k}: {tps:.1f} tok/s x{tps / base:.2f}, {per:.2f} tokens/pass, "
                  f"{same}/{len(ref)} identical")  # fmt: skip


if __name__ == "__main__":
    main()
