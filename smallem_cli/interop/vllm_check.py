"""`make vllm-check`: vLLM on Smallem's exported folders, checked against Smallem's greedy tokens.

    python -m smallem_cli.vllm_check --hf runs/vllm-hf [--target CKPT] [--prompts FILE] [-n 200] [-k 3]

`--hf` holds `target/` and `draft-2l/` as `smallem export` writes them, and `mimo/` (`--format
mimo`: the target with its MTP module). The reference is Smallem's own checkpoint (--target) alone,
greedy, eager. vLLM runs offline (vllm.LLM) on the bench prompts, greedy (`runs`), then `vllm serve`
with the draft answers them through its completions API. A table of token agreement (every prompt
must agree), vLLM's acceptance and Smallem's with the same proposer goes to stdout; exit 1 if any
run disagrees, 2 if one could not run. vLLM's logs are kept in --logs.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from rich.console import Console
from rich.table import Table

from .. import defaults as D
from . import vllm_peer as V

if TYPE_CHECKING:
    from ..engine.family import Target
    from ..model.llama import Transformer


@dataclass
class CheckRow:
    name: str
    identical: int  # prompts whose tokens equal Smallem's
    prompts: int
    tokens_equal: int
    tokens: int
    acceptance: V.Acceptance | None
    ours: tuple[int, int] | None = None  # Smallem's own proposer on the same prompts: (accepted, proposed)

    @property
    def ok(self) -> bool:
        return self.identical == self.prompts


def check_row(
    name: str, ref: list[list[int]], got: list[list[int]], counters: dict[str, Any], ours: tuple[int, int] | None = None
) -> CheckRow:
    whole, each, total = V.agreement(ref, got)
    return CheckRow(name, whole, len(ref), each, total, V.acceptance(counters), ours)


def check_table(rows: list[CheckRow], max_new: int, version: str) -> Table:
    """Token agreement with Smallem's greedy tokens, vLLM's own acceptance figures, and Smallem's
    acceptance with the same proposer where it has one, a row a run."""
    t = Table(title=f"vLLM {version} against Smallem, greedy, {max_new} new tokens a prompt")
    cols = ("vLLM run", "identical to ours", "tokens equal", "acceptance", "ours", "tokens / step", "by position")
    for col in cols:
        t.add_column(col, justify="right")
    for r in rows:
        a = r.acceptance
        drafted = a.drafts * len(a.per_pos) if a else 0
        accepted = f"{a.rate:.1%} ({round(a.rate * drafted)}/{drafted})" if a else "-"
        t.add_row(
            r.name,
            f"{r.identical}/{r.prompts}" + ("" if r.ok else " FAILED"),
            f"{r.tokens_equal}/{r.tokens}",
            accepted,
            f"{r.ours[0] / r.ours[1]:.1%} ({r.ours[0]}/{r.ours[1]})" if r.ours and r.ours[1] else "-",
            "1.00" if a is None else f"{a.tokens_per_step:.2f}",
            "-" if a is None else " / ".join(f"{p:.2f}" for p in a.per_pos),
        )
    return t


@dataclass
class Run:
    name: str
    folder: str  # under --hf: the target's folder vLLM loads
    spec: dict[str, Any] | None  # vLLM's speculative_config, folders under --hf as names
    ours: str | None = None  # Smallem's proposer doing the same, if any
    k: int = 0


def runs(k: int) -> list[Run]:
    """What `make vllm-check` runs offline: the target alone, with draft-2l, with vLLM's ngram, and
    the target with its MTP module (the `mimo` folder) at k = 1 and k."""
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    return [
        Run("target alone", "target", None),
        Run(f"target + draft-2l (k={k})", "target", {"model": "draft-2l", "num_speculative_tokens": k}, "draft-2l", k),
        Run(f"target + ngram (k={k})", "target", ngram),
        *(Run(f"target + MTP, mtp method (k={n})", "mimo", {"method": "mtp", "num_speculative_tokens": n}, "mtp", n)
          for n in sorted({1, k})),
    ]  # fmt: skip


def run_check(
    python: Path,
    hf: Path,
    prompts: list[list[int]],
    ref: list[list[int]],
    max_new: int,
    k: int,
    logs: Path,
    serve: bool = True,
    say: Callable[[str], None] = lambda m: None,
    ours: Callable[[str, int], tuple[int, int]] | None = None,
) -> tuple[list[CheckRow], str]:
    """The offline runs and (with `serve`) the served one: their rows, and vLLM's version.
    `ours(proposer, k)` gives Smallem's acceptance with the same proposer, for the rows that have one."""
    env = V.vllm_env(python, threads=len(os.sched_getaffinity(0)))
    rows, version = [], "?"
    for i, run in enumerate(runs(k)):
        say(f"vLLM offline: {run.name} (log: {logs / f'offline-{i}.log'})")
        spec = run.spec and {**run.spec, **({"model": str(hf / run.spec["model"])} if "model" in run.spec else {})}
        job = {"target": str(hf / run.folder), "spec": spec, "prompts": prompts, "max_new": max_new}
        res = V.run_offline(python, job, env, logs / f"offline-{i}.log")
        version = res["version"]
        mine = ours(run.ours, run.k) if ours and run.ours else None
        rows.append(check_row(f"LLM: {run.name}", ref, res["batch"]["tokens"], res["batch"]["spec"], mine))
    if serve:
        log, target = logs / "serve.log", hf / "target"
        spec = {"model": str(hf / "draft-2l"), "num_speculative_tokens": k}
        with V.serving(python, target, spec, env, log, lambda pid: say(f"vllm serve: PID {pid} (log: {log})")) as url:
            got, counters = V.serve_tokens(url, str(target), prompts, max_new)
        mine = ours("draft-2l", k) if ours else None
        rows.append(check_row(f"vllm serve: target + draft-2l (k={k})", ref, got, counters, mine))
    return rows, version


