"""Evaluation on the validation split: loss in nats per byte, and proposer agreement (what greedy acceptance measures:
how often a proposer's argmax is the target's at the same position; the MTP module is fed the true token i+1, its draft
of i+2 compared with the target's argmax there). `chain_agreement` runs the chain as the loop does, without a
stopwatch: the target continues a validation context greedily (g_1..g_4), the proposer's draft tokens d_1..d_4 fed
back to it, and "kept at depth j" is how often d_1..d_j all equal g_1..g_j."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from .. import defaults
from ..engine import family
from ..model import checkpoint
from ..model.llama import MTPModule, Transformer
from .fit import acceptance

if TYPE_CHECKING:
    from rich.table import Table


@dataclass
class Report:
    name: str
    nats_per_token: float
    nats_per_byte: float
    agreement: float | None = None  # with the target's argmax, for proposers
    kept_at: list[float] | None = None  # the chain's draft tokens 1..j all equal to the target's greedy ones
    # a sampled first draft token accepted, sum min(p_T, q_T), at each EVAL_TEMPERATURES (q over the cut head)
    sampled: list[float] | None = None


@dataclass
class Members:
    target: family.Target
    drafts: dict[str, Transformer]
    mtp: MTPModule | None
    facts: dict[str, dict[str, Any]]  # each checkpoint's training facts, by name
    cuts: dict[str, torch.Tensor | None]  # each proposer's sampled head (`proposers.Head`): its tokens, or None


def load_members(target: Path, drafts: list[str] | None, mtp_file: Path | None = None) -> Members:
    """The target, the drafts (names beside it or paths; None: the shipped ones found there) and the
    MTP module (`mtp_file`, else the one beside it, if any), on the CPU."""
    tgt = family.load_target(target, torch.device("cpu"))
    shipped = [n for n in ("draft-2l", "draft-4l") if (target.parent / f"{n}.safetensors").exists()]
    own = {} if tgt.gguf else checkpoint.facts(checkpoint.read_meta(target))  # a GGUF file has no training facts
    models, facts = {}, {"target": own}
    cuts: dict[str, torch.Tensor | None] = {}
    V, cut = tgt.model.cfg.vocab_size, defaults.proposer_vocab(greedy=False)

    def noted(name: str, path: Path, meta: dict[str, str]) -> None:
        facts[name] = checkpoint.facts(meta)
        rank = checkpoint.vocab_rank(meta, path, V)
        cuts[name] = torch.tensor(rank[:cut]) if cut and rank else None

    for n in shipped if drafts is None else drafts:
        path = family.proposer_path(n, target.parent)
        models[path.stem], meta = checkpoint.load_model(path)
        noted(path.stem, path, meta)
    mtp = None
    if (mtp_path := mtp_file or target.parent / "mtp.safetensors").exists() or mtp_file:
        mtp, meta = checkpoint.load_mtp(mtp_path, tgt.model)
        noted("mtp", mtp_path, meta)
    return Members(tgt, models, mtp, facts, cuts)


def windows(ids: np.ndarray, seq_len: int) -> list[torch.Tensor]:
    """Non-overlapping [1, seq_len + 1] windows covering the stream (the last shorter, of 2 at least)."""
    return [torch.from_numpy(ids[s : s + seq_len + 1].astype(np.int64))[None] for s in range(0, len(ids) - 1, seq_len)]


@torch.no_grad()
def evaluate_family(target: Transformer, val_ids: np.ndarray, n_bytes: int, drafts: dict[str, Transformer],
                    mtp: MTPModule | None, seq_len: int = defaults.TRAIN_SEQ_LEN,
                    cuts: dict[str, torch.Tensor | None] | None = None) -> list[Report]:  # fmt: skip
    """Each model's loss over the whole stream; each proposer's agreement with the target, and how often its sampled
    first draft token is accepted at each EVAL_TEMPERATURES, q over its cut head (`cuts`, by name; absent: all)."""
    names = ["target", *drafts] + (["mtp"] if mtp is not None else [])
    nats, n, agree = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0), dict.fromkeys(names, 0)
    kept = {name: [0.0] * len(defaults.EVAL_TEMPERATURES) for name in names}
    for w in windows(val_ids, seq_len):
        x, y = w[:, :-1], w[:, 1:]
        T = x.shape[1]
        h = target.hidden(x)
        t_logits = target.logits(h)[0]  # [T, V]
        # each proposer's logits from position `skip` on: the MTP module at i reads h_i and token i+1 and
        # drafts token i+2, the target's argmax at i+1
        proposed = {name: (d.logits(d.hidden(x))[0], 0) for name, d in drafts.items()}
        if mtp is not None and T >= 2:
            hm = mtp(h[:, :-1], target.embed_tokens(x[:, 1:]), target.cos[: T - 1], target.sin[: T - 1])
            proposed["mtp"] = (target.logits(hm)[0], 1)  # [T-1, V]
        for name, (lg, skip) in {"target": (t_logits, 0), **proposed}.items():
            nats[name] += F.cross_entropy(lg, y[0, skip:], reduction="sum").item()
            n[name] += T - skip
        for name, (lg, skip) in proposed.items():
            agree[name] += (lg.argmax(-1) == t_logits[skip:].argmax(-1)).sum().item()
            ids = (cuts or {}).get(name)
            for i, t in enumerate(defaults.EVAL_TEMPERATURES):
                kept[name][i] += acceptance(t_logits[skip:], lg if ids is None else lg[:, ids], ids, t).sum().item()
    per_byte = n["target"] / n_bytes  # tokens per byte of the stream
    reports = [Report(name, nats[name] / n[name], nats[name] / n[name] * per_byte) for name in names]
    for r in reports[1:]:
        r.agreement, r.sampled = agree[r.name] / n[r.name], [a / n[r.name] for a in kept[r.name]]
    return reports


def contexts(val_ids: np.ndarray, count: int, length: int, depth: int) -> torch.Tensor:
    """`count` evenly spaced windows of validation text, each `length` tokens: [count, length]."""
    last = len(val_ids) - length - depth
    if last < 0:
        raise ValueError(f"the validation text is shorter than a context of {length} tokens")
    starts = np.linspace(0, last, num=count).astype(np.int64)
    return torch.from_numpy(np.stack([val_ids[s : s + length] for s in starts]).astype(np.int64))


def _greedy_chain(model: Transformer, x: torch.Tensor, depth: int) -> torch.Tensor:
    """Extend each row of x [B, C] by `depth` greedy tokens of `model` -> [B, depth]."""
    for _ in range(depth):
        x = torch.cat([x, model.logits(model.hidden(x)[:, -1]).argmax(-1, keepdim=True)], dim=1)
    return x[:, x.shape[1] - depth :]


@torch.no_grad()
def chain_agreement(target: Transformer, val_ids: np.ndarray, drafts: dict[str, Transformer], mtp: MTPModule | None,
                    count: int = 256, length: int = 96, depth: int = 4) -> dict[str, list[float]]:  # fmt: skip
    """Each proposer's chain against the target's greedy continuation, from `count` contexts
    of `length` validation tokens -> name -> rate at which draft tokens 1..j were all accepted, j = 1..depth."""
    x = contexts(val_ids, count, length, depth)  # [B, C]
    g = _greedy_chain(target, x, depth)  # [B, depth]
    chains = {name: _greedy_chain(d, x, depth) for name, d in drafts.items()}
    if mtp is not None:
        chains["mtp"] = _mtp_chain(target, mtp, x, depth)
    return {name: (d == g).long().cumprod(dim=1).float().mean(dim=0).tolist() for name, d in chains.items()}


def _mtp_chain(target: Transformer, mtp: MTPModule, x: torch.Tensor, depth: int) -> torch.Tensor:
    """The MTP module's chain from contexts x [B, C], as the engine's `MTPProposer` runs it: pairs (h_j, x_{j+1})
    over the context, then each draft token fed back with the module's own state -> [B, depth]."""
    hs, toks = target.hidden(x)[:, :-1], x[:, 1:]  # pairs (h_j, x_{j+1}), j < C-1: the last drafts x_C's successor
    for _ in range(depth):
        T = hs.shape[1]
        states = mtp(hs, target.embed_tokens(toks), target.cos[:T], target.sin[:T])  # [B, T, d]
        token = target.logits(states[:, -1]).argmax(-1, keepdim=True)  # [B, 1]
        hs = torch.cat([hs, states[:, -1:]], dim=1)  # chain on its own state
        toks = torch.cat([toks, token], dim=1)
    return toks[:, toks.shape[1] - depth :]


