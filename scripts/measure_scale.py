"""Smallem beside llama.cpp on one model's files, as a new user runs them (issue #54's table in docs/benchmarks.md):
peak memory and start-up of `generate -n 4` (a process each, /usr/bin/time), then decoding speed, each tool in its
own process, alternated `--repeats` times (median). Needs llama-cpp-python (`pip install -e ".[llamacpp]"`).

    python scripts/measure_scale.py models/llama-1b/hf models/llama-1b/f16.gguf models/llama-1b/q8_0.gguf ...
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "The history of the city begins"
LLAMA = r"""
import sys, time, llama_cpp as lib
path, n, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
t0 = time.perf_counter()
llm = lib.Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
ids = llm.tokenize(sys.argv[4].encode())
llm.eval(ids)
t1 = time.perf_counter()
for _ in range(n):
    tok = llm.sample(top_k=1)
    llm.eval([tok])
t2 = time.perf_counter()
print(f"{n / (t2 - t1):.3f} tok/s, start {t1 - t0:.3f} s")
"""


def timed(argv: list[str]) -> tuple[str, float, float]:
    """argv run under /usr/bin/time -> (its stderr + stdout, peak RSS in GiB, wall seconds)."""
    p = subprocess.run(["/usr/bin/time", "-f", "@@ %M %e", *argv], capture_output=True, text=True, check=False)
    if p.returncode != 0:
        sys.exit(f"{argv[:4]} failed: {p.stderr.strip().splitlines()[-1:]}")
    kib, wall = re.findall(r"@@ (\d+) ([\d.]+)", p.stderr)[-1]
    return p.stdout + p.stderr, int(kib) / 2**20, float(wall)


def ours(target: str, n: int, threads: int) -> list[str]:
    return [str(Path(sys.executable).parent / "smallem"), "generate", PROMPT, "--target", target, "-n", str(n),
            "--proposer", "none", "--threads", str(threads)]  # fmt: skip


def llama(target: str, n: int, threads: int) -> list[str]:
    return [sys.executable, "-c", LLAMA, target, str(n), str(threads), PROMPT]


def tok_s(out: str) -> float:
    return float(re.findall(r"([\d.]+) tok/s", out)[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("targets", nargs="+")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    rows = []
    for target in a.targets:
        row: dict[str, object] = {"target": target, "bytes": sum(f.stat().st_size for f in _files(Path(target)))}
        _, row["ours_peak_gib"], row["ours_start_s"] = timed(ours(target, 4, a.threads))
        if target.endswith(".gguf"):
            _, row["llama_peak_gib"], row["llama_start_s"] = timed(llama(target, 4, a.threads))
        speeds: dict[str, list[float]] = {"ours": [], "llama": []}
        for _ in range(a.repeats):
            speeds["ours"].append(tok_s(timed(ours(target, a.tokens, a.threads))[0]))
            if target.endswith(".gguf"):
                speeds["llama"].append(tok_s(timed(llama(target, a.tokens, a.threads))[0]))
        for who, got in speeds.items():
            if got:
                row[f"{who}_tok_s"], row[f"{who}_tok_s_runs"] = statistics.median(got), got
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}))


def _files(p: Path) -> list[Path]:
    return sorted(p.glob("*.safetensors")) if p.is_dir() else [p]


if __name__ == "__main__":
    main()