def smallem_tokens(model: Transformer, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Smallem's greedy tokens, the target alone, eager: the reference every vLLM run must equal."""
    from ..engine.family import NONE
    from ..engine.generate import generate

    return [generate(model, NONE, p, max_new, 0)[0] for p in prompts]


def smallem_acceptance(target: Target, prompts: list[list[int]], max_new: int) -> Callable[[str, int], tuple[int, int]]:
    """(proposer, k) -> Smallem's (accepted, proposed) over the prompts, greedy, eager, the
    proposer's head over the whole vocabulary as vLLM's; each computed once."""
    from ..engine import family
    from ..engine.generate import generate

    done: dict[tuple[str, int], tuple[int, int]] = {}

    def ours(name: str, k: int) -> tuple[int, int]:
        if (name, k) not in done:
            p_ = family.load_proposer(name, target, target.model.embed_tokens.weight.device, 0)
            counts = [generate(target.model, p_, p, max_new, k)[1] for p in prompts]
            done[name, k] = (sum(c.accepted for c in counts), sum(c.proposed for c in counts))
        return done[name, k]

    return ours


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, as the smallem command's errors
        sys.stderr.write(f"error: {message} (see --help)\n")
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    from .. import options as O

    ap = OneLineParser(prog="python -m smallem_cli.vllm_check", description=__doc__.split("\n")[0])
    ap.add_argument("--hf", type=Path, required=True, help="folder holding the exported target/ and draft-2l/")
    ap.add_argument("--target", type=Path, default=D.TARGET, help="Smallem's checkpoint of the exported target")
    ap.add_argument("--prompts", type=Path, default=D.PROMPTS)
    ap.add_argument("-n", "--max-new-tokens", type=int, default=D.MAX_NEW_TOKENS)
    ap.add_argument("-k", type=int, default=3, help="vLLM's num_speculative_tokens")
    ap.add_argument("--logs", type=Path, default=Path("runs/vllm-check"), help="vLLM's logs")
    ap.add_argument("--no-serve", action="store_true", help="offline runs only")
    ap.add_argument("--vllm-python", help=f"vLLM's python [default: ${V.PYTHON_ENV} or {V.VENV}/bin/python]")
    args = ap.parse_args(argv)
    err = Console(stderr=True, markup=False, highlight=False, soft_wrap=True)
    # SIGTERM unwinds like Ctrl-C, so that a running `vllm serve` is stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        python = V.find_python(args.vllm_python)
        for name, how in (("target", ""), ("draft-2l", ""), ("mimo", " --format mimo")):
            if not (args.hf / name / "config.json").is_file():
                ckpt = "draft-2l" if name == "draft-2l" else "target"
                raise O.UsageError(f"no exported {name} in {args.hf}: `smallem export checkpoints/{ckpt}.safetensors "
                                   f"{args.hf / name}{how}` writes it")  # fmt: skip
        if not 1 <= args.k <= D.MAX_K or args.max_new_tokens < 1:
            raise O.UsageError(f"-k must be in 1..{D.MAX_K} and -n at least 1")
        from ..engine.family import load_target, pick_device

        target = load_target(args.target, pick_device("cpu"))  # errors: ValueErrors, one line
        prompts = O.read_prompts(args.prompts, target.model.cfg, args.max_new_tokens, {"none": [0]})
        args.logs.mkdir(parents=True, exist_ok=True)
        err.print(f"Smallem: greedy tokens of {len(prompts)} prompts ({args.target})")
        ref = smallem_tokens(target.model, prompts, args.max_new_tokens)
        ours = smallem_acceptance(target, prompts, args.max_new_tokens)
        rows, version = run_check(python, args.hf, prompts, ref, args.max_new_tokens, args.k, args.logs,
                                  not args.no_serve, err.print, ours)  # fmt: skip
    except (V.VllmError, *O.INPUT_ERRORS) as e:
        err.print(f"error: {O.one_line(str(e))}")
        return 2
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    Console(width=None if sys.stdout.isatty() else 200, markup=False, highlight=False).print(
        check_table(rows, args.max_new_tokens, version)
    )
    bad = [r.name for r in rows if not r.ok]
    if bad:
        err.print("error: vLLM's tokens differ from Smallem's: " + ", ".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
