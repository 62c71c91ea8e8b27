"""`bench` with no --proposers benches the proposers that apply to its target: the shipped ones beside a smallem
checkpoint; the n-gram lookup, and an MTP module found beside it, for a GGUF file or an HF folder (which ship none)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import Family
from typer.testing import CliRunner

from smallem_cli.cli.app import app
from smallem_cli.interop.hf import export_hf


def benched(target: Path, tmp_path: Path) -> set[str]:
    """The proposers of `bench --target TARGET`'s rows (a short run)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"tokens": [5, 6, 7, 8, 9, 10]}) + "\n")
    argv = ["bench", "--target", str(target), "--prompts", str(prompts), "-n", "4", "--repeats", "1", "--modes",
            "greedy", "--engines", "eager", "--json"]  # fmt: skip
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 0, (res.stderr, res.exception)
    return {r["proposer"] for r in json.loads(res.stdout)["rows"]}


def test_a_smallem_checkpoint_gets_the_shipped_proposers_beside_it(family: Family, tmp_path: Path) -> None:
    assert benched(family.target, tmp_path) == {"none", "draft-2l", "mtp"}  # the tiny family has no draft-4l
    alone = tmp_path / "alone"
    alone.mkdir()
    for f in (family.target, family.tokenizer):
        shutil.copy(f, alone / f.name)
    assert benched(alone / family.target.name, tmp_path) == {"none", "ngram"}


def test_a_gguf_file_gets_ngram_and_the_mtp_module_found_beside_it(family: Family, tmp_path: Path) -> None:
    pytest.importorskip("gguf", reason="gguf is not installed (the gguf extra)")
    from smallem_cli.interop.gguf import export_gguf

    models = tmp_path / "models"
    models.mkdir()
    gguf = models / "Tiny.Q8.gguf"
    export_gguf(family.target, gguf, family.tokenizer)
    assert benched(gguf, tmp_path) == {"none", "ngram"}
    shutil.copy(family.mtp, models / "Tiny.mtp.safetensors")  # trained for this vocabulary and these states
    shutil.copy(family.draft, models / "other-mtp.safetensors")  # a draft, not an MTP module: it does not apply
    (models / "broken.mtp.safetensors").write_bytes(b"not a checkpoint")
    assert benched(gguf, tmp_path) == {"none", "ngram", str(models / "Tiny.mtp.safetensors")}


def test_an_hf_folder_gets_ngram(family: Family, tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    export_hf(family.target, hf, family.tokenizer)
    assert benched(hf, tmp_path) == {"none", "ngram"}
