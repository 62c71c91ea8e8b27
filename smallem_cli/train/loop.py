"""Training a member of the family and saving it beside its facts (`train_member`: what `smallem train` runs).

Batches are random windows of the token stream drawn by (seed, step), and the learning rate follows the budget (tokens,
else seconds: warm-up, then cosine to 10%), so a run resumed from its state (`runstate`, every `save_every_s`, and on
Ctrl-C at the last whole step) draws and schedules as it would have. A target trains jointly with its MTP module
(DeepSeek-V3's loss, weight `mtp_weight`), so the trunk learns to carry the next-next token in h_i, which the module
reads; `distill` fits a module, or a draft, to a frozen target instead. Progress goes to `on_progress`, never stdout."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from .. import defaults
from ..config import ModelConfig
from ..model import checkpoint
from ..model.llama import MTPModule, Transformer
from . import runstate
from .evaluate import evaluate_family
from .fit import fit_loss, student_logits

PRECISIONS = ("fp32", "bf16")  # `TrainSettings.precision`
# A training loss: a batch [B, T+2] -> (the loss, what it reads as 0-dim tensors, read on the host: see `_train_loop`)
LossFn = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class TrainSettings:
    budget_s: float = defaults.TRAIN_SECONDS
    budget_tokens: int = 0  # > 0: this many training tokens instead of budget_s (the same run however loaded)
    batch_size: int = defaults.TRAIN_BATCH
    seq_len: int = defaults.TRAIN_SEQ_LEN
    lr: float = defaults.TRAIN_LR
    min_lr_frac: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    mtp_weight: float = defaults.TRAIN_MTP_WEIGHT  # a target's joint training: main loss + this x its MTP loss
    feature_weight: float = 0.0  # MTP distillation: weight of the state-matching loss (EAGLE's feature loss)
    seed: int = defaults.TRAIN_SEED
    compile: bool = defaults.TRAIN_COMPILE  # the loss through torch.compile
    precision: str = defaults.TRAIN_PRECISION  # one of PRECISIONS: "bf16" runs the loss's products under autocast
    save_every_s: float = 120.0
    eval_every_s: float = 300.0


@dataclass
class Progress:
    step: int
    elapsed_s: float
    done: float  # fraction of the budget (seconds or tokens) spent, 0..1
    loss: float
    tokens_per_s: float
    tokens_seen: int
    val_loss: float | None = None
    extra: dict[str, float] = field(default_factory=dict)


ProgressFn = Callable[[Progress | str], None]  # a str: a line to show at once


def batch(ids: np.ndarray, settings: TrainSettings, step: int) -> torch.Tensor:
    """[B, T+2] windows: inputs and the next two tokens of each position (for MTP)."""
    rng = np.random.default_rng((settings.seed, step))
    starts = rng.integers(0, len(ids) - settings.seq_len - 2, size=settings.batch_size)
    return torch.from_numpy(np.stack([ids[s : s + settings.seq_len + 2] for s in starts]).astype(np.int64))


def spent(settings: TrainSettings, tokens: int, elapsed: float) -> float:
    return min(1.0, tokens / settings.budget_tokens if settings.budget_tokens > 0 else elapsed / settings.budget_s)


def lr_at(settings: TrainSettings, step: int, frac: float) -> float:
    """Warm-up over the first steps, then cosine to min_lr_frac over the budget (frac 0..1)."""
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    lo = settings.min_lr_frac
    return settings.lr * (lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * frac)))


def evaluate(model: Transformer, ids: np.ndarray, seq_len: int, mtp: MTPModule | None = None) -> dict[str, float]:
    """The validation facts: next-token loss (nats/token); with an MTP module, also its loss and agreement."""
    if len(ids) < 3:
        raise ValueError(f"the validation text is too short: {len(ids)} tokens")
    target, *module = evaluate_family(model, ids, 1, {}, mtp, seq_len)  # (its bytes: not read)
    out = {"val_loss": target.nats_per_token}
    if module:
        out |= {"mtp_val_loss": module[0].nats_per_token, "mtp_agreement": module[0].agreement or 0.0}
    return out


def train_loop(loss_fn: LossFn, modules: dict[str, torch.nn.Module], draw: Callable[[int], torch.Tensor],
               settings: TrainSettings, run_dir: Path, on_progress: ProgressFn | None, judge: Callable[[], dict],
               check: Callable[[], float] | None = None) -> dict[str, Any]:  # fmt: skip
    """The optimisation loop, resumable, over every parameter of `modules`, on the batches `draw(step)` [B, T+2]
    -> the training facts and `judge()`'s on the validation split. `check()`, if given, is a validation loss taken
    every `eval_every_s` (shown in the progress): a model trained's, where a frozen target's would not move."""
    say = on_progress or (lambda line: None)
    torch.manual_seed(settings.seed)
    params = [p for m in modules.values() for p in m.parameters()]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": settings.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.95), fused=False)
    pos = runstate.load(run_dir, modules, opt)
    step, elapsed, tokens = (pos.step, pos.elapsed, pos.tokens) if pos else (0, 0.0, 0)
    if pos is not None:  # a rerun says where it stands at once, however long its first step or its evaluation
        done = spent(settings, tokens, elapsed)
        left = "its budget is spent" if done >= 1.0 else f"{done:.0%} of its budget spent"
        say(f"resuming {run_dir}: step {step}, {tokens:,} tokens, {elapsed:.0f} s trained; {left}")

    def save_state() -> None:
        runstate.save(run_dir, modules, opt, runstate.Position(step, tokens, elapsed), dataclasses.asdict(settings))

    # compiled: one inductor graph for the run's fixed batch shape (compile time counts as training
    # time). A loss hands back what it reads as tensors, read on the host below: an `.item()` inside
    # would break the graph (and, with the feature loss, recompile every step up to dynamo's limit).
    fn = torch.compile(loss_fn, dynamic=False) if settings.compile else loss_fn
    last_save = last_eval = elapsed
    val_loss = None
    t_prev = time.perf_counter()
    updating = False  # the weights between two steps: a state saved then would be neither
    try:
        while (done := spent(settings, tokens, elapsed)) < 1.0:
            for m in modules.values():
                m.train()
            x = draw(step)
            for g in opt.param_groups:
                g["lr"] = lr_at(settings, step, done)
            # bf16: the loss's products in bfloat16; weights, gradients, optimiser and every loss's logits float32
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.precision == "bf16"):
                loss, extra = fn(x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            updating = True
            opt.step()
            step += 1
            tokens += x.shape[0] * (x.shape[1] - 2)
            updating = False
            now = time.perf_counter()
            dt, t_prev = now - t_prev, now
            elapsed += dt
            if check is not None and elapsed - last_eval >= settings.eval_every_s:
                val_loss = check()
                last_eval = elapsed
                t_prev = time.perf_counter()  # evaluation time is not training time
            if elapsed - last_save >= settings.save_every_s:
                save_state()
                last_save = elapsed
                t_prev = time.perf_counter()
            if on_progress is not None:
                done, rate = spent(settings, tokens, elapsed), x.numel() / max(dt, 1e-9)
                read = {k: v.item() for k, v in extra.items()}
                on_progress(Progress(step, elapsed, done, loss.item(), rate, tokens, val_loss, read))
    except KeyboardInterrupt:  # the steps so far are kept (a second Ctrl-C stops the save: the last one stands)
        if updating:
            say(f"interrupted in step {step + 1}'s update: a rerun resumes from the state saved last")
        else:
            save_state()
            say(f"interrupted at step {step}: the same command resumes the run from {run_dir}")
        raise
    save_state()
    # said before the final evaluation: a large model takes minutes over a large validation split
    say("trained; evaluating on the validation split")
    facts = {"steps": step, "tokens_seen": tokens, "train_seconds": round(elapsed, 1)}
    facts |= {k: getattr(settings, k) for k in ("batch_size", "seq_len", "lr", "seed", "precision")}
    return facts | judge()


def new_model(cfg: ModelConfig, seed: int) -> Transformer:
    model = Transformer(cfg)
    model.init_weights(seed)
    return model


def new_mtp(cfg: ModelConfig, seed: int) -> MTPModule:
    """An MTP module whose first weights follow `seed` alone (torch's default init from the global RNG,
    seeded here, then put back)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)  # not the target's draws
        return MTPModule(cfg)


