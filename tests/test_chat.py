"""A model's conversation format: its end ids (config.json, generation_config.json,
tokenizer_config.json), its chat template rendered in a sandbox, and `generate --chat/--system`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Family
from test_cli import as_json, ok
from tokenizers import Tokenizer
from typer.testing import CliRunner

from smallem_cli.cli.app import app
from smallem_cli.interop.hf import export_hf
from smallem_cli.model.chat import ChatError, ChatFormat, hf_format, messages, own_format, render

TEMPLATE = (
    "{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def write(folder: Path, name: str, obj: object) -> None:
    (folder / name).write_text(json.dumps(obj), encoding="utf-8")


@pytest.fixture
def hf_dir(family: Family, tmp_path: Path) -> Path:
    """The family's target as an HF folder, its tokenizer_config given a chat template."""
    out = tmp_path / "hf"
    export_hf(family.target, out, family.tokenizer)
    tc = json.loads((out / "tokenizer_config.json").read_text())
    write(out, "tokenizer_config.json", tc | {"chat_template": TEMPLATE})
    return out


def run(*args: str) -> object:
    return CliRunner().invoke(app, ["generate", *args, "-n", "24", "--engine", "eager"])


def refused(res: object, *words: str) -> None:
    assert res.exit_code == 2, (res.stdout, res.stderr)  # type: ignore[attr-defined]
    err = res.stderr  # type: ignore[attr-defined]
    assert err.startswith("error:") and err.count("\n") == 1 and all(w in err for w in words), err


def test_end_ids_come_from_every_file(family: Family, tmp_path: Path) -> None:
    tok = Tokenizer.from_file(str(family.tokenizer))
    write(tmp_path, "config.json", {"eos_token_id": 7})
    write(tmp_path, "generation_config.json", {"eos_token_id": [9, 7, 11]})
    write(tmp_path, "tokenizer_config.json", {"eos_token": {"content": "<|endoftext|>"}, "bos_token": "<|endoftext|>"})
    fmt = hf_format(tmp_path, tok, 300)
    assert fmt == ChatFormat((7, 9, 11, 0), None, "<|endoftext|>", "<|endoftext|>")
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "y"}]
    write(tmp_path, "tokenizer_config.json", {"chat_template": named})
    assert hf_format(tmp_path, tok, 300).template == "y"
    assert own_format(tok) == ChatFormat((0,), None, "", "<|endoftext|>")


@pytest.mark.parametrize(
    ("name", "content", "words"),
    [
        ("config.json", "{not json", "cannot read"),
        ("config.json", "[1, 2]", "not a JSON object"),
        ("generation_config.json", '{"eos_token_id": 300}', "eos_token_id"),
        ("generation_config.json", '{"eos_token_id": ["a"]}', "eos_token_id"),
        ("tokenizer_config.json", '{"chat_template": 3}', "chat_template"),
    ],
)
def test_bad_files_are_one_clear_error(family: Family, tmp_path: Path, name: str, content: str, words: str) -> None:
    (tmp_path / name).write_text(content)
    with pytest.raises(ChatError, match=words) as e:
        hf_format(tmp_path, Tokenizer.from_file(str(family.tokenizer)), 300)
    assert "\n" not in str(e.value)


def test_render_follows_the_template() -> None:
    fmt = ChatFormat((0,), TEMPLATE)
    got = render(fmt, messages("hi", "be brief"))
    assert got == "<|endoftext|>system: be brief\n<|endoftext|>user: hi\nassistant:"
    assert render(fmt, messages("hi"), add_generation_prompt=False) == "<|endoftext|>user: hi\n"


@pytest.mark.parametrize(
    ("template", "words"),
    [
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),  # the sandbox, not Python
        ("{{ messages.append(1) }}", "SecurityError"),  # immutable: the conversation is not changed
        ("{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}", "one message only"),
        ("{% for %}", "TemplateSyntaxError"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ],
)
def test_a_template_cannot_escape_or_crash(template: str, words: str) -> None:
    with pytest.raises(ChatError, match=words) as e:
        render(ChatFormat((), template), messages("a", "b"))
    assert "\n" not in str(e.value)


