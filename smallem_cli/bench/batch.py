"""`smallem bench --batch 1,4,16,64`: the batch engine's throughput (first admission to last answer), mean
latency, acceptance, tokens per pass and identity with the first row, greedy, at these batch sizes."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from .. import defaults, options
from ..backends.engines import Backend, Log
from ..engine import family
from ..engine.build import build
from ..engine.config import EngineConfig, cache_budget, plan_pool
from ..engine.request import Finished, Request
from ..engine.scheduler import Engine
from .run import right_table, save_plot


@dataclass
class BatchRow:
    engine: str  # the passes' engine: eager or native
    proposer: str
    k: str  # "auto" (the load policy's) or the fixed k
    batch: int
    requests: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    latency_s: float  # mean, from the engine taking the request in (when the batch has room) to its answer
    acceptance: float
    tokens_per_pass: float  # tokens per sequence per round
    rounds: int
    preemptions: int
    identical: str  # "64/64": requests whose tokens equal the reference row's (in its worst run)
    # every timed run's, in order of speed; the row's figures are the median run's (of an even number of runs,
    # the faster middle one)
    runs_tokens_per_s: list[float]


def alone_at_batch(tgt: family.Target, prompts: list[list[int]], max_new_tokens: int, engine: str,
                   log: Log) -> tuple[float, list[list[int]]]:  # fmt: skip
    """The target alone through the batch engine, the prompts as one batch -> (tokens/s, each prompt's tokens)."""
    device = tgt.model.device
    eng = _engine(tgt, device, "none", None, len(prompts), Backend(engine), defaults.PROPOSER_WEIGHTS, log)
    _timed(eng, [p[:16] for p in prompts], 8)
    t = _timed(eng, prompts, max_new_tokens)
    return t.tokens / t.wall_s, [f.tokens for f in t.done]


Run = tuple[str, str, int | None, int]  # engine, proposer, k (None: the load policy's), batch size


@dataclass
class Timed:
    wall_s: float
    done: list[Finished]
    rounds: int
    preemptions: int

    @property
    def tokens(self) -> int:
        return sum(len(f.tokens) for f in self.done)


def _timed(eng: Engine, prompts: list[list[int]], max_new_tokens: int) -> Timed:
    reqs = [Request(i, i, tuple(p), max_new_tokens) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    done = {f.request.index: f for f in eng.run(reqs)}
    return Timed(time.perf_counter() - t0, [done[i] for i in range(len(prompts))], eng.rounds, eng.preemptions)


def _row(run: Run, timed: list[Timed], reference: list[list[int]]) -> BatchRow:
    """A configuration's row: the figures of its median run, its identity in its worst."""
    engine, name, k, size = run
    med = sorted(timed, key=lambda t: t.wall_s)[(len(timed) - 1) // 2]
    st = [f.stats for f in med.done]
    same = min(sum(f.tokens == r for f, r in zip(t.done, reference, strict=True)) for t in timed)
    passes = sum(s["target_passes"] for s in st)  # type: ignore[misc]
    return BatchRow(
        engine, name, "auto" if k is None else str(k), size, len(reference), med.tokens, med.wall_s,
        med.tokens / med.wall_s,
        statistics.mean(float(s["latency_s"]) for s in st),  # type: ignore[arg-type]
        statistics.mean(float(s["acceptance_rate"]) for s in st),  # type: ignore[arg-type]
        med.tokens / max(1, passes), med.rounds, med.preemptions, f"{same}/{len(reference)}",
        sorted(t.tokens / t.wall_s for t in timed),
    )  # fmt: skip


def _engine(tgt: family.Target, device: torch.device, name: str, k: int | None, size: int, backend: Backend,
            weights: str, log: Log) -> Engine:  # fmt: skip
    """A row's engine: `name` may be P@tree12 (token trees) or P@f16 (the proposer's weights so)."""
    base, _, suffix = name.partition("@")
    tree = options.tree(int(suffix.removeprefix("tree"))) if suffix.startswith("tree") else None
    weights = suffix if suffix in defaults.WEIGHTS else weights
    p = family.load_proposer(base, tgt, device, defaults.proposer_vocab(True), tree, weights)
    backend.prepare(tgt.model, p.models, log, p.models if p.int8 else ())
    return build(EngineConfig(tgt.model, p, backend, k=k, max_batch=size, decode=str, strict=True))


def table(rows: list[BatchRow], max_new_tokens: int, device: str, threads: int) -> Table:
    n, runs = (rows[0].requests, len(rows[0].runs_tokens_per_s)) if rows else (0, 0)
    timing = "one run" if runs == 1 else f"median of {runs} runs"
    title = f"batch engine: {n} prompts x {max_new_tokens} new tokens, greedy, {timing}, {device}, {threads} threads"
    cols = ("engine", "proposer", "k", "batch", "tok/s", "runs' range", "x alone", "latency s", "acceptance")
    t = right_table(title, (*cols, "tok/pass", "rounds", "preempted", "identical"), "proposer")
    alone = {(r.engine, r.batch): r.tokens_per_s for r in rows if r.proposer == "none"}
    for r in rows:
        base = alone.get((r.engine, r.batch))
        t.add_row(
            r.engine, r.proposer, r.k, str(r.batch), f"{r.tokens_per_s:.1f}",
            f"{r.runs_tokens_per_s[0]:.0f}-{r.runs_tokens_per_s[-1]:.0f}",
            f"{r.tokens_per_s / base:.2f}" if base else "-", f"{r.latency_s:.2f}", f"{r.acceptance:.2f}",
            f"{r.tokens_per_pass:.2f}", str(r.rounds), str(r.preemptions), r.identical,
        )  # fmt: skip
    return t


def from_cli(tgt: family.Target, device: torch.device, names: list[str], sizes: list[int], ks: list[int],
             prompts: list[list[int]], max_new_tokens: int, err: Console, out: Console, json_out: bool,
             plot_file: Path | None, engines: tuple[str, ...] = ("eager",),
             weights: str = defaults.PROPOSER_WEIGHTS, repeats: int = 1) -> list[BatchRow]:  # fmt: skip
    """`smallem bench --batch`: the target alone, then each proposer (P@tree12: with token trees; P@f16:
    its weights so, else as `weights`) at each k (none: the load policy's), at every size, per engine;
    each row the median of `repeats` timed runs."""
    from rich.markup import escape
    from rich.progress import Progress

    # a size whose target cache alone does not fit is refused before any row runs (a proposer's: as built)
    plan_pool(EngineConfig(tgt.model, max_batch=max(sizes), strict=True), cache_budget(device))
    backends: dict[str, Backend] = {}  # one per engine: the target's native steps built once
    configs = [("none", None)] + [(n, k) for n in names if n != "none" for k in (ks or [None])]
    runs = [(e, name, k, size) for e in engines for name, k in configs for size in sizes]
    timed: dict[Run, list[Timed]] = {run: [] for run in runs}
    with Progress(console=err, transient=True) as bar:
        task = bar.add_task("bench --batch", total=len(runs) * repeats)
        # every configuration once a round, `repeats` rounds: a slow spell of a shared host falls on all of them, so
        # the ratios of their medians hold. Each run builds its own engine (all caches together could outgrow memory).
        for rep in range(repeats):
            for run in runs:
                engine, name, k, size = run
                bar.update(task, advance=1, description=escape(f"{engine} {name} k={k or 'auto'} batch {size}"))
                args = (tgt, device, name, k, size, backends.setdefault(engine, Backend(engine)), weights, err.print)
                if rep == 0:  # its code warmed up on short requests, on an engine of its own
                    _timed(_engine(*args), [p[:16] for p in prompts], 8)
                timed[run].append(_timed(_engine(*args), prompts, max_new_tokens))  # a fresh engine every run
    reference = [f.tokens for f in timed[runs[0]][0].done]
    rows = [_row(run, timed[run], reference) for run in runs]
    if plot_file:  # throughput against batch size, a line per engine, proposer and k
        lines: dict[str, list[tuple[float, float]]] = {}
        for r in rows:
            label = f"{r.engine} " + (r.proposer if r.proposer == "none" else f"{r.proposer} k={r.k}")
            lines.setdefault(label, []).append((r.batch, r.tokens_per_s))
        save_plot(lines, plot_file, "batch size (sequences decoded together)", "generated tokens/s, all requests", True)
    if json_out:
        head = {"device": str(device), "threads": torch.get_num_threads(), "max_new_tokens": max_new_tokens}
        print(json.dumps(head | {"prompts": len(prompts), "batch_rows": [r.__dict__ for r in rows]}))
    else:
        out.print(table(rows, max_new_tokens, str(device), torch.get_num_threads()))
    return rows
