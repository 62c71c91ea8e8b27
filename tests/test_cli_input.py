"""What a user types, end to end: one `error:` line and exit 2, never a traceback, never
an empty answer with exit 0; Ctrl-C is exit 130, quietly, whenever it comes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Family
from test_cli import PROMPT, STATS_LINE, as_json, generate, ok, refused
from typer.testing import CliRunner

from smallem_cli.cli.app import app
from smallem_cli.interop import hf

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--temperature", "1e-40"], r"temperature 1e-40 is too small: below 0\.001 .*overflow.*use 0 for greedy"),
        (["--temperature", "0.0005"], r"temperature 0\.0005 is too small"),
        (["--temperature", "inf"], r"temperature must be >= 0 and finite, got inf"),
        (["--temperature", "-inf"], r"temperature must be >= 0, got -inf"),
        (["--temperature", "1", "--top-p", "nan"], r"top-p must be in \(0, 1\], got nan"),
        (["--temperature", "1", "--top-p", "inf"], r"top-p must be in \(0, 1\], got inf"),
        (["--temperature", "1", "--top-k", "-3"], r"top-k must be >= 1, got -3"),
        (["--seed", "99999999999999999999"], r"--seed must be between 0 and 2\^63-1, got 99999999999999999999"),
        (["--seed", "99999999999999999999", "--temperature", "1"], r"--seed must be between 0 and 2\^63-1"),
        (["--seed", "-1"], r"--seed must be between 0 and 2\^63-1, got -1"),
        (["--proposer", "none", "-k", "99"], r"k must be between 1 and 64, got 99"),
        (["--proposer", "none", "-k", "-1"], r"k must be between 1 and 64, got -1"),
    ],
)
def test_bad_sampling_options_are_refused(family: Family, args: list[str], message: str) -> None:
    refused(generate(family, *args, "-n", "5"), message)


def test_a_k_with_no_proposer_is_ignored(family: Family) -> None:
    """`none` proposes nothing: a k in 1..MAX_K (or 0) is accepted and has no effect."""
    ref = as_json(generate(family, "--proposer", "none", "-n", "8", "--json", "-q"))
    for k in ("0", "3", "16"):
        data = as_json(generate(family, "--proposer", "none", "-k", k, "-n", "8", "--json", "-q"))
        assert data["stats"]["k"] == 0 and data["tokens"] == ref["tokens"]


def test_smallest_temperature_samples(family: Family) -> None:
    data = as_json(generate(family, "--temperature", "0.001", "-n", "10", "--json", "-q"))
    assert len(data["tokens"]) == 10  # not one id-0 token and a stop


@pytest.mark.parametrize("folders", [("run[", "]"), ("run[", "b]"), ("[bold]x",), ("a[red]b[", "red]")])
def test_markup_in_a_path_is_printed_as_is(family: Family, tmp_path: Path, folders: tuple[str, ...]) -> None:
    """The statistics line names the proposer's path: `[/]` in it is text, not rich markup."""
    path = tmp_path.joinpath(*folders, "draft.safetensors")
    path.parent.mkdir(parents=True)
    shutil.copy(family.draft, path)
    res = ok(generate(family, "--proposer", str(path), "-n", "10"))
    m = STATS_LINE.fullmatch(res.stderr.rstrip("\n"))
    assert m is not None and m.group(4) == str(path), res.stderr
    refused(generate(family, "--proposer", str(path.parent / "absent.safetensors")), r"\[")


def test_json_on_ctrl_c_keeps_what_was_generated(family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*_: object, **__: object) -> Iterator[list[int]]:
        yield [40, 41]
        yield [42]
        raise KeyboardInterrupt

    monkeypatch.setattr("smallem_cli.engine.generate.answer", interrupted)
    res = CliRunner().invoke(app, ["generate", PROMPT, "--target", str(family.target), "--json"])
    assert res.exit_code == 130
    data = json.loads(res.stdout)
    assert data["interrupted"] is True and data["tokens"] == [40, 41, 42] and data["text"]
    plain = CliRunner().invoke(app, ["generate", PROMPT, "--target", str(family.target)])
    assert plain.exit_code == 130 and plain.stderr.strip() == "interrupted"