def report_table(reports: list[Report], facts: dict[str, dict[str, Any]], n_tokens: int, n_bytes: int) -> Table:
    from rich.table import Table

    table = Table(title=f"validation: {n_tokens:,} tokens, {n_bytes:,} bytes")
    temps = " / ".join(f"{t:g}" for t in defaults.EVAL_TEMPERATURES)
    cols = ("model", "nats/token", "nats/byte", "agreement with target", "chain kept at 1 / 2 / 3 / 4",
            f"sampled kept at T = {temps}")  # fmt: skip
    for col in (*cols, "steps", "tokens seen", "trained for"):
        table.add_column(col, justify="right")
    for r in reports:
        f = facts.get(r.name, {})
        table.add_row(
            r.name, f"{r.nats_per_token:.3f}", f"{r.nats_per_byte:.3f}",
            "" if r.agreement is None else f"{r.agreement:.3f}",
            "" if r.kept_at is None else " / ".join(f"{a:.2f}" for a in r.kept_at),
            "" if r.sampled is None else " / ".join(f"{a:.3f}" for a in r.sampled),
            f"{total(f, 'steps'):,}" if "steps" in f else "",
            f"{total(f, 'tokens_seen'):,}" if "tokens_seen" in f else "",
            f"{total(f, 'train_seconds'):.0f} s" if "train_seconds" in f else "",
        )  # fmt: skip
    return table


def total(facts: dict[str, Any], key: str) -> float:
    """A training fact summed over the run and the runs it started from (facts["before"])."""
    return facts.get(key, 0) + (total(facts["before"], key) if "before" in facts else 0)
