"""`smallem bench --batch 1,4,16,64`: throughput and latency of the batch engine.

For each proposer and batch size, the prompts (by default 64 held-out prompts of 32 tokens) go
greedy through one engine decoding up to that many at a time: tokens/s over all requests (first
admission to last answer), mean time in the engine, acceptance, tokens per pass, and identity with
the first row (the target alone at the smallest batch). A batch size whose cache (every sequence
at the full context) does not fit is refused before anything runs (`check_sizes`), not lowered.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from .. import defaults as D
from .. import options as O
from ..backends.engines import Backend
from ..engine import family
from ..engine.request import Request
from ..engine.scheduler import Engine

EngineFactory = Callable[[str, int | None, int, str], Engine]  # (proposer, k or None, max batch, engine) -> one


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
    identical: str  # "64/64": requests whose tokens equal the reference row's


def run(
    make: EngineFactory,
    prompts: list[list[int]],
    names: list[str],
    sizes: list[int],
    ks: list[int | None],
    max_new_tokens: int,
    step: Callable[[str], None] | None = None,
    engines: tuple[str, ...] = ("eager",),
) -> list[BatchRow]:
    """Rows for the target alone, then each proposer at each k, at every batch size, per engine."""
    reference: list[list[int]] | None = None
    rows = []
    configs = [("none", None)] + [(n, k) for n in names if n != "none" for k in ks]
    for engine, (name, k), size in ((e, c, s) for e in engines for c in configs for s in sizes):
        if step:
            step(f"{engine} {name} k={k or 'auto'} batch {size}")
        eng = make(name, k, size, engine)
        reqs = [Request(i, i, tuple(p), max_new_tokens) for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        done = {f.request.index: f for f in eng.run(reqs)}
        wall = time.perf_counter() - t0
        out = [done[i].tokens for i in range(len(prompts))]
        if reference is None:
            reference = out
        same = sum(a == b for a, b in zip(out, reference, strict=True))
        st = [f.stats for f in done.values()]
        tokens = sum(len(o) for o in out)
        passes = sum(s["target_passes"] for s in st)  # type: ignore[misc]
        acc = [float(s["acceptance_rate"]) for s in st]  # type: ignore[arg-type]
        rows.append(BatchRow(
            engine, name, "auto" if k is None else str(k), size, len(prompts), tokens, wall, tokens / wall,
            statistics.mean(float(s["latency_s"]) for s in st),  # type: ignore[arg-type]
            statistics.mean(acc), tokens / max(1, passes), eng.rounds, eng.preemptions, f"{same}/{len(prompts)}",
        ))  # fmt: skip
    return rows


def alone_at_batch(
    tgt: family.Target,
    device: torch.device,
    prompts: list[list[int]],
    max_new_tokens: int,
    engine: str = "eager",
    log: Callable[[str], None] | None = None,
) -> tuple[float, list[list[int]]]:
    """The target alone through the batch engine on `engine`, greedy, all the prompts in one batch
    (what a peer's batch is set against), after a warm-up batch as a peer has -> (generated tokens/s
    over the whole batch, each prompt's tokens)."""
    from ..engine.build import build_engine

    eng = build_engine(
        tgt, "none", device, k=None, max_batch=len(prompts), proposer_vocab=None, decode=str,
        backend=Backend(engine), log=log, strict=True,
    )  # fmt: skip
    for _ in eng.run([Request(i, i, tuple(p[:16]), 8) for i, p in enumerate(prompts)]):
        pass
    reqs = [Request(i, i, tuple(p), max_new_tokens) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    done = {f.request.index: f.tokens for f in eng.run(reqs)}
    wall = time.perf_counter() - t0
    out = [done[i] for i in range(len(prompts))]
    return sum(len(o) for o in out) / wall, out


def table(rows: list[BatchRow], max_new_tokens: int, device: str, threads: int) -> Table:
    n = rows[0].requests if rows else 0
    t = Table(title=f"batch engine: {n} prompts x {max_new_tokens} new tokens, greedy, {device}, {threads} threads")
    cols = ("engine", "proposer", "k", "batch", "tok/s", "x alone", "latency s", "acceptance", "tok/pass", "rounds",
            "preempted", "identical")  # fmt: skip
    for c in cols:
        t.add_column(c, justify="left" if c == "proposer" else "right")
    alone = {(r.engine, r.batch): r.tokens_per_s for r in rows if r.proposer == "none"}
    for r in rows:
        base = alone.get((r.engine, r.batch))
        t.add_row(
            r.engine, r.proposer, r.k, str(r.batch), f"{r.tokens_per_s:.1f}",
            f"{r.tokens_per_s / base:.2f}" if base else "-", f"{r.latency_s:.2f}", f"{r.acceptance:.2f}",
            f"{r.tokens_per_pass:.2f}", str(r.rounds), str(r.preemptions), r.identical,
        )  # fmt: skip
    return t


def plot(rows: list[BatchRow], path: Path) -> None:
    """Throughput against batch size, one line per engine, proposer and k (needs matplotlib: smallem[plot])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for e, name, k in dict.fromkeys((r.engine, r.proposer, r.k) for r in rows):
        pts = [(r.batch, r.tokens_per_s) for r in rows if (r.engine, r.proposer, r.k) == (e, name, k)]
        ax.plot(*zip(*pts, strict=True), marker="o", label=f"{e} " + (name if name == "none" else f"{name} k={k}"))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (sequences decoded together)")
    ax.set_ylabel("generated tokens/s, all requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def check_sizes(tgt: family.Target, device: torch.device, sizes: list[int]) -> None:
    """UsageError, before any row runs, for a batch size whose target cache alone does not fit the
    memory (`engine.build.fit_batch`); a proposer's cache on top is checked as its engine is built."""
    from ..engine.build import cache_budget, fit_batch, sequence_bytes

    per_sequence = sequence_bytes([tgt.model], tgt.model.cfg.max_seq_len, D.PAGE_SIZE)
    fit_batch(max(sizes), per_sequence, cache_budget(device), strict=True)  # the largest fits: all do


def from_cli(
    tgt: family.Target,
    device: torch.device,
    names: list[str],
    sizes: list[int],
    ks: list[int],
    prompts: list[list[int]],
    max_new_tokens: int,
    err: Console,
    out: Console,
    json_out: bool,
    plot_file: Path | None,
    engines: tuple[str, ...] = ("eager",),
    weights: str = D.PROPOSER_WEIGHTS,
) -> list[BatchRow]:
    """`smallem bench --batch`: every configuration with a progress bar on stderr, then the table (or
    JSON) on stdout; ks empty: the load policy's k. P@tree12 grows token trees, P@f16 (or @int8)
    stores the proposer so (`options.weights_names`), else as `weights`."""
    from rich.markup import escape
    from rich.progress import Progress

    from ..engine.build import build_engine

    backends: dict[str, Backend] = {}  # one per engine: the target's native steps built once

    def make(name: str, k: int | None, size: int, engine: str) -> Engine:
        base, _, suffix = name.partition("@")  # token trees (`options.tree_names`), or weights
        tree = O.tree(int(suffix.removeprefix("tree"))) if suffix.startswith("tree") else None
        stored = suffix if suffix in D.WEIGHTS else weights
        return build_engine(
            tgt, base, device, k=k, max_batch=size, proposer_vocab=None, decode=str, tree=tree,
            backend=backends.setdefault(engine, Backend(engine)), log=err.print, weights=stored, strict=True,
        )  # fmt: skip

    check_sizes(tgt, device, sizes)
    configs = (1 + sum(n != "none" for n in names) * max(1, len(ks))) * len(sizes) * len(engines)
    with Progress(console=err, transient=True) as bar:
        task = bar.add_task("bench --batch", total=configs)
        rows = run(
            make, prompts, names, sizes, list(ks) or [None], max_new_tokens,
            lambda label: bar.update(task, advance=1, description=escape(label)), engines,
        )  # fmt: skip
    if plot_file:
        plot(rows, plot_file)
    if json_out:
        head = {"device": str(device), "threads": torch.get_num_threads(), "max_new_tokens": max_new_tokens}
        print(json.dumps(head | {"prompts": len(prompts), "batch_rows": [r.__dict__ for r in rows]}))
    else:
        out.print(table(rows, max_new_tokens, str(device), torch.get_num_threads()))
    return rows