def test_hf_target_uses_no_proposer_by_default(family: Family, tmp_path: Path) -> None:
    """An unrelated mtp.safetensors beside the HF folder is neither used nor looked for."""
    folder = tmp_path / "target-hf"
    hf.export_hf(family.target, folder, family.tokenizer)
    shutil.copy(family.mtp, tmp_path / "mtp.safetensors")
    res = CliRunner().invoke(app, ["generate", PROMPT, "--target", str(folder), "-n", "5", "--json", "-q"])
    data = as_json(res)
    assert (data["stats"]["proposer"], data["stats"]["k"]) == ("none", 0)
    res = CliRunner().invoke(app, ["generate", PROMPT, "--target", str(folder), "--proposer", "mtp"])
    refused(res, r"proposer 'mtp' is a shipped name")


def test_config_of_the_wrong_type_is_named(family: Family, tmp_path: Path) -> None:
    from test_loaders import resave

    bad = resave(family.target, tmp_path / "typed.safetensors", config={"dim": "32"})
    shutil.copy(family.tokenizer, tmp_path / "tokenizer.json")
    res = CliRunner().invoke(app, ["generate", PROMPT, "--target", str(bad)])
    refused(res, r"typed\.safetensors: bad config in metadata: config field dim must be an integer, got '32'")


def test_files_that_are_not_utf8_are_named(family: Family, tmp_path: Path) -> None:
    (tmp_path / "val.txt").write_bytes(b"In the beginning \xff\xfe")
    res = CliRunner().invoke(app, ["eval", "--target", str(family.target), "--data", str(tmp_path), "--draft", "x"])
    assert res.exit_code == 2  # the draft is looked for first
    res = CliRunner().invoke(app, ["eval", "--target", str(family.target), "--data", str(tmp_path)])
    refused(res, r"val\.txt is not valid UTF-8 \(byte 17\)")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b'{"tokens": [1, 2]}\n\xff\n')
    bench = ["bench", "--target", str(family.target), "--proposers", "draft-2l", "--prompts", str(prompts)]
    refused(CliRunner().invoke(app, bench), r"prompts file .*prompts\.jsonl is not valid UTF-8 \(byte 19\)")


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ('{"tokens": [1, 2]}\nnot json\n', r"prompts\.jsonl, line 2: not a prompt"),
        ('{"text": ""}\n', r'line 1: "text" is empty'),
        ('{"messages": [{"role": "user", "content": "x"}]}\n', r"line 1: the target has no chat template"),
        ('{"tokens": [1, 300]}\n', r"line 1: not a prompt .*ids in 0\.\.299"),
        ('{"tokens": []}\n', r"line 1: not a prompt"),
        ("\n\n", r"holds no prompt"),
        ('{"tokens": [' + ", ".join(["5"] * 250) + "]}\n", r"exceeds the model's context of 256"),
    ],
)
def test_bad_prompts_files_are_refused(family: Family, tmp_path: Path, lines: str, message: str) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(lines)
    bench = ["bench", "--target", str(family.target), "--proposers", "draft-2l", "--prompts", str(prompts)]
    refused(CliRunner().invoke(app, [*bench, "-n", "4", "--repeats", "1"]), message)


def _interrupt(family: Family, delay: float) -> subprocess.CompletedProcess:
    """`smallem generate` as a user runs it, its prompt awaited on a pipe, Ctrl-C after `delay` s."""
    code = "import sys; from smallem_cli.cli import main; sys.argv[0] = 'smallem'; main()"
    argv = [sys.executable, "-c", code, "generate", "--target", str(family.target), "-n", "5"]
    env = os.environ | {"PYTHONPATH": str(REPO)}
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.stdin is not None
    return subprocess.CompletedProcess(argv, p.returncode, out.decode(), err.decode())


@pytest.mark.parametrize("delay", [0.5, 0.8, 1.5])
def test_ctrl_c_while_loading_exits_130_quietly(family: Family, delay: float) -> None:
    """Early (while typer, rich and torch import) or later (awaiting the prompt): no traceback."""
    res = _interrupt(family, delay)
    assert res.returncode == 130, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr and res.stdout == ""