def train_model(
    cfg: ModelConfig, train_ids: np.ndarray, val_ids: np.ndarray, settings: TrainSettings, run_dir: Path,
    on_progress: ProgressFn | None = None
) -> tuple[Transformer, MTPModule | None, dict[str, Any]]:  # fmt: skip
    """Train a model from scratch (a target with `cfg.mtp` gets its MTP module jointly)."""
    model = new_model(cfg, settings.seed)
    mtp = new_mtp(cfg, settings.seed) if cfg.mtp else None
    modules: dict[str, torch.nn.Module] = {"model": model} | ({"mtp": mtp} if mtp is not None else {})

    def loss_fn(x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """x: [B, T+2]. Next-token loss, plus the MTP loss (token i+2 from h_i and token i+1)."""
        inp, tgt = x[:, :-2], x[:, 1:-1]
        h = model.hidden(inp)  # [B, T, d]
        # logits in float32 whatever the products ran in (`precision`): no softmax runs in bfloat16
        loss = F.cross_entropy(model.logits(h).float().flatten(0, 1), tgt.flatten())
        if mtp is None:
            return loss, {}
        T = h.shape[1]
        hm = mtp(h, model.embed_tokens(tgt), model.cos[:T], model.sin[:T])
        aux = F.cross_entropy(model.logits(hm).float().flatten(0, 1), x[:, 2:].flatten())
        return loss + settings.mtp_weight * aux, {"mtp_loss": aux.detach()}

    T = settings.seq_len
    facts = train_loop(
        loss_fn, modules, lambda step: batch(train_ids, settings, step), settings, run_dir, on_progress,
        lambda: evaluate(model, val_ids, T, mtp), lambda: evaluate(model, val_ids, T)["val_loss"],
    )  # fmt: skip
    if mtp is not None:
        facts["joint_weight"] = settings.mtp_weight  # both files: the trunk learnt under it too
    return model, mtp, facts


def distill(target: Transformer, student: Transformer | MTPModule, train_ids: np.ndarray, val_ids: np.ndarray,
            settings: TrainSettings, run_dir: Path,
            on_progress: ProgressFn | None = None) -> dict[str, Any]:  # fmt: skip
    """Fit a proposer (trained in place) to a frozen target's next-token distribution (`fit.py`) -> the facts:
    acceptance rewards matching the target, not the corpus, and its whole distribution is a richer signal than the
    one observed token. An MTP module reads h_i and the true token i+1 and drafts token i+2; `feature_weight` also
    pulls its output state to the target's h_{i+1} (normalised, as read next): later drafts chain on it (EAGLE)."""
    if student.cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"proposer vocabulary {student.cfg.vocab_size} != target's {target.cfg.vocab_size}")
    target.requires_grad_(False).eval()
    mtp = student if isinstance(student, MTPModule) else None
    T = settings.seq_len

    def loss_fn(x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        inp = x[:, :-2]
        with torch.no_grad():
            h = target.hidden(inp)
            # [B, T or T-1, V]: the target's view of the token a draft proposes, or an MTP module
            teacher = F.log_softmax(target.logits(h if mtp is None else h[:, 1:]).float(), dim=-1)
        if mtp is None:
            return fit_loss(teacher, student_logits(student, student.hidden(inp)))
        hm = mtp(h[:, :-1], target.embed_tokens(inp[:, 1:]), target.cos[: T - 1], target.sin[: T - 1])
        loss, extra = fit_loss(teacher, student_logits(target, hm))
        if not settings.feature_weight:
            return loss, extra
        d = h.shape[-1]
        feat = F.smooth_l1_loss(F.rms_norm(hm.float(), (d,)), F.rms_norm(h[:, 1:].float(), (d,)))  # [B, T-1, d] both
        return loss + settings.feature_weight * feat, extra | {"feature": feat.detach()}

    modules, judged = ({"model": student}, (student, None)) if mtp is None else ({"mtp": mtp}, (target, mtp))

    check = None if mtp is not None else lambda: evaluate(student, val_ids, T)["val_loss"]  # type: ignore[arg-type]
    return train_loop(
        loss_fn, modules, lambda step: batch(train_ids, settings, step), settings, run_dir, on_progress,
        lambda: evaluate(judged[0], val_ids, T, judged[1]), check,
    )  # fmt: skip


def vocab_rank(train_ids: np.ndarray, vocab_size: int) -> list[int]:
    """The 4,096 token ids most frequent in the training stream (the list a checkpoint keeps), most first."""
    return np.argsort(-np.bincount(train_ids, minlength=vocab_size), kind="stable")[:4096].tolist()


def save_family_member(path: Path, model: Transformer | MTPModule, fp: str, facts: dict[str, Any],
                       train_ids: np.ndarray, rank: list[int] | None = None) -> None:  # fmt: skip
    """Save a member with its tokenizer's fingerprint `fp` and its cut head's tokens (`rank`, else by `train_ids`)."""
    rank = rank or vocab_rank(train_ids, model.cfg.vocab_size)
    checkpoint.save(path, model, tokenizer=fp, facts=facts, vocab_rank=rank)


def train_member(kind: Literal["target", "draft", "distill", "mtp"], cfg: ModelConfig | None,
                 data: tuple[np.ndarray, np.ndarray], settings: TrainSettings, run_dir: Path, dest: Path, fp: str,
                 on_progress: ProgressFn | None, teacher: tuple[Transformer, str] | None, init: Path | None,
                 mtp_dest: Path | None) -> dict[str, Any]:  # fmt: skip
    """Train one member of the family and save it beside its facts (`fp`: its tokenizer's fingerprint) -> the facts.
    kind: "target" or "draft" from scratch (`cfg`; a target with `cfg.mtp` also writes its MTP module to `mtp_dest`),
    "distill" (a draft fitted to `teacher`, (the model, its name), from `init` or `cfg`) or "mtp" (a module fitted to
    `teacher`: a smallem target or any other). One started from `init` keeps its facts as "before"."""
    train_ids, val_ids = data
    if kind in ("target", "draft"):
        model, mtp, facts = train_model(cfg, train_ids, val_ids, settings, run_dir, on_progress)
        own = {k: v for k, v in facts.items() if not k.startswith("mtp_")}
        save_family_member(dest, model, fp, own, train_ids)
        if mtp is not None:
            mtp_facts = {k: v for k, v in facts.items() if not k.startswith("val")}
            mtp_facts["trained"] = f"jointly with {dest.name}"
            save_family_member(mtp_dest or dest.with_name("mtp.safetensors"), mtp, fp, mtp_facts, train_ids)
        return own
    meta = checkpoint.read_meta(init) if init else {}
    assert teacher is not None, "distillation needs its target"
    tgt, teacher_name = teacher
    # a continued proposer keeps its own ranking for its cut head, even on other text
    # (docs/family.md, "Fitting the proposers on the target's own text")
    rank = checkpoint.vocab_rank(meta, init, tgt.cfg.vocab_size) if init else None
    if kind == "mtp":
        student = checkpoint.load_mtp(init, tgt)[0] if init else new_mtp(tgt.cfg, settings.seed)
        trained = "distilled from the frozen target"
    else:
        student = checkpoint.load_model(init)[0].train() if init else new_model(cfg, settings.seed)
        trained = f"distilled from {teacher_name}"
    facts = distill(tgt, student, train_ids, val_ids, settings, run_dir, on_progress)
    facts["trained"] = trained + (f", starting from {init.name}" if init else "")
    before = {"before": checkpoint.facts(meta)} if init else {}
    save_family_member(dest, student, fp, facts | before, train_ids, rank)
    return facts
