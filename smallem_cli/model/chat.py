"""A model's conversation format: the tokens that end its turn, and its chat template (Jinja, rendered by `sandbox`
with a budget: a model file's template is untrusted code). A conversation's text is text: a special token typed in
a message is encoded as the characters it is, only the template's own markup yields special tokens."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from .sandbox import SANDBOX
from .tokenizer import EOT, encode, encode_parts, special_pattern

MAX_JSON_BYTES = 16 << 20  # a config file is kilobytes: a larger one is refused, not read into memory
RENDER_CHARS = 1 << 20  # a render's output beyond twice its messages' characters: the budget checked before tokenizing


class ChatError(ValueError):
    """A conversation format that cannot be read or rendered: the message is one line."""


class TemplateRefused(ChatError):
    """The template's own `raise_exception`: a conversation it does not take, not a broken template."""


class TemplateFailed(ChatError):
    """The template raised an error of its own (a syntax error, an undefined name, the sandbox's refusal)."""


@dataclass(frozen=True)
class ChatFormat:
    end_ids: tuple[int, ...] = ()  # any of them ends a generation (it is not emitted)
    template: str | None = None  # Jinja over `messages`, `add_generation_prompt`, `bos_token`, `eos_token`
    bos: str = ""
    eos: str = ""


def own_format(tok: Tokenizer) -> ChatFormat:
    """Smallem's checkpoints: `<|endoftext|>` ends the text, where the tokenizer has it."""
    eot = tok.token_to_id(EOT)
    return ChatFormat(() if eot is None else (eot,), eos=EOT if eot is not None else "")


def _text(path: Path) -> str:
    """The file's text, bounded: ChatError where it is larger than MAX_JSON_BYTES, unreadable or not UTF-8."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
        if len(raw) > MAX_JSON_BYTES:
            raise ChatError(f"{path} is larger than {MAX_JSON_BYTES >> 20} MiB")
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ChatError(f"cannot read {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, {} where the file is absent; ChatError where it is not an object."""
    if not path.is_file():
        return {}
    text = _text(path)
    try:
        got = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ChatError(f"cannot read {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not isinstance(got, dict):
        raise ChatError(f"{path} is not a JSON object")
    return got


def _token_text(value: object) -> str:
    """tokenizer_config's `eos_token` / `bos_token`: a string, or an added token's {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def hf_template(folder: Path) -> ChatFormat:
    """An HF folder's chat template, BOS and EOS (no end ids): chat_template.jinja where the folder has one
    (transformers' layout now, and its choice where both are), else tokenizer_config.json's chat_template."""
    tc = _json(folder / "tokenizer_config.json")
    template = tc.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ChatError(f"{folder / 'tokenizer_config.json'}: chat_template is not a string")
    if (jinja := folder / "chat_template.jinja").is_file():
        template = _text(jinja)
    return ChatFormat((), template, _token_text(tc.get("bos_token")), _token_text(tc.get("eos_token")))


def hf_format(folder: Path, tok: Tokenizer, vocab: int) -> ChatFormat:
    """An HF folder's end ids (its config files' eos_token_id, tokenizer_config's eos_token) and `hf_template`."""
    fmt, ends = hf_template(folder), []
    for name in ("config.json", "generation_config.json"):
        value = _json(folder / name).get("eos_token_id")
        ids = value if isinstance(value, list) else [] if value is None else [value]
        if not all(type(i) is int and 0 <= i < vocab for i in ids):
            raise ChatError(f"{name} eos_token_id must be token ids below {vocab}, got {value!r}")
        ends += ids
    if fmt.eos and (i := tok.token_to_id(fmt.eos)) is not None:
        ends.append(i)
    return replace(fmt, end_ids=tuple(dict.fromkeys(ends)))


def messages(user: str, system: str | None = None) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": user}]


def render(fmt: ChatFormat, conversation: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The conversation through its template, in the sandbox; ChatError (one line) where it has none, the template
    refuses or fails, passes its budget (time, memory, output: RENDER_CHARS) or renders nothing."""
    if fmt.template is None:
        raise ChatError("the model has no chat template: give the prompt as plain text (without --chat)")
    context = {"messages": conversation, "add_generation_prompt": add_generation_prompt}
    chars = sum(len(v) for m in conversation for v in m.values() if isinstance(v, str))
    got = SANDBOX.render(fmt.template, context | {"bos_token": fmt.bos, "eos_token": fmt.eos}, RENDER_CHARS + 2 * chars)
    if "refused" in got:
        raise TemplateRefused(f"the chat template refused the conversation: {got['refused']}")
    if "failed" in got:
        raise TemplateFailed(f"the chat template failed: {got['failed']}")
    if "budget" in got:
        raise ChatError(f"the chat template ran past its budget: {got['budget']}")
    if not got["text"].strip():
        raise ChatError("the chat template rendered nothing for this conversation")
    return got["text"]


def check_template(fmt: ChatFormat, where: str) -> None:
    """ChatError, `where` (the model's path) first, for a template that passes its budget, renders nothing or fails
    on a tiny conversation (a system message and a user's, else the user's alone): before the weights load. One whose
    raise_exception refuses both is not: it takes some conversations (alternate roles, say), judged on each."""
    if fmt.template is None:
        return
    failed: list[str] = []
    for conversation in (messages("Hello.", "You are a helpful assistant."), messages("Hello.")):
        try:
            render(fmt, conversation)
            return
        except TemplateRefused:
            pass
        except TemplateFailed as e:
            failed.append(str(e))
        except ChatError as e:  # over budget, or empty: no conversation would do better
            raise ChatError(f"{where}: {e}") from None
    if failed:
        raise ChatError(f"{where}: {failed[0]}")


def chat_ids(tok: Tokenizer, fmt: ChatFormat, conversation: list[dict[str, str]]) -> list[int]:
    """The conversation's ids: the special tokens the template writes, none added by the tokenizer, and the
    messages' text as text. A special token typed in a message (`<|im_end|>` to close one's own turn) goes to
    the template as a marker no text holds, and comes back encoded as the characters it is."""
    pattern, values = special_pattern(tok), [v for m in conversation for v in m.values() if isinstance(v, str)]
    if pattern is None or not any(pattern.search(v) for v in values):
        return encode(tok, render(fmt, conversation), special=False)
    nonce = ""
    while not nonce or any(nonce in v for v in values):  # a marker's start that no message holds, nor guesses
        nonce = f"\ue000{secrets.randbits(48)}:"
    typed: list[str] = []

    def mark(m: re.Match[str]) -> str:
        typed.append(m.group())
        return f"{nonce}{len(typed) - 1}\ue001"

    marked = [{k: pattern.sub(mark, v) if isinstance(v, str) else v for k, v in m.items()} for m in conversation]
    parts = re.split(f"{re.escape(nonce)}(\\d+)\ue001", render(fmt, marked))
    # a marker the template made up (it saw some) stays the text it is
    parts[1::2] = [typed[int(i)] if int(i) < len(typed) else f"{nonce}{i}\ue001" for i in parts[1::2]]
    return encode_parts(tok, parts)