def test_a_tokenizer_larger_than_the_model_is_refused(family: Family, tmp_path: Path) -> None:
    """A checkpoint without a tokenizer fingerprint, given a tokenizer with ids past its vocabulary."""
    from test_loaders import resave
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, 400)}}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "big.json"))
    target = resave(family.target, tmp_path / "anonymous.safetensors", meta={"tokenizer": ""})
    res = CliRunner().invoke(
        app,
        ["generate", "w350", "--target", str(target), "--tokenizer", str(tmp_path / "big.json"), "--proposer", "none"],
    )
    refused(res, r"big\.json: token id 399 does not fit .*anonymous\.safetensors's vocabulary of 300")


def test_bad_thread_counts_are_refused(family: Family, tmp_path: Path) -> None:
    bench = ["bench", "--target", str(family.target), "--proposers", "draft-2l", "--threads", "-1"]
    refused(CliRunner().invoke(app, bench), r"--threads must be between 1 and \d+ \(the CPUs .*\), got -1")
    train = ["train", "draft", "--data", str(tmp_path), "--out", str(tmp_path / "d.safetensors"), "--threads", "0"]
    refused(CliRunner().invoke(app, train), r"--threads must be between 1 and \d+ \(the CPUs .*\), got 0")


def test_help_shows_the_defaults_written_in_it() -> None:
    """A "(default: ...)" inside a help text reaches the user (rich markup would eat "[default: ...]")."""
    res = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "(default: per proposer and mode)" in res.stdout
    assert "(default: ngram+mtp greedy, mtp sampled; HF: none)" in res.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--proposer", "ngram+none"], "takes a model proposer"),
        (["--proposer", "ngram+ngram"], "takes a model proposer"),
    ],
)
def test_bad_ngram_options(family, args: list[str], message: str) -> None:
    res = CliRunner().invoke(app, ["generate", "--target", str(family.target), *args, "Hi"])
    assert res.exit_code == 2 and message in res.stderr and "Traceback" not in res.output


def test_prompts_never_replace_a_file_without_overwrite(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "val.txt").write_text("And God said, Let there be light: and there was light. " * 20)
    out = tmp_path / "p.jsonl"
    out.write_text("mine\n")
    res = CliRunner().invoke(app, ["prompts", "--data", str(data), "--out", str(out), "--count", "1", "--length", "8"])
    assert res.exit_code == 2 and "--overwrite" in res.stderr and out.read_text() == "mine\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sweep-k", "1..100000000"], r"k values must be between 1 and 64"),  # refused before the range is built
        (["--sweep-k", "9..1"], r"bad k range '9\.\.1': the first k is larger than the last"),
        (["--threads", "1000"], r"--threads must be between 1 and \d+ \(the CPUs this process may use\)"),
        (["--batch", ""], r"--batch needs sizes such as 1,4,16,64"),
        (["--prompts", "/dev/zero"], r"prompts file /dev/zero is larger than 64 MiB"),
    ],
)
def test_bench_sizes_are_bounded_before_any_work(family: Family, args: list[str], message: str) -> None:
    import resource
    import time

    t0, before = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    bench = ["bench", "--target", str(family.target), "--proposers", "draft-2l", "-n", "4", "--repeats", "1"]
    refused(CliRunner().invoke(app, [*bench, *args]), message)
    assert time.monotonic() - t0 < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB: no range or file held whole


def test_threads_beyond_the_cpus_are_refused(family: Family) -> None:
    refused(generate(family, "--threads", "1000"), r"--threads must be between 1 and \d+")


def test_a_prompt_the_tokenizer_refuses_is_one_line(family: Family) -> None:
    """Bytes of a command line that are not UTF-8 reach Python as lone surrogates, which the
    tokenizer refuses: one line, exit 2 (a chat message: `test_chat`)."""
    refused(generate(family, "-n", "3", prompt="\udcff and God said"), "tokenizer refused the prompt")
