"""`smallem data` and `smallem train`: the corpus and the family's training, on the CLI's app."""

from __future__ import annotations

import math
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from .. import defaults, options
from ..config import PRESETS
from ..errors import first_fault
from .app import app, bad_input, err, fail, new_file, target_alone, writable
from .args import DataDir, Threads
from .console import progress_printer

# `data`'s options that apply to --continuations N alone; of those, the ones --chat has no use for
CONTINUATION_ONLY = ("chat", "target", "source", "context_tokens", "new_tokens", "sampled_every", "seed")
NOT_CHAT = ("source", "context_tokens")


@app.command()
def data(
    ctx: typer.Context,
    files: Annotated[list[Path] | None, typer.Argument(help="UTF-8 text files (default: the KJV Bible)")] = None,
    out: Annotated[Path, typer.Option(help="output folder")] = defaults.DATA_DIR,
    overwrite: Annotated[bool, typer.Option(help="replace a different corpus already in --out")] = False,
    continuations: Annotated[
        int, typer.Option(help="instead: the target's continuations of this many contexts of --source (0: off)")
    ] = 0,
    source: Annotated[
        Path, typer.Option(help="continuations: the corpus of the contexts and of val.txt")
    ] = defaults.DATA_DIR,
    target: Annotated[Path, typer.Option(help="continuations: the target that writes them")] = defaults.TARGET,
    context_tokens: Annotated[int, typer.Option(help="continuations: tokens of a context")] = defaults.GEN_CONTEXT,
    new_tokens: Annotated[int, typer.Option(help="continuations: tokens the target adds to each")] = defaults.GEN_NEW,
    sampled_every: Annotated[
        int, typer.Option(help="continuations: one in this many sampled at T=1, the rest greedy (0: all greedy)")
    ] = defaults.GEN_SAMPLED_EVERY,
    seed: Annotated[int, typer.Option(help="continuations: contexts and draws")] = 0,
    chat: Annotated[
        bool,
        typer.Option(
            help="continuations: the contexts are composed instructions in the target's chat template, not "
            "windows of --source; an eighth more are continued for the validation split"
        ),
    ] = False,
) -> None:
    """Build the corpus and its deterministic train/validation split; or, with --continuations,
    a corpus of the target's own text to fit proposers on (`continuations.py`)."""
    import subprocess
    import time

    from ..train import data as corpus

    given = [o for o in CONTINUATION_ONLY if _typed(ctx, o)]
    _check_data(continuations, given, bool(files), context_tokens, new_tokens, sampled_every, seed)
    writable(out, "--out", folder=True)
    if not continuations:
        with bad_input(subprocess.CalledProcessError):
            chunks = corpus.text_chunks(files) if files else corpus.kjv_chapters()
            train_path, val_path = _write_corpus(out, chunks, overwrite, "--out")
        err.print(
            f"{len(chunks)} chunks -> {train_path} ({train_path.stat().st_size} bytes), "
            f"{val_path} ({val_path.stat().st_size} bytes)"
        )
        return
    # the target continues contexts of --source's train.txt into --out's; --source's val.txt is copied
    from ..engine import family
    from ..model.chat import chat_ids, messages
    from ..train.continuations import MAX_INSTRUCTIONS, contexts, documents, instructions, requests

    n = continuations
    train_txt, val_txt = source / "train.txt", source / "val.txt"
    if not chat and not (train_txt.is_file() and val_txt.is_file()):
        raise fail(f"no corpus in {source}: run `smallem data` (or `make data`) first")
    if not chat and out.resolve() == source.resolve():
        raise fail(f"--out {out} is the corpus the contexts come from: choose another folder")
    if chat and n + n // 8 > MAX_INSTRUCTIONS:
        raise fail(f"--chat composes at most {MAX_INSTRUCTIONS} instructions; --continuations {n} needs "
                   f"{n + n // 8} (an eighth more for the validation split)")  # fmt: skip
    if not target.exists():
        raise fail(f"--target {target}: no such checkpoint, HF folder or GGUF file")
    for path in (out / "train.txt", out / "val.txt"):  # what it will hold is not known yet: any counts
        new_file(path, "--out", overwrite)
    with bad_input():
        dev = family.pick_device("auto")
        tgt = family.load_target(target, dev)
        if context_tokens + new_tokens > (positions := tgt.model.cfg.max_seq_len):
            raise ValueError(f"a context and its continuation exceed the target's {positions} positions")
        tok = tgt.tok
        if chat:
            conversations = [messages(text) for text in instructions(n + n // 8, seed)]
            ctxs = [tuple(chat_ids(tok, tgt.chat, c)) for c in conversations]
        else:
            # a model of its own tokenizer encodes the corpus afresh: the .bin beside it is the family's
            ids = corpus.token_file(None if tgt.ships_none else tgt.tokenizer, train_txt, tgt.tok)
            ctxs = contexts(ids, n, context_tokens, seed, tok.token_to_id(corpus.EOT))
        reqs = requests(ctxs, new_tokens, sampled_every, seed)
        engine = target_alone(tgt, dev)
        val = [] if chat else corpus.read_documents(val_txt)
    t0 = time.perf_counter()

    def done(k: int) -> None:
        if k % 256 == 0 or k == len(reqs):
            err.print(f"{k}/{len(reqs)} continuations, {time.perf_counter() - t0:.0f} s")

    # the template's special tokens stay in the text: the proposer is fitted on the stream it will meet
    docs = documents(engine.run(reqs), lambda ids: tok.decode(ids, skip_special_tokens=False), done)
    if chat:
        docs, val = docs[:n], docs[n:]
    with bad_input():
        train_path, val_path = corpus.write_parts(out, (docs, val))
    err.print(f"{len(docs)} continuations -> {train_path} ({train_path.stat().st_size} bytes), {val_path}")


def _typed(ctx: typer.Context, name: str) -> bool:
    """Whether the user gave option `name` (by name: typer's parameter sources are its own click's enum)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def _check_data(n: int, given: list[str], files: bool, context_tokens: int, new_tokens: int, sampled_every: int,
                seed: int) -> None:  # fmt: skip
    """`data`'s options, together: `given` names the options of --continuations the user typed."""
    flag = {name: "--" + name.replace("_", "-") for name in CONTINUATION_ONLY}
    if n < 0:
        raise fail(f"--continuations must be >= 0 (0: the corpus itself), got {n}")
    if not n and given:
        raise fail(f"{flag[given[0]]} applies to --continuations N (N >= 1): without it, `smallem data` writes the "
                   "corpus of the text files given (or the KJV)")  # fmt: skip
    if not n:
        return
    if files:
        raise fail("--continuations reads the corpus in --source: give no text files")
    if "chat" in given and (not_chat := [g for g in given if g in NOT_CHAT]):
        raise fail(f"{flag[not_chat[0]]} applies to continuations of a corpus, not --chat (composed instructions)")
    if context_tokens < 1 or new_tokens < 1:
        raise fail(f"--context-tokens and --new-tokens must be >= 1, got {context_tokens} and {new_tokens}")
    if sampled_every < 0:
        raise fail(f"--sampled-every must be >= 0 (0: all greedy), got {sampled_every}")
    if not 0 <= seed <= defaults.MAX_SEED - 2 * n:  # each continuation draws with seed + its index
        raise fail(f"--seed must be between 0 and 2^63-1 less twice --continuations, got {seed}")


def _write_corpus(out_dir: Path, chunks: list[str], overwrite: bool, option: str) -> tuple[Path, Path]:
    """Write train.txt and val.txt of `chunks`' split, unless that replaces another corpus unasked."""
    from ..train import data as corpus

    parts = corpus.split(chunks)
    for path, part in zip((out_dir / "train.txt", out_dir / "val.txt"), parts, strict=True):
        same = path.is_file() and path.read_bytes() == corpus.EOT.join(part).encode("utf-8")
        if path.exists() and not same and not overwrite:
            raise fail(f"{path} holds another corpus: pass --overwrite to replace it, or {option} to use another")
    return corpus.write_parts(out_dir, parts)


class Kind(str, Enum):
    tokenizer = "tokenizer"
    target = "target"
    draft = "draft"
    mtp = "mtp"
    eagle = "eagle"


@app.command()
def train(
    kind: Annotated[Kind, typer.Argument(help="what to train")],
    data_dir: DataDir = defaults.DATA_DIR,
    preset: Annotated[str | None, typer.Option(help="model preset (target, draft-2l, draft-4l, ...)")] = None,
    out: Annotated[
        Path | None, typer.Option(help="output checkpoint (default: the install's checkpoints/<preset>.safetensors)")
    ] = None,
    mtp_out: Annotated[
        Path | None, typer.Option(help="target: its jointly trained MTP module (default: mtp.safetensors beside --out)")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="replace existing output files (checked before training)")] = False,
    tokenizer: Annotated[
        Path, typer.Option(help="tokenizer.json (train tokenizer: the output; an HF or GGUF --target: its own)")
    ] = defaults.TOKENIZER,
    target: Annotated[
        Path, typer.Option(help="the teacher of mtp (a smallem checkpoint, an HF folder or a GGUF file) and --distill")
    ] = defaults.TARGET,
    init: Annotated[Path | None, typer.Option(help="start from this checkpoint (an MTP module or a draft)")] = None,
    distill: Annotated[bool, typer.Option(help="draft: fit the target's distribution, not the corpus")] = False,
    mtp_weight: Annotated[
        float, typer.Option(help="target: weight of its MTP module's loss")
    ] = defaults.TRAIN_MTP_WEIGHT,
    feature_weight: Annotated[
        float, typer.Option(help="mtp: weight of matching the target's next state (for chained drafts)")
    ] = 0.0,
    budget: Annotated[float, typer.Option(help="training seconds")] = defaults.TRAIN_SECONDS,
    tokens: Annotated[int, typer.Option(help="stop after this many training tokens, not --budget (0: off)")] = 0,
    run_dir: Annotated[Path | None, typer.Option(help="resume state folder (default: runs/<name>)")] = None,
    seed: Annotated[int, typer.Option()] = defaults.TRAIN_SEED,
    lr: Annotated[float, typer.Option()] = defaults.TRAIN_LR,
    batch_size: Annotated[int, typer.Option()] = defaults.TRAIN_BATCH,
    threads: Threads = None,
    compile_loss: Annotated[
        bool, typer.Option("--compile/--no-compile", help="run the loss through torch.compile (once a run)")
    ] = defaults.TRAIN_COMPILE,
    precision: Annotated[
        str, typer.Option(help="fp32, or bf16: the loss's products in bfloat16 (for CPUs with bfloat16 instructions)")
    ] = defaults.TRAIN_PRECISION,
    text: Annotated[list[Path] | None, typer.Option(help="UTF-8 text files to train on (split into --data)")] = None,
    head_vocab: Annotated[int, typer.Option(help="eagle: the head's tokens, the target's most frequent")] = (
        defaults.EAGLE_VOCAB
    ),
    data_tokens: Annotated[
        int, typer.Option(help="eagle: tokens of the target's answers and states to train on (generated first)")
    ] = defaults.EAGLE_DATA_TOKENS,
) -> None:
    """Train the tokenizer, a target (with its MTP module), a draft, an MTP module, or an EAGLE head for any target
    (`--target`: its own answers and states, generated first into --run-dir)."""
    if kind is Kind.eagle:
        from .eagle import train_eagle

        with bad_input():
            if options.threads(threads):
                import torch

                torch.set_num_threads(threads)
        return train_eagle(target, out, overwrite, tokens, budget, run_dir, seed, lr, batch_size, head_vocab,
                           data_tokens)  # fmt: skip
    import torch

    from ..model import checkpoint
    from ..model.tokenizer import load_tokenizer
    from ..train import data as corpus
    from ..train import loop as tr

    # the options alone, checked before any work (writing --text's split included)
    with bad_input():
        first_fault(  # NaN and infinity fail every comparison
            (not 0 < budget < math.inf, f"--budget must be a finite number of seconds > 0, got {budget}"),
            (tokens < 0, f"--tokens must be >= 0 (0: train for --budget seconds), got {tokens}"),
            (not 0 < lr < math.inf, f"--lr must be a finite number > 0, got {lr}"),
            (batch_size < 1, f"--batch-size must be >= 1, got {batch_size}"),
            (not 0 <= seed <= defaults.MAX_SEED, f"--seed must be between 0 and 2^63-1, got {seed}"),
            (not 0 <= mtp_weight < math.inf, f"--mtp-weight must be a finite number >= 0, got {mtp_weight}"),
            (
                not 0 <= feature_weight < math.inf,
                f"--feature-weight must be a finite number >= 0, got {feature_weight}",
            ),
            (precision not in tr.PRECISIONS, f"--precision takes {' or '.join(tr.PRECISIONS)}, not {precision!r}"),
        )
    if init and kind not in (Kind.draft, Kind.mtp):
        raise fail(f"--init applies to a draft (with --distill) or an MTP module, not a {kind.value}")
    if kind is Kind.draft and init and not distill:
        raise fail("--init for a draft continues it by distillation: add --distill")
    if distill and kind is not Kind.draft:
        raise fail(f"--distill applies to train draft (an MTP module is always distilled), not train {kind.value}")
    if feature_weight and kind is not Kind.mtp:
        raise fail(f"--feature-weight applies to train mtp, not train {kind.value}")
    if init is not None and not init.is_file():
        raise fail(f"--init {init}: no such checkpoint")
    with bad_input():
        if options.threads(threads):
            torch.set_num_threads(threads)
    from ..engine import family

    other = family.foreign(target)  # an HF folder or a GGUF file: its tokenizer its own
    foreign = kind is Kind.mtp and other
    if kind is Kind.draft and distill and other:
        raise fail(f"--distill fits a draft of the family's vocabulary: for {target}, train an MTP module")
    # where the results go, checked before any work: nothing existing is replaced unasked
    name = preset or ("draft-2l" if kind is Kind.draft else kind.value)
    job = "distill" if kind is Kind.draft and distill else kind.value
    dest = out or (defaults.MTP if job == "mtp" else defaults.CHECKPOINTS / f"{name}.safetensors")
    dest, option = (tokenizer, "--tokenizer") if kind is Kind.tokenizer else (dest, "--out")
    joint = kind is Kind.target and name in PRESETS and PRESETS[name].mtp
    if mtp_weight != defaults.TRAIN_MTP_WEIGHT and not joint:
        raise fail("--mtp-weight applies to a target trained with its MTP module")
    if job != "mtp" and kind is not Kind.tokenizer and not init and name not in PRESETS:
        raise fail(f"unknown preset {name!r}: choose from {', '.join(PRESETS)}")
    if job in ("mtp", "distill") and not target.exists():
        raise fail(f"--target {target}: no such checkpoint, HF folder or GGUF file")
    if mtp_out is not None and not joint:
        raise fail("--mtp-out names the MTP module trained jointly with a target (a preset with MTP)")
    mtp_dest = (mtp_out or dest.with_name("mtp.safetensors")) if joint else None
    if mtp_dest is not None and mtp_dest.resolve() == dest.resolve():
        raise fail(f"the target and its MTP module would both be written to {dest}: give another --mtp-out")
    if job in ("mtp", "distill") and dest.resolve() == target.resolve():
        raise fail(f"{option} {dest} is the target it learns from: choose another file")
    new_file(dest, option, overwrite)
    if mtp_dest is not None:
        new_file(mtp_dest, "--mtp-out", overwrite)
    run = run_dir or Path("runs") / (f"{name}-distill" if distill else name)
    if kind is not Kind.tokenizer:
        writable(run, "--run-dir", folder=True)
    if text:
        writable(data_dir, "--data", folder=True)
    if compile_loss:  # the compiler torch.compile will call, found as it finds it
        from torch._inductor import cpp_builder, exc

        try:
            cpp_builder.get_cpp_compiler()
        except exc.InvalidCxxCompiler:
            raise fail("--compile needs a C++ compiler (g++, or $CXX) for torch.compile: train without it") from None
    if text:  # the user's own corpus: build its split where --data points (not over another corpus)
        try:
            _write_corpus(data_dir, corpus.text_chunks(text), overwrite, "--data")
        except (OSError, UnicodeDecodeError) as e:
            raise fail(f"cannot use the training text: {e}") from None
    train_txt, val_txt = data_dir / "train.txt", data_dir / "val.txt"
    if not train_txt.is_file() or not val_txt.is_file():
        raise fail(f"no corpus in {data_dir}: run `smallem data` (or `make data`) first")
    if kind is Kind.tokenizer:
        try:
            corpus.train_tokenizer(train_txt, tokenizer)
        except OSError as e:
            raise fail(f"cannot write the tokenizer: {e}") from None
        err.print(f"tokenizer -> {tokenizer}")
        return
    if not foreign and not tokenizer.is_file():
        raise fail(f"tokenizer not found: {tokenizer} (run `smallem train tokenizer`)")
    settings = tr.TrainSettings(
        budget_s=budget, budget_tokens=tokens, seed=seed, lr=lr, batch_size=batch_size, mtp_weight=mtp_weight,
        feature_weight=feature_weight, compile=compile_loss, precision=precision,
    )  # fmt: skip
    teacher = None  # the frozen target of mtp and --distill, and its name
    with bad_input():
        if foreign:  # its tokenizer and vocabulary are its own: they encode the corpus and mark the module
            tgt = family.load_target(target, torch.device("cpu"))
            teacher, fp = (tgt.model, target.name), tgt.fingerprint
            train_ids, val_ids = (corpus.token_file(None, t, tgt.tok) for t in (train_txt, val_txt))
        else:
            fp = checkpoint.tokenizer_fingerprint(tokenizer)
            train_ids, val_ids = (corpus.token_file(tokenizer, t) for t in (train_txt, val_txt))
        # enough tokens in each split, checked before a smallem teacher loads (not after the budget is spent)
        if len(val_ids) < 8:
            raise fail(
                f"the validation split in {data_dir} holds {len(val_ids)} tokens: give more text "
                f"(every {corpus.HOLDOUT_EVERY}th chunk of about 4 KB is held out)"
            )
        if len(train_ids) < (window := settings.seq_len + 3):  # seq_len inputs and the next two tokens
            raise fail(f"the training split in {data_dir} holds {len(train_ids)} tokens: a step needs {window}")
        cfg = None
        if job != "mtp" and not init:  # a new model: the named preset, checked against the tokenizer
            cfg = PRESETS[name]
            if cfg.vocab_size != (vs := len(load_tokenizer(tokenizer).get_vocab(with_added_tokens=True))):
                raise fail(f"preset {name} has vocabulary {cfg.vocab_size}, the tokenizer {vs}")
        if job in ("mtp", "distill") and not foreign:
            teacher = (checkpoint.load_model(target)[0], target.name)
    try:
        facts = tr.train_member(
            job, cfg, (train_ids, val_ids), settings, run, dest, fp, progress_printer(name, err), teacher, init,
            mtp_dest,
        )  # fmt: skip
    except (checkpoint.CheckpointError, ValueError, OSError) as e:
        raise fail(str(e)) from None
    except torch._dynamo.exc.BackendCompilerFailed as e:  # --compile: the saved state resumes without it
        raise fail(f"torch.compile failed ({type(e.inner_exception).__name__}): rerun without --compile") from None
    also = f", its MTP module -> {mtp_dest}" if mtp_dest else ""
    err.print(f"{name}: " + ", ".join(f"{k}={v}" for k, v in facts.items()) + f" -> {dest}{also}")
