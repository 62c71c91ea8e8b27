"""The benchmark's tables and plot: rows in, rich tables (or a PNG) out."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from rich.table import Table

from .run import Row


def right_table(title: str, cols: Iterable[str], left: str = "") -> Table:
    t = Table(title=title)
    for col in cols:
        t.add_column(col, justify="left" if col == left else "right")
    return t


def save_plot(lines: dict[str, list[tuple[float, float]]], path: Path, xlabel: str, ylabel: str, log2: bool) -> None:
    """A PNG of a line per label (matplotlib: the `plot` extra); x on a log2 scale, or a grey line at y = 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, pts in lines.items():
        ax.plot(*zip(*pts, strict=True), marker="o", label=label)
    if log2:
        ax.set_xscale("log", base=2)
    else:
        ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot(rows: list[Row], path: Path) -> None:
    """Speed-up against k for each proposer, mode and engine."""
    lines = {}
    for mode, engine in sorted({(r.mode, r.engine) for r in rows}):
        for name in sorted({r.proposer for r in rows if r.proposer != "none"}):
            pts = sorted((r.k, r.speedup) for r in rows if (r.proposer, r.mode, r.engine) == (name, mode, engine))
            if pts:
                lines[f"{name} ({mode}, {engine})"] = pts
    save_plot(lines, path, "k (proposals per round)", "speed-up over the target alone", False)


def table(rows: list[Row], n_prompts: int, max_new: int, repeats: int, device: str, threads: int) -> Table:
    """A row a configuration: speed, acceptance, the cost model's inputs and prediction, identity."""
    title = f"{n_prompts} prompts x {max_new} new tokens, median of {repeats} runs, {device}, {threads} threads"
    cols = ("mode", "engine", "proposer", "k", "tok/s", "speed-up", "vs eager", "α", "α model", "tok/pass")
    t = right_table(title, (*cols, "per position", "c", "v", "predicted", "meas/pred", "identical"))
    for r in rows:
        t.add_row(
            r.mode, r.engine, r.proposer, str(r.k), f"{r.tokens_per_s:.1f}", f"×{r.speedup:.2f}",
            "" if r.vs_eager is None else f"×{r.vs_eager:.2f}",
            f"{r.acceptance_rate:.3f}", f"{r.alpha_model:.3f}", f"{r.tokens_per_pass:.2f}",
            " ".join(f"{a:.2f}" for a in r.accepted_at),
            f"{r.cost_c:.3f}", f"{r.cost_v:.2f}", f"×{r.predicted_speedup:.2f}", f"{r.measured_over_predicted:.2f}",
            r.identical or "",
        )  # fmt: skip
    return t


def sweep_table(rows: list[Row]) -> Table:
    ks = sorted({r.k for r in rows if r.k})
    head = "mode / engine / proposer"
    t = right_table("k sweep: speed-up (acceptance)", [head, *(f"k={k}" for k in ks)], head)
    for mode, engine in dict.fromkeys((r.mode, r.engine) for r in rows):
        for name in dict.fromkeys(r.proposer for r in rows if r.proposer != "none"):
            mine = [r for r in rows if (r.mode, r.engine, r.proposer) == (mode, engine, name)]
            cells = {r.k: f"×{r.speedup:.2f} ({r.acceptance_rate:.2f})" for r in mine}
            if cells:
                t.add_row(f"{mode} {engine} {name}", *[cells.get(k, "") for k in ks])
    return t
