"""`make vllm-check`: vLLM on Smallem's exported folders, checked against Smallem's greedy tokens.

    python -m smallem_cli.interop.vllm_check --hf runs/vllm-hf [--target CKPT] [--prompts FILE] [-n 200] [-k 3]

`--hf` holds `target/`, `draft-2l/` and `mimo/` as `smallem export` writes them. Exit 1 if a vLLM run's
greedy tokens differ from Smallem's --target alone's, 2 if one could not run.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console
from rich.table import Table

from .. import defaults
from . import vllm_peer

Proposed = Callable[[str, int], tuple[int, int]]  # Smallem's proposer (name, k) on the prompts: (accepted, proposed)


@dataclass
class CheckRow:
    name: str
    identical: int  # prompts whose tokens equal Smallem's
    tokens_equal: int
    tokens: int
    prompts: int
    acceptance: vllm_peer.Acceptance | None
    ours: tuple[int, int] | None = None  # Smallem's own proposer on the same prompts: (accepted, proposed)

    @property
    def ok(self) -> bool:
        return self.identical == self.prompts


def check_row(
    name: str, ref: list[list[int]], got: list[list[int]], counters: dict[str, Any], ours: tuple[int, int] | None = None
) -> CheckRow:
    return CheckRow(name, *vllm_peer.agreement(ref, got), len(ref), vllm_peer.acceptance(counters), ours)


def check_table(rows: list[CheckRow], max_new: int, version: str) -> Table:
    """A row a run: token agreement with Smallem, vLLM's acceptance, and Smallem's with the same proposer."""
    t = Table(title=f"vLLM {version} against Smallem, greedy, {max_new} new tokens a prompt")
    for col in ("vLLM run", "identical to ours", "tokens equal", "acceptance", "ours", "tokens / step", "by position"):
        t.add_column(col, justify="right")
    for r in rows:
        a = r.acceptance
        drafted = a.drafts * len(a.per_pos) if a else 0
        t.add_row(
            r.name, f"{r.identical}/{r.prompts}" + ("" if r.ok else " FAILED"), f"{r.tokens_equal}/{r.tokens}",
            f"{a.rate:.1%} ({round(a.rate * drafted)}/{drafted})" if a else "-",
            f"{r.ours[0] / r.ours[1]:.1%} ({r.ours[0]}/{r.ours[1]})" if r.ours and r.ours[1] else "-",
            "1.00" if a is None else f"{a.tokens_per_step:.2f}",
            "-" if a is None else " / ".join(f"{p:.2f}" for p in a.per_pos),
        )  # fmt: skip
    return t


def run_check(python: Path, args: argparse.Namespace, prompts: list[list[int]], ref: list[list[int]],
              say: Callable[[str], None], ours: Proposed) -> tuple[list[CheckRow], str]:  # fmt: skip
    """vLLM offline on the target alone, with draft-2l, ngram and `mimo`'s mtp at k = 1 and k; `vllm serve`."""
    env = vllm_peer.vllm_env(python, threads=len(os.sched_getaffinity(0)))
    hf, k, n, logs = args.hf, args.k, args.max_new_tokens, args.logs
    draft = {"model": str(hf / "draft-2l"), "num_speculative_tokens": k}
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    runs = [("target alone", "target", None, None), (f"target + draft-2l (k={k})", "target", draft, "draft-2l")]
    runs.append((f"target + ngram (k={k})", "target", ngram, None))
    mtp = [{"method": "mtp", "num_speculative_tokens": m} for m in sorted({1, k})]
    runs += [(f"target + MTP, mtp method (k={s['num_speculative_tokens']})", "mimo", s, "mtp") for s in mtp]
    rows, version = [], "?"
    for i, (name, folder, spec, proposer) in enumerate(runs):
        say(f"vLLM offline: {name} (log: {logs / f'offline-{i}.log'})")
        job = {"target": str(hf / folder), "spec": spec, "prompts": prompts, "max_new": n}
        res = vllm_peer.run_offline(python, job, env, logs / f"offline-{i}.log")
        version = res["version"]
        mine = ours(proposer, spec["num_speculative_tokens"]) if proposer and spec else None
        rows.append(check_row(f"LLM: {name}", ref, res["batch"]["tokens"], res["batch"]["spec"], mine))
    if not args.no_serve:
        log, target = logs / "serve.log", hf / "target"
        with vllm_peer.serving(
            python, target, draft, env, log, lambda pid: say(f"vllm serve: PID {pid} (log: {log})")
        ) as url:
            got, counters = vllm_peer.serve_tokens(url, str(target), prompts, n)
        rows.append(check_row(f"vllm serve: target + draft-2l (k={k})", ref, got, counters, ours("draft-2l", k)))
    return rows, version


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, as the smallem command's errors
        sys.stderr.write(f"error: {message} (see --help)\n")
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    from .. import options
    from ..errors import INPUT_ERRORS, UsageError, one_line

    ap = OneLineParser(prog="python -m smallem_cli.interop.vllm_check", description=__doc__.split("\n")[0])
    ap.add_argument("--hf", type=Path, required=True, help="folder holding the exported target/ and draft-2l/")
    ap.add_argument("--target", type=Path, default=defaults.TARGET, help="Smallem's checkpoint of the exported target")
    ap.add_argument("--prompts", type=Path, default=defaults.PROMPTS)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=defaults.MAX_NEW_TOKENS)
    ap.add_argument("-k", type=int, default=3, help="vLLM's num_speculative_tokens")
    ap.add_argument("--logs", type=Path, default=Path("runs/vllm-check"), help="vLLM's logs")
    ap.add_argument("--no-serve", action="store_true", help="offline runs only")
    ap.add_argument(
        "--vllm-python", help=f"vLLM's python [default: ${vllm_peer.PYTHON_ENV} or {vllm_peer.VENV}/bin/python]"
    )
    args = ap.parse_args(argv)
    n = args.max_new_tokens
    err = Console(stderr=True, markup=False, highlight=False, soft_wrap=True)
    # SIGTERM unwinds like Ctrl-C, so that a running `vllm serve` is stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        python = vllm_peer.find_python(args.vllm_python)
        for name, how in (("target", ""), ("draft-2l", ""), ("mimo", " --format mimo")):
            if not (args.hf / name / "config.json").is_file():
                ckpt = "draft-2l" if name == "draft-2l" else "target"
                raise UsageError(f"no exported {name} in {args.hf}: `smallem export checkpoints/{ckpt}.safetensors "
                                   f"{args.hf / name}{how}` writes it")  # fmt: skip
        if not 1 <= args.k <= defaults.MAX_K or n < 1:
            raise UsageError(f"-k must be in 1..{defaults.MAX_K} and -n at least 1")
        from ..engine import family
        from ..engine.generate import generate

        target = family.load_target(args.target, family.pick_device("cpu"))  # errors: ValueErrors, one line
        prompts = options.read_prompts(args.prompts, target.model.cfg, n, {"none": [0]})
        args.logs.mkdir(parents=True, exist_ok=True)
        err.print(f"Smallem: greedy tokens of {len(prompts)} prompts ({args.target})")
        ref = [generate(target.model, family.NONE, p, n, 0)[0] for p in prompts]  # eager: every run must equal it

        @functools.cache
        def ours(name: str, k: int) -> tuple[int, int]:  # the proposer's head over the whole vocabulary, as vLLM's
            proposer = family.load_proposer(name, target, target.model.device, 0)
            counts = [generate(target.model, proposer, p, n, k)[1] for p in prompts]
            return sum(c.accepted for c in counts), sum(c.proposed for c in counts)

        rows, version = run_check(python, args, prompts, ref, err.print, ours)
    except (vllm_peer.VllmError, *INPUT_ERRORS) as e:
        err.print(f"error: {one_line(str(e))}")
        return 2
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    out = Console(width=None if sys.stdout.isatty() else 200, markup=False, highlight=False)
    out.print(check_table(rows, n, version))
    if bad := [r.name for r in rows if not r.ok]:
        err.print("error: vLLM's tokens differ from Smallem's: " + ", ".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
