"""`smallem generate` end to end, against the tiny on-disk family of conftest.

stdout carries the generated text alone, stderr the statistics; every bad input ends
with a non-zero exit and one `error:` line on stderr, never a traceback.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import Result
from conftest import FAMILY_CFG, Family, random_model, random_mtp
from tokenizers import Tokenizer
from typer.testing import CliRunner

from smallem_cli import defaults as D
from smallem_cli.cli import app as cli
from smallem_cli.cli.app import app
from smallem_cli.config import ModelConfig
from smallem_cli.model import checkpoint

PROMPT = "The quick brown fox"
STATS_LINE = re.compile(
    r"(\d+) tokens in \d+\.\d\d s: \d+\.\d tok/s, acceptance (\d\.\d\d), (\d+\.\d\d) tokens/pass "
    r"\((.+), k=(\d+), (?:eager|native|native-avx2)\)"
)


def generate(family: Family, *args: str, input: str | bytes | None = None, prompt: str | None = PROMPT) -> Result:
    argv = ["generate", *([prompt] if prompt is not None else []), "--target", str(family.target), *args]
    return CliRunner().invoke(app, argv, input=input)


def ok(result: Result) -> Result:
    assert result.exit_code == 0, (result.exit_code, result.stderr, result.exception)
    assert result.exception is None
    return result


def as_json(result: Result) -> dict:
    ok(result)
    lines = result.stdout.splitlines()
    assert len(lines) == 1  # one JSON object, nothing else
    return json.loads(lines[0])


def stats_of(result: Result) -> re.Match:
    assert result.stderr.endswith("\n") and result.stderr.count("\n") == 1  # one line
    m = STATS_LINE.fullmatch(result.stderr[:-1])
    assert m is not None, result.stderr
    return m


def refused(result: Result, message: str) -> None:
    """Non-zero exit, nothing on stdout, exactly one clear line on stderr, no traceback."""
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit), result.exception  # a clean exit, not a crash
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert re.search(message, lines[0]), lines[0]
    assert "Traceback" not in result.output


# --- output streams ----------------------------------------------------------------------------
def test_stdout_holds_only_the_text(family: Family) -> None:
    data = as_json(generate(family, "--proposer", "none", "-n", "40", "--json", "-q"))
    tokens, text = data["tokens"], data["text"]
    assert len(tokens) == 40 and text.strip()
    assert Tokenizer.from_file(str(family.tokenizer)).decode(tokens) == text
    res = ok(generate(family, "--proposer", "none", "-n", "40"))
    assert res.stdout == text + "\n"
    assert "tok/s" not in res.stdout and "acceptance" not in res.stdout


def test_stats_go_to_stderr(family: Family) -> None:
    res = ok(generate(family, "--proposer", "draft-2l", "-n", "30", "-k", "3"))
    n, acceptance, per_pass, proposer, k = stats_of(res).groups()
    assert (int(n), proposer, int(k)) == (30, "draft-2l", 3)
    assert 0 < float(acceptance) <= 1 and 1 < float(per_pass) <= 4
    assert "tokens" not in res.stdout


def test_quiet_drops_the_stats(family: Family) -> None:
    loud = ok(generate(family, "--proposer", "mtp", "-n", "20"))
    quiet = ok(generate(family, "--proposer", "mtp", "-n", "20", "--quiet"))
    assert quiet.stderr == "" and loud.stderr != ""
    assert quiet.stdout == loud.stdout
    assert ok(generate(family, "--proposer", "mtp", "-n", "20", "-q", "--json")).stderr == ""


def test_json_output(family: Family) -> None:
    data = as_json(generate(family, "--proposer", "draft-2l", "-k", "2", "-n", "25", "--json"))
    assert set(data) == {"text", "tokens", "stats"}
    assert len(data["tokens"]) == 25 and all(isinstance(t, int) and 0 <= t < 300 for t in data["tokens"])
    st = data["stats"]
    assert {"tokens_per_s", "acceptance_rate", "tokens_per_pass", "proposer", "k"} <= set(st)
    assert st["proposer"] == "draft-2l" and st["k"] == 2 and st["new_tokens"] == 25
    assert st["tokens_per_s"] > 0 and 0 <= st["acceptance_rate"] <= 1 and 1 <= st["tokens_per_pass"] <= 3
    plain = ok(generate(family, "--proposer", "draft-2l", "-k", "2", "-n", "25", "-q"))
    assert plain.stdout == data["text"] + "\n"


# --- the prompt from stdin ---------------------------------------------------------------------
def test_prompt_from_stdin(family: Family) -> None:
    args = ("--proposer", "none", "-n", "15", "-q")
    direct = ok(generate(family, *args)).stdout
    assert ok(generate(family, *args, prompt="-", input=PROMPT)).stdout == direct
    assert ok(generate(family, *args, prompt=None, input=PROMPT)).stdout == direct
    assert ok(generate(family, *args, prompt=None, input=PROMPT.encode())).stdout == direct


def test_unicode_prompt_from_stdin(family: Family) -> None:
    args = ("--proposer", "none", "-n", "10", "-q")
    text = "Caf\u00e9 cr\u00e8me"
    assert (
        ok(generate(family, *args, prompt="-", input=text.encode())).stdout
        == ok(generate(family, *args, prompt=text)).stdout
    )


# --- proposers ---------------------------------------------------------------------------------
def test_proposers_give_the_same_greedy_text(family: Family) -> None:
    ref = ok(generate(family, "--proposer", "none", "-n", "60", "-q")).stdout
    assert len(ref) > 20
    runs = [("draft-2l", k) for k in (1, 3, 5)] + [("mtp", k) for k in (1, 2, 4)] + [(str(family.draft), 3)]
    accepted = 0.0
    for proposer, k in runs:
        data = as_json(generate(family, "--proposer", proposer, "-k", str(k), "-n", "60", "-q", "--json"))
        assert data["text"] + "\n" == ref, (proposer, k)
        assert data["stats"]["k"] == k
        accepted += data["stats"]["acceptance_rate"]
        assert ok(generate(family, "--proposer", proposer, "-k", str(k), "-n", "60", "-q")).stdout == ref
    assert accepted > 0  # some guesses were kept: the rounds were not all one-token ones


def test_default_k_per_proposer(family: Family) -> None:
    # the defaults are declared once, in smallem_cli/defaults.py
    for greedy, mode in ((True, []), (False, ["--temperature", "1"])):
        names = ("none", "draft-2l", "mtp", str(family.draft))
        cases = [(n, D.default_k(n, greedy)) for n in names]
        assert cases[0][1] == 0 and cases[3][1] == D.K_OTHER and all(k >= 1 for _, k in cases[1:])
        for proposer, k in cases:
            data = as_json(generate(family, "--proposer", proposer, "-n", "5", "-q", "--json", *mode))
            assert data["stats"]["k"] == k, (proposer, mode)
    assert D.default_k("draft-2l", False) != D.default_k("draft-2l", True)  # the modes' defaults differ: both exercised


def test_cut_proposer_heads_give_the_same_greedy_text(family: Family) -> None:
    """--proposer-vocab N keeps the N most frequent tokens in the proposer's head: guesses change, text does not."""
    ref = ok(generate(family, "--proposer", "none", "-n", "50", "-q")).stdout
    for proposer in ("draft-2l", "mtp"):
        rates = {}
        for vocab in ("0", "20", "300", "5000"):
            args = ("--proposer", proposer, "--proposer-vocab", vocab, "-n", "50", "-q", "--json")
            data = as_json(generate(family, *args))
            assert data["text"] + "\n" == ref, (proposer, vocab)
            rates[vocab] = data["stats"]["accepted_at"]
        assert rates["0"] == rates["300"] == rates["5000"]  # a cut holding every token changes no guess
        assert rates["20"] != rates["0"]  # a real cut does change them