def test_generate_chat_is_the_rendered_prompt(hf_dir: Path) -> None:
    """--chat is the plain run of the rendered text (special tokens as the template wrote them,
    nothing added); --system implies --chat."""
    text = render(ChatFormat((0,), TEMPLATE), messages("In the beginning", "Answer"))
    plain = as_json(run(text, "--target", str(hf_dir), "--json"))
    chat = as_json(run("In the beginning", "--target", str(hf_dir), "--system", "Answer", "--json"))
    assert chat["tokens"] == plain["tokens"] and chat["text"] == plain["text"]
    assert as_json(run("x", "--target", str(hf_dir), "--chat", "--json"))["tokens"]


def test_generate_stops_at_any_end_id(hf_dir: Path) -> None:
    """The output ends before the first of the model's end ids, whichever file named it."""
    ref = as_json(run("In the beginning", "--target", str(hf_dir), "--chat", "--json", "--proposer", "none"))["tokens"]
    i = next(i for i, t in enumerate(ref) if i >= 3 and t not in ref[:i])
    write(hf_dir, "generation_config.json", {"eos_token_id": [ref[i]]})
    for proposer in ("none", "ngram"):
        got = as_json(run("In the beginning", "--target", str(hf_dir), "--chat", "--json", "--proposer", proposer))
        assert got["tokens"] == ref[:i], proposer


def test_chat_without_a_template_or_with_a_bad_one_is_refused(family: Family, hf_dir: Path) -> None:
    refused(run("hi", "--target", str(family.target), "--chat"), "no chat template")
    write(hf_dir, "tokenizer_config.json", {"chat_template": "{{ raise_exception('no user messages') }}"})
    refused(run("hi", "--target", str(hf_dir), "--chat"), "no user messages")
    ok(run("hi", "--target", str(hf_dir)))  # without --chat the template is never read


def test_a_message_the_tokenizer_refuses_is_one_line(hf_dir: Path) -> None:
    """A system message of bytes that are not UTF-8 (lone surrogates in Python) renders, then the
    tokenizer refuses it: one line, exit 2."""
    refused(run("hi", "--target", str(hf_dir), "--system", "\udcff"), "tokenizer refused the prompt")


def test_continuations_of_chat_instructions(hf_dir: Path, tmp_path: Path) -> None:
    """`data --continuations N --chat`: composed instructions through the target's template, then its
    answers, the template's special tokens kept in the text; an eighth more make the validation split."""
    import torch

    from smallem_cli.engine import family as fam
    from smallem_cli.engine.family import NONE
    from smallem_cli.engine.generate import generate
    from smallem_cli.model.chat import chat_ids
    from smallem_cli.train import continuations as C
    from smallem_cli.train import data as corpus

    out = tmp_path / "chat"
    argv = ["data", "--continuations", "8", "--chat", "--target", str(hf_dir), "--out", str(out)]
    result = CliRunner().invoke(app, [*argv, "--new-tokens", "6", "--sampled-every", "0"])
    assert result.exit_code == 0, (result.stderr, result.exception)
    tgt = fam.load_target(hf_dir, torch.device("cpu"))
    want = []
    for text in C.instructions(9, 0):
        ctx = chat_ids(tgt.tok, tgt.chat, messages(text))
        new, _ = generate(tgt.model, NONE, ctx, 6, 0, end_ids=tgt.chat.end_ids)
        want.append(tgt.tok.decode([*ctx, *new], skip_special_tokens=False))
        assert want[-1].startswith(f"<|endoftext|>user: {text}\n")  # the template's own tokens, kept
    assert (out / "train.txt").read_text(encoding="utf-8") == corpus.EOT.join(want[:8])
    assert (out / "val.txt").read_text(encoding="utf-8") == want[8]
