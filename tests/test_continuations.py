"""`smallem data --continuations`: a corpus of the target's own text, to fit proposers on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CORPUS, Family
from typer.testing import CliRunner

from smallem_cli.cli.app import app
from smallem_cli.engine import family as fam
from smallem_cli.engine.family import NONE
from smallem_cli.engine.generate import generate
from smallem_cli.model.tokenizer import load_tokenizer
from smallem_cli.spec.sampling import Sampling
from smallem_cli.train import continuations as C
from smallem_cli.train import data as corpus


def test_contexts_lie_within_one_document_and_follow_the_seed() -> None:
    eot = 0
    ids = np.array([5, 6, 7, 8, eot, 9, 10, eot, 11, 12, 13, 14, 15, eot], dtype=np.uint16)
    got = C.contexts(ids, 20, 3, seed=1, eot=eot)
    allowed = {(5, 6, 7), (6, 7, 8), (11, 12, 13), (12, 13, 14), (13, 14, 15)}  # no window holds eot
    assert len(got) == 20 and set(got) <= allowed and len(set(got)) > 1
    assert C.contexts(ids, 20, 3, seed=1, eot=eot) == got
    assert C.contexts(ids, 20, 3, seed=2, eot=eot) != got
    with pytest.raises(ValueError, match="within one document"):
        C.contexts(ids, 5, 6, seed=1, eot=eot)  # no document holds 6 tokens
    reqs = C.requests(got[:6], 10, 3, seed=7)
    assert [r.sampling.temperature for r in reqs] == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert [r.sampling.seed for r in reqs if r.sampling.temperature] == [7, 10]
    assert all(r.prompt == c and r.max_new_tokens == 10 for r, c in zip(reqs, got, strict=False))


def test_continuations_command_writes_the_targets_own_text(family: Family, tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text((CORPUS + "\n\n") * 300, encoding="utf-8")
    runner = CliRunner()
    src = tmp_path / "data"
    assert runner.invoke(app, ["data", str(text), "--out", str(src)]).exit_code == 0
    out = tmp_path / "gen"
    argv = ["data", "--continuations", "6", "--source", str(src), "--target", str(family.target), "--out", str(out)]
    argv += ["--context-tokens", "8", "--new-tokens", "12", "--sampled-every", "3"]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, (result.stderr, result.exception)
    docs = corpus.read_documents(out / "train.txt")
    assert len(docs) == 6
    assert (out / "val.txt").read_bytes() == (src / "val.txt").read_bytes()  # held-out text, as it was

    # each greedy document is its context followed by what the target alone writes after it
    tok = load_tokenizer(family.tokenizer)
    eot = tok.token_to_id(corpus.EOT)
    ctxs = C.contexts(corpus.token_file(family.tokenizer, src / "train.txt"), 6, 8, 0, eot)
    model = fam.load_target(family.target, torch.device("cpu")).model
    for i, ctx in enumerate(ctxs):
        if i % 3 == 0:  # sampled at T = 1 (the engine's own seeded draws): its context leads it
            assert docs[i].startswith(tok.decode(list(ctx)))
            continue
        new, _ = generate(model, NONE, list(ctx), 12, 0, Sampling(), (eot,))
        assert docs[i] == tok.decode([*ctx, *new])

    # nothing replaced unasked, and the source is not an output: one line each, before any work
    before = (out / "train.txt").read_bytes()
    result = runner.invoke(app, [*argv[:-6], "--context-tokens", "8", "--new-tokens", "5"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "--overwrite" in result.stderr
    assert (out / "train.txt").read_bytes() == before
    same = ["data", "--continuations", "2", "--source", str(src), "--target", str(family.target), "--out", str(src)]
    result = runner.invoke(app, same)
    assert result.exit_code == 2 and "contexts come from" in result.stderr
    result = runner.invoke(app, ["data", str(text), "--continuations", "2", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "--source" in result.stderr


def test_a_continued_proposer_keeps_its_cut(family: Family, tmp_path: Path) -> None:
    """A proposer continued on other text (the target's own) keeps its ranking of the vocabulary,
    the tokens its cut head guesses with; a new one ranks its training text's."""
    from smallem_cli.model import checkpoint

    text = tmp_path / "corpus.txt"
    text.write_text((CORPUS + "\n\n") * 300, encoding="utf-8")
    own = list(range(299, 99, -1))  # a ranking no text gives
    model, _ = checkpoint.load_model(family.draft)
    init = tmp_path / "init.safetensors"
    checkpoint.save(init, model, tokenizer=family.fingerprint, vocab_rank=own)
    common = ["--data", str(tmp_path / "data"), "--tokenizer", str(family.tokenizer), "--target", str(family.target)]
    common += ["--budget", "1", "--batch-size", "2"]
    out = tmp_path / "continued.safetensors"
    argv = ["train", "draft", "--text", str(text), *common, "--init", str(init), "--distill", "--out", str(out)]
    result = CliRunner().invoke(app, [*argv, "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, (result.stderr, result.exception)
    assert checkpoint.vocab_rank(checkpoint.read_meta(out), out, 300) == own
    # a new member (no checkpoint it continues) lists its training text's tokens by frequency
    from smallem_cli.train.loop import save_family_member, vocab_rank

    ids = corpus.encode_file(family.tokenizer, tmp_path / "data" / "train.txt")
    new = tmp_path / "new.safetensors"
    save_family_member(new, model, family.fingerprint, {}, ids)
    assert checkpoint.vocab_rank(checkpoint.read_meta(new), new, 300) == vocab_rank(ids, 300) != own


def test_an_mtp_module_for_a_model_we_did_not_train(family: Family, tmp_path: Path) -> None:
    """A GGUF target (its tokenizer inside): its own continuations (`data --continuations`), an MTP
    module fitted to it (`train mtp --target FILE`), saved apart and used with `--proposer PATH`:
    greedy text as the target alone's, its guesses offered; a draft is refused for it in one line."""
    pytest.importorskip("gguf")
    from smallem_cli.model import checkpoint

    gguf = tmp_path / "target.gguf"
    runner = CliRunner()
    assert runner.invoke(app, ["export", str(family.target), str(gguf), "--format", "gguf"]).exit_code == 0
    text = tmp_path / "corpus.txt"
    text.write_text((CORPUS + "\n\n") * 300, encoding="utf-8")
    src, own = tmp_path / "data", tmp_path / "own"
    assert runner.invoke(app, ["data", str(text), "--out", str(src)]).exit_code == 0
    argv = ["data", "--continuations", "8", "--source", str(src), "--target", str(gguf), "--out", str(own)]
    result = runner.invoke(app, [*argv, "--context-tokens", "8", "--new-tokens", "24"])
    assert result.exit_code == 0, (result.stderr, result.exception)
    mtp = tmp_path / "mtp.safetensors"
    argv = ["train", "mtp", "--target", str(gguf), "--data", str(own), "--out", str(mtp), "--tokens", "2048"]
    argv += ["--batch-size", "2", "--no-compile", "--run-dir", str(tmp_path / "run")]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, (result.stderr, result.exception)
    meta = checkpoint.read_meta(mtp)
    assert meta["kind"] == "mtp" and meta["tokenizer"] == fam.load_target(gguf, torch.device("cpu")).fingerprint
    gen = ["generate", "In the beginning", "--target", str(gguf), "-n", "24", "--json", "--engine", "eager"]
    alone = runner.invoke(app, [*gen, "--proposer", "none"])
    got = runner.invoke(app, [*gen, "--proposer", str(mtp), "-k", "3"])
    assert got.exit_code == 0, (got.stderr, got.exception)
    import json

    ours, ref = json.loads(got.stdout), json.loads(alone.stdout)
    assert ours["tokens"] == ref["tokens"] and ours["stats"]["rounds_by_guesses"][3] > 0  # k = 3 guesses offered
    draft = ["train", "draft", "--distill", "--target", str(gguf), "--data", str(own), "--out", str(tmp_path / "d")]
    refused = runner.invoke(app, draft)
    assert refused.exit_code == 2 and refused.stderr.count("\n") == 1 and "MTP module" in refused.stderr