def test_cut_proposer_head_sampling_is_seeded(family: Family) -> None:
    def run(seed: int) -> dict:
        args = ("--proposer", "draft-2l", "--proposer-vocab", "20", "--temperature", "1.0", "--seed", str(seed))
        return as_json(generate(family, *args, "-n", "30", "-q", "--json"))

    a, b, c = run(3), run(3), run(4)
    assert a["tokens"] == b["tokens"] != c["tokens"]
    assert len(a["tokens"]) == 30 and a["stats"]["acceptance_rate"] > 0


def test_sampling_is_seeded(family: Family) -> None:
    def text(seed: int) -> str:
        args = ("--proposer", "draft-2l", "--temperature", "0.9", "--top-p", "0.9", "--seed", str(seed))
        return ok(generate(family, *args, "-n", "40", "-q")).stdout

    assert text(1) == text(1)
    assert text(1) != text(2)
    assert text(1) != ok(generate(family, "--proposer", "draft-2l", "-n", "40", "-q")).stdout


def test_context_edge(family: Family) -> None:
    """prompt + max-new-tokens + k + 1 may reach the context (256) exactly, not pass it."""
    n_prompt = len(Tokenizer.from_file(str(family.tokenizer)).encode(PROMPT).ids)
    n = FAMILY_CFG.max_seq_len - n_prompt - (D.default_k("mtp", True) + 1)  # room for mtp's verify pass (default k)
    ref = ok(generate(family, "--proposer", "none", "-n", str(n), "-q")).stdout
    data = as_json(generate(family, "--proposer", "mtp", "-n", str(n), "-q", "--json"))
    assert data["text"] + "\n" == ref and len(data["tokens"]) == n
    refused(generate(family, "--proposer", "mtp", "-n", str(n + 1)), r"exceeds the model's context of 256 tokens")


