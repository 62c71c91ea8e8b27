"""`bench --prompts`: a line's prompt as "tokens", as "text" (the target's tokenizer) or as
"messages" (its chat template), each bad line one error naming the file and the line; and the
shipped prompts/chat.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import Family
from test_chat import TEMPLATE
from test_cli import refused
from tokenizers import Tokenizer
from typer.testing import CliRunner

from smallem_cli import options as O
from smallem_cli.bench import run as bench
from smallem_cli.cli.app import app
from smallem_cli.engine import family as fam
from smallem_cli.interop.hf import export_hf
from smallem_cli.model.chat import render

REPO = Path(__file__).resolve().parents[1]
CHAT = REPO / "prompts" / "chat.jsonl"
TEXT = "In the beginning God created the heaven and the earth."
CONV = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Who made the earth?"}]
# the conversation through TEMPLATE, with the generation prompt
RENDERED = "<|endoftext|>system: Be brief\n<|endoftext|>user: Who made the earth?\nassistant:"


def with_template(folder: Path, template: str) -> None:
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(tc | {"chat_template": template}))


@pytest.fixture
def hf_dir(family: Family, tmp_path: Path) -> Path:
    """The family's target as an HF folder with a chat template, whose tokenizer adds a special token
    (`<|endoftext|>`, id 0) before every text it encodes, as many real models' tokenizers add a BOS."""
    out = tmp_path / "hf"
    export_hf(family.target, out, family.tokenizer)
    with_template(out, TEMPLATE)
    tj = json.loads((out / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    tj["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}},
    }
    (out / "tokenizer.json").write_text(json.dumps(tj))
    return out


def lines(path: Path, *objs: object) -> Path:
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs), encoding="utf-8")
    return path


def read(target: Path, path: Path, max_new: int = 8) -> list[list[int]]:
    tgt = fam.load_target(target, torch.device("cpu"))
    return O.read_prompts(path, tgt.model.cfg, max_new, {"x": [2]}, tgt.tok, tgt.chat)


def test_text_and_messages_lines_are_the_targets_ids(family: Family, hf_dir: Path, tmp_path: Path) -> None:
    """A "text" line: the tokenizer's ids with the special token it adds; "messages": the rendered
    template's ids, nothing added (the template writes its own start: not doubled); "tokens": as given."""
    plain = Tokenizer.from_file(str(family.tokenizer))  # the same vocabulary, no post-processor: adds nothing
    tgt = fam.load_target(hf_dir, torch.device("cpu"))
    assert render(tgt.chat, CONV) == RENDERED
    assert tgt.tok.encode(TEXT).ids[0] == 0  # the fixture's tokenizer adds one
    path = lines(tmp_path / "p.jsonl", {"tokens": [5, 6, 7], "text": "ignored"}, {"text": TEXT}, "", {"messages": CONV})
    got = read(hf_dir, path)
    assert got[0] == [5, 6, 7]
    assert got[1] == [0, *plain.encode(TEXT).ids]
    assert got[2] == plain.encode(RENDERED).ids and got[2][:2] == [0, plain.encode("system").ids[0]]
    # the smallem checkpoint (its tokenizer adds nothing): "text" is its plain encoding
    assert read(family.target, lines(tmp_path / "q.jsonl", {"text": TEXT})) == [plain.encode(TEXT).ids]


