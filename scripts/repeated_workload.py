"""The repeated workload: a prompt file's lines twice in one `smallem batch` run, each half's tokens a pass and tok/s
(the mean of its answers' own, and their tokens over their summed time), with every answer's tokens written to
OUT.jsonl: `python scripts/repeated_workload.py TARGET PROMPTS OUT [smallem batch options...]`."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> None:
    target, prompts, out, *options = sys.argv[1:]
    lines = Path(prompts).read_text().splitlines()
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl") as twice:
        twice.write("\n".join(lines * 2) + "\n")
        twice.flush()
        cmd = ["smallem", "batch", twice.name, "--target", target, "--ordered", "-q", *options]
        answers = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    Path(out).write_text(answers)
    rows = [json.loads(line) for line in answers.splitlines()]
    for name, part in (("first", rows[: len(lines)]), ("second", rows[len(lines) :])):
        st = [r["stats"] for r in part]
        tokens, passes = sum(s["new_tokens"] for s in st), sum(s["target_passes"] for s in st)
        mean = sum(s["tokens_per_s"] for s in st) / len(st)
        print(f"{name:6s} tok/pass {tokens / passes:5.2f}  mean tok/s {mean:6.1f}  "
              f"tokens/time {tokens / sum(s['elapsed_s'] for s in st):6.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
