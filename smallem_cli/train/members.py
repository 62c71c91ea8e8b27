"""Training one member of the family and saving it beside its facts (what `smallem train` runs)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..config import ModelConfig
from ..model import checkpoint
from ..model.llama import MTPModule, Transformer
from .loop import ProgressFn, TrainSettings, new_model, train_draft_distill, train_model, train_mtp, vocab_rank


def save_family_member(
    path: Path,
    model: Transformer | MTPModule,
    tokenizer_json: Path,
    facts: dict[str, Any],
    train_ids: np.ndarray,
    rank: list[int] | None = None,
) -> None:
    """Save a trained member with the tokens its cut head keeps: `rank`, else the training text's by frequency."""
    fp = checkpoint.tokenizer_fingerprint(tokenizer_json)
    checkpoint.save(
        path, model, tokenizer=fp, facts=facts, vocab_rank=rank or vocab_rank(train_ids, model.cfg.vocab_size)
    )


def proposer_rank(init: Path | None, meta: dict[str, str], train_ids: np.ndarray, vocab_size: int) -> list[int]:
    """The tokens a proposer's cut head keeps, most frequent first: a continued proposer's own (the
    `vocab_rank` in `meta`, its checkpoint `init`'s), else the training text's. Continued on other
    text, it keeps its ranking (docs/family.md, "Fitting the proposers on the target's own text")."""
    own = checkpoint.vocab_rank(meta, init, vocab_size) if init else None
    return own or vocab_rank(train_ids, vocab_size)


def train_member(
    kind: Literal["target", "draft", "distill", "mtp"],
    cfg: ModelConfig | None,
    data: tuple[np.ndarray, np.ndarray],
    settings: TrainSettings,
    run_dir: Path,
    dest: Path,
    tokenizer_json: Path,
    on_progress: ProgressFn | None = None,
    teacher: Path | None = None,
    init: Path | None = None,
    mtp_dest: Path | None = None,
) -> dict[str, Any]:
    """Train one member of the family and save it beside its facts -> the facts. kind: "target" or
    "draft" from scratch (`cfg`; a target with `cfg.mtp` also writes its MTP module to `mtp_dest`,
    by default mtp.safetensors beside `dest`), "distill" (a draft fitted to `teacher`, from `init` or
    `cfg`) or "mtp" (a module fitted to `teacher`). One started from `init` keeps its facts as "before"."""
    train_ids, val_ids = data
    meta = checkpoint.read_meta(init) if init else {}
    before = {"before": checkpoint.facts(meta)} if init else {}
    if kind in ("mtp", "distill"):
        assert teacher is not None, f"{kind} needs a teacher"
        tgt = checkpoint.load_model(teacher)[0]
        rank = proposer_rank(init, meta, train_ids, tgt.cfg.vocab_size)  # fitted to (`--fit-vocab`), saved
        source = f", starting from {init.name}" if init else ""
        if kind == "mtp":
            start = checkpoint.load_mtp(init, tgt)[0] if init else None
            if settings.chain:
                from .chain import train_mtp_chain

                member, facts = train_mtp_chain(
                    tgt, train_ids, val_ids, settings, run_dir, settings.chain, on_progress, start, rank
                )
            else:
                member, facts = train_mtp(tgt, train_ids, val_ids, settings, run_dir, on_progress, start, rank)
            facts["trained"] = (
                "distilled from the frozen target" + (f", chain of {settings.chain}" if settings.chain else "") + source
            )
        else:
            if init is not None:
                student = checkpoint.load_model(init)[0].train()
            else:
                assert cfg is not None, "a draft to distill needs init or cfg"
                student = new_model(cfg, settings.seed)
            member, facts = train_draft_distill(tgt, student, train_ids, val_ids, settings, run_dir, on_progress, rank)
            facts["trained"] = f"distilled from {teacher.name}" + source
        if not settings.fit.plain:  # what q was fitted to, beside how long
            facts["fit"] = dataclasses.asdict(settings.fit)
        save_family_member(dest, member, tokenizer_json, facts | before, train_ids, rank)
        return facts
    assert cfg is not None, f"{kind} from scratch needs a config"
    model, mtp, facts = train_model(cfg, train_ids, val_ids, settings, run_dir, on_progress)
    own = {k: v for k, v in facts.items() if not k.startswith("mtp_")}
    save_family_member(dest, model, tokenizer_json, own, train_ids)
    if mtp is not None:
        mtp_facts = {k: v for k, v in facts.items() if not k.startswith("val")}
        mtp_facts["trained"] = f"jointly with {dest.name}"
        save_family_member(mtp_dest or dest.with_name("mtp.safetensors"), mtp, tokenizer_json, mtp_facts, train_ids)
    return own