# --- refusals ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bad(family: Family, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bad")
    files = {"missing": d / "nothing.safetensors", "corrupt": d / "corrupt.safetensors"}
    files["corrupt"].write_bytes(os.urandom(4096))
    files["truncated"] = d / "truncated.safetensors"
    whole = family.target.read_bytes()
    files["truncated"].write_bytes(whole[: len(whole) // 2])
    other = ModelConfig(vocab_size=320, dim=24, n_layers=1, n_heads=2, n_kv_heads=2, hidden_dim=48, max_seq_len=256)
    files["other-vocab"] = d / "other-vocab.safetensors"
    checkpoint.save(files["other-vocab"], random_model(other, seed=1), tokenizer="0123456789abcdef")
    same_size = ModelConfig(vocab_size=300, dim=24, n_layers=1, n_heads=2, n_kv_heads=2, hidden_dim=48, max_seq_len=256)
    files["other-tokenizer"] = d / "other-tokenizer.safetensors"
    checkpoint.save(files["other-tokenizer"], random_model(same_size, seed=1), tokenizer="0123456789abcdef")
    files["other-mtp"] = d / "other-mtp.safetensors"
    checkpoint.save(files["other-mtp"], random_mtp(FAMILY_CFG, seed=3), tokenizer="0123456789abcdef")
    return files


@pytest.mark.parametrize(
    ("case", "args", "message"),
    [
        ("k=0", ["-k", "0", "--proposer", "draft-2l"], r"k must be between 1 and 64, got 0"),
        ("k=1000", ["-k", "1000", "--proposer", "mtp"], r"k must be between 1 and 64, got 1000"),
        ("negative temperature", ["--temperature", "-0.5"], r"temperature must be >= 0, got -0\.5"),
        ("nan temperature", ["--temperature", "nan"], r"temperature must be >= 0"),
        ("top-p 0", ["--temperature", "1", "--top-p", "0"], r"top-p must be in \(0, 1\], got 0\.0"),
        ("top-p 1.5", ["--top-p", "1.5"], r"top-p must be in \(0, 1\], got 1\.5"),
        ("top-k 0", ["--temperature", "1", "--top-k", "0"], r"top-k must be >= 1, got 0"),
        ("max-new-tokens 0", ["-n", "0"], r"--max-new-tokens must be >= 1, got 0"),
        ("proposer-vocab -1", ["--proposer-vocab", "-1"], r"--proposer-vocab must be >= 0, got -1"),
        ("beyond the context", ["-n", "250"], r"\+ --max-new-tokens 250 \+ k\+1 exceeds the model's context of 256"),
        ("beyond the context, no proposer", ["-n", "253", "--proposer", "none"], r"exceeds the model's context"),
        ("unknown device", ["--device", "tpu"], r"unknown device 'tpu'"),
        ("unsupported device", ["--device", "meta"], r"unsupported device 'meta'"),
        ("unknown proposer name", ["--proposer", "draft-9l"], r"checkpoint not found: draft-9l"),
        ("shipped proposer absent", ["--proposer", "draft-4l"], r"checkpoint not found: .*draft-4l\.safetensors"),
    ],
)
def test_bad_options_are_refused(family: Family, case: str, args: list[str], message: str) -> None:
    refused(generate(family, *args), message)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_refused(family: Family) -> None:
    refused(generate(family, "--device", "cuda"), r"CUDA was asked for, but this machine has no usable CUDA device")


@pytest.mark.parametrize(
    ("prompt", "input", "message"),
    [
        ("", None, r"the prompt is empty"),
        (" \n\t ", None, r"the prompt is empty"),
        ("-", "", r"the prompt is empty"),
        (None, "  \n", r"the prompt is empty"),
        ("-", b"\xff\xfe", r"stdin is not valid UTF-8 \(byte 0\)"),
        (None, b"ok \xc3(", r"stdin is not valid UTF-8 \(byte 3\)"),
    ],
)
def test_bad_prompts_are_refused(family: Family, prompt: str | None, input: str | bytes | None, message: str) -> None:
    refused(generate(family, prompt=prompt, input=input), message)


@pytest.mark.parametrize(
    ("where", "which", "message"),
    [
        ("target", "missing", r"checkpoint not found: .*nothing\.safetensors"),
        ("target", "corrupt", r"cannot read checkpoint .*corrupt\.safetensors"),
        ("target", "truncated", r"cannot read checkpoint .*truncated\.safetensors"),
        ("proposer", "missing", r"checkpoint not found: .*nothing\.safetensors"),
        ("proposer", "corrupt", r"cannot read checkpoint .*corrupt\.safetensors"),
        ("proposer", "other-vocab", r"does not share the target's tokenizer \(vocabulary 320 vs 300"),
        ("proposer", "other-tokenizer", r"does not share the target's tokenizer .*fingerprint 0123456789abcdef"),
        ("proposer", "other-mtp", r"does not share the target's tokenizer .*fingerprint 0123456789abcdef"),
    ],
)
def test_bad_checkpoints_are_refused(
    family: Family, bad: dict[str, Path], where: str, which: str, message: str
) -> None:
    path = str(bad[which])
    argv = ["generate", PROMPT, "--target", path] if where == "target" else ["generate", PROMPT, "--proposer", path]
    if where == "proposer":
        argv += ["--target", str(family.target)]
    refused(CliRunner().invoke(app, argv), message)


def test_mtp_module_as_target_is_refused(family: Family) -> None:
    refused(
        CliRunner().invoke(app, ["generate", PROMPT, "--target", str(family.mtp)]), r"holds a mtp module, not a model"
    )


def test_target_without_tokenizer_is_refused(family: Family, tmp_path: Path) -> None:
    shutil.copy(family.target, tmp_path / "target.safetensors")
    res = CliRunner().invoke(app, ["generate", PROMPT, "--target", str(tmp_path / "target.safetensors")])
    refused(res, r"tokenizer not found: .*tokenizer\.json")


def test_stats_line_is_one_line(family: Family, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Even when longer than the console: rich would wrap it at 80 columns on a pipe or in a file."""
    monkeypatch.setattr(cli.err, "width", 80)  # what rich uses when stderr is a file or a pipe
    long_name = tmp_path / ("draft-with-a-long-descriptive-name-" * 3 + ".safetensors")
    shutil.copy(family.draft, long_name)
    res = ok(generate(family, "--proposer", str(long_name), "-n", "10"))
    assert len(res.stderr.splitlines()) == 1 and STATS_LINE.fullmatch(res.stderr.rstrip("\n"))


# --- known bugs (see the report): each marks what the fix must make pass -------------------------


def test_draft_with_a_shorter_context_is_refused(family: Family, tmp_path: Path) -> None:
    short = ModelConfig(vocab_size=300, dim=24, n_layers=1, n_heads=2, n_kv_heads=2, hidden_dim=48, max_seq_len=32)
    path = tmp_path / "short.safetensors"
    checkpoint.save(path, random_model(short, seed=1), tokenizer=family.fingerprint)
    refused(generate(family, "--proposer", str(path), "-n", "60"), r"context")


def test_mtp_with_other_heads_is_refused(family: Family, tmp_path: Path) -> None:
    cfg = ModelConfig(vocab_size=300, dim=32, n_layers=2, n_heads=2, n_kv_heads=2, hidden_dim=64, max_seq_len=256)
    path = tmp_path / "mtp-2h.safetensors"
    checkpoint.save(path, random_mtp(cfg, seed=3), tokenizer=family.fingerprint)
    refused(generate(family, "--proposer", str(path), "-n", "20"), r"MTP|heads")


def test_corrupt_tokenizer_is_refused(family: Family, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    refused(generate(family, "--tokenizer", str(tmp_path / "tokenizer.json")), r"tokenizer")


@pytest.mark.parametrize("name", ["run[/b]", "run[bold]x"])
def test_error_messages_are_not_markup(tmp_path: Path, name: str) -> None:
    path = tmp_path / name / "target.safetensors"
    refused(CliRunner().invoke(app, ["generate", PROMPT, "--target", str(path)]), re.escape(f"not found: {path}"))


def test_saved_checkpoints_follow_the_umask(tmp_path: Path) -> None:
    """safetensors writes 0600 whatever the umask; a saved checkpoint gets the user's usual mode."""
    old = os.umask(0o022)
    try:
        checkpoint.save(tmp_path / "m.safetensors", random_model(FAMILY_CFG, seed=0), tokenizer="t")
        os.umask(0o027)
        checkpoint.save(tmp_path / "n.safetensors", random_model(FAMILY_CFG, seed=0), tokenizer="t")
    finally:
        os.umask(old)
    assert (tmp_path / "m.safetensors").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "n.safetensors").stat().st_mode & 0o777 == 0o640