def test_bench_runs_on_text_and_messages(hf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A short `bench` (and `bench --batch`) on such a file: exit 0, every greedy row identical, and
    the prompts timed are the file's ids."""
    path = lines(tmp_path / "p.jsonl", {"text": TEXT}, {"messages": CONV}, {"messages": CONV[1:]})
    want = read(hf_dir, path)
    seen: list[list[list[int]]] = []
    real = bench.run_bench
    monkeypatch.setattr(bench, "run_bench", lambda t, prompts, *a, **kw: seen.append(prompts) or real(t, prompts, *a))
    args = ["bench", "--target", str(hf_dir), "--prompts", str(path), "--proposers", "ngram", "-n", "8"]
    res = CliRunner().invoke(app, [*args, "--repeats", "1", "--modes", "greedy", "--json"])
    assert res.exit_code == 0, (res.stdout, res.stderr)
    out = json.loads(res.stdout)
    assert out["prompts"] == 3 and seen == [want]
    assert [r["identical"] for r in out["rows"]] == ["3/3"] * len(out["rows"]) and len(out["rows"]) >= 2
    res = CliRunner().invoke(app, [*args, "--batch", "1,2", "--repeats", "1", "--json"])
    assert res.exit_code == 0, (res.stdout, res.stderr)
    rows = json.loads(res.stdout)["batch_rows"]
    assert rows and all(r["identical"] == "3/3" for r in rows)


LONG = "In the beginning God created the heaven and the earth. " * 40
USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"text": ""}, r'"text" is empty'),
        ({"text": " \n\t"}, r'"text" is empty'),
        ({"text": 7}, r'"text" must be a string, got int'),
        ({"text": None}, r'"text" must be a string'),
        ({"messages": []}, r'"messages" must be a list of .*not empty'),
        ({"messages": "hi"}, r'"messages" must be a list'),
        ({"messages": ["hi"]}, r'"messages" must be a list'),
        ({"messages": [{"role": "user"}]}, r'message 1: its "role" and "content" must be strings'),
        ({"messages": [USER, {"role": 2, "content": "b"}]}, r'message 2: its "role" and "content" must be strings'),
        ({"messages": [{"role": "user", "content": ["a"]}]}, r"message 1: only text parts are supported"),
        ({"text": "a", "messages": [USER]}, r'a prompt is "text" or "messages", not both'),
        ({"prompt": "a"}, r'not a prompt \(a JSON object with "tokens" \(ids in 0\.\.299\), "text"'),
        ('{"text": "a\\ud800"}', r"the tokenizer refused the prompt"),  # a lone surrogate
        ({"text": LONG}, r"prompt \(\d+ tokens\) \+ --max-new-tokens 4 \+ k\+1 exceeds the model's context of 256"),
        ({"messages": [{"role": "user", "content": LONG}]}, r"prompt \(\d+ tokens\) .*exceeds the model's context"),
    ],
)
def test_each_bad_line_is_one_error_with_its_number(
    hf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: object, message: str
) -> None:
    timed: list[object] = []
    monkeypatch.setattr(bench, "run_bench", lambda *a, **kw: timed.append(a))
    path = lines(tmp_path / "p.jsonl", {"text": TEXT}, "", line, {"text": TEXT})
    args = ["bench", "--target", str(hf_dir), "--prompts", str(path), "--proposers", "ngram", "-n", "4"]
    refused(CliRunner().invoke(app, [*args, "--repeats", "1"]), r"p\.jsonl, line 3: " + message)
    assert timed == []  # refused before any timing
    refused(CliRunner().invoke(app, [*args, "--batch", "2"]), r"p\.jsonl, line 3: " + message)  # the same file


def test_messages_need_a_template_that_accepts_them(family: Family, hf_dir: Path, tmp_path: Path) -> None:
    """A smallem checkpoint has no chat template; a template's own refusal is named with its line."""
    path = lines(tmp_path / "p.jsonl", {"text": TEXT}, {"messages": [USER]})
    args = ["--prompts", str(path), "--proposers", "ngram", "-n", "4", "--repeats", "1"]
    res = CliRunner().invoke(app, ["bench", "--target", str(family.target), *args])
    refused(res, r'p\.jsonl, line 2: the target has no chat template: give this prompt as "text" or "tokens"$')
    with_template(hf_dir, "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system turn first') }}"
                  "{% endif %}{{ messages[0]['content'] }}")  # fmt: skip
    res = CliRunner().invoke(app, ["bench", "--target", str(hf_dir), *args])
    refused(res, r"p\.jsonl, line 2: the chat template refused the conversation: a system turn first$")
    assert read(hf_dir, lines(path, {"messages": CONV})) != []  # a system turn first: accepted


def test_the_shipped_chat_prompts(family: Family, hf_dir: Path) -> None:
    """prompts/chat.jsonl: 16 distinct user instructions, one a line, each rendered through the
    target's template; a target without one is refused at line 1."""
    convs = [json.loads(line)["messages"] for line in CHAT.read_text(encoding="utf-8").splitlines()]
    assert len(convs) == 16 and all(len(c) == 1 and c[0]["role"] == "user" for c in convs)
    assert len({c[0]["content"] for c in convs}) == 16 and all(len(c[0]["content"]) > 20 for c in convs)
    plain = Tokenizer.from_file(str(family.tokenizer))
    assert read(hf_dir, CHAT, max_new=1) == [plain.encode(f"<|endoftext|>user: {c[0]['content']}\nassistant:").ids
                                             for c in convs]  # fmt: skip
    with pytest.raises(O.UsageError, match=r"chat\.jsonl, line 1: the target has no chat template"):
        read(family.target, CHAT)
