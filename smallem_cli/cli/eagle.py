"""`smallem train eagle`: an EAGLE head for a target, its data generated first (`train.eagle_data`), then trained
(`train.eagle`); both resume where a run stopped."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .. import defaults
from ..errors import first_fault
from .app import bad_input, err, new_file, target_alone, writable
from .console import progress_printer


def train_eagle(target: Path, out: Path | None, overwrite: bool, tokens: int, budget: float, run_dir: Path | None,
                seed: int, lr: float, batch_size: int, head_vocab: int, data_tokens: int) -> None:  # fmt: skip
    import torch

    from ..engine import family
    from ..model import eagle
    from ..model.chat import chat_ids, messages
    from ..train import eagle as tr
    from ..train import eagle_data as data
    from ..train.loop import TrainSettings

    with bad_input():
        first_fault(
            (not target.exists(), f"--target {target}: no such checkpoint, HF folder or GGUF file"),
            (head_vocab < 16, f"--head-vocab must be >= 16, got {head_vocab}"),
            (data_tokens < 1, f"--data-tokens must be >= 1, got {data_tokens}"),
            (tokens < 0, f"--tokens must be >= 0 (0: train for --budget seconds), got {tokens}"),
            (not 0 < lr < math.inf, f"--lr must be a finite number > 0, got {lr}"),
            (batch_size < 1, f"--batch-size must be >= 1, got {batch_size}"),
        )
    folder = target if target.is_dir() else target.parent
    dest = out or folder / f"{target.stem}.eagle.safetensors"
    new_file(dest, "--out", overwrite)
    run = run_dir or Path("runs") / f"eagle-{target.stem}"
    writable(run, "--run-dir", folder=True)
    say = err.print
    with bad_input():
        dev = torch.device("cpu")
        tgt = family.load_target(target, dev, chat=True)
        model, cfg = tgt.model, tgt.model.cfg
        taps = eagle.default_taps(cfg.n_layers)
        weights_fp = eagle.weights_fingerprint(model)
        meta = {"taps": json.dumps(list(data.record_taps(taps, cfg.n_layers))), "target": weights_fp}
        shards_dir = run / "data"
        if data.shard_tokens(shards_dir) < data_tokens:
            recorder = data.Recorder(data.record_taps(taps, cfg.n_layers))

            def prompt(text: str) -> list[int]:
                return chat_ids(tgt.tok, tgt.chat, messages(text))

            engine = target_alone(tgt, dev, recorder)
            data.generate(engine, recorder, prompt, shards_dir, data_tokens, defaults.EAGLE_ANSWER, seed, meta, say)
        shards = data.read_shards(shards_dir)
        if shards.meta.get("target") != weights_fp:
            raise ValueError(f"{shards_dir} holds another target's states: give another --run-dir")
        ids_path = run / "ids.json"  # the head's tokens, fixed at its first run (more data may come later)
        if ids_path.is_file():
            ids = torch.tensor(json.loads(ids_path.read_text()))
        else:
            ids = data.frequent(shards, head_vocab, cfg.vocab_size, sorted(tgt.chat.end_ids))
            ids_path.write_text(json.dumps(ids.tolist()))
        head, teacher = tr.new_head(model, taps, ids, seed), tr.Teacher.of(model, ids)
        settings = TrainSettings(budget_s=budget, budget_tokens=tokens, batch_size=batch_size, lr=lr, seed=seed,
                                 seq_len=defaults.EAGLE_SEQ, warmup_steps=50)  # fmt: skip
        say(f"{shards.tokens.shape[0]:,} tokens of data; the head's vocabulary: {ids.numel()} tokens")
        facts = tr.train_head(
            head, teacher, shards, model.cos, model.sin, settings, run, progress_printer("eagle", err)
        )
        facts |= {"data_tokens": int(shards.tokens.shape[0]), "head_vocab": ids.numel(), "taps": list(taps)}
        eagle.save(dest, head, tokenizer=tgt.fingerprint, target=weights_fp, facts=facts)
    say("eagle: " + ", ".join(f"{k}={v}" for k, v in facts.items()) + f" -> {dest}")
