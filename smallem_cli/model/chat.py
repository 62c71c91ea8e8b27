"""A model's conversation format: the tokens that end its turn, and its chat template (Jinja, rendered
in a sandbox: a folder's template never runs code of its own)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from .tokenizer import EOT, encode

MAX_JSON_BYTES = 16 << 20  # a config file is kilobytes: a larger one is refused, not read into memory


class ChatError(ValueError):
    """A conversation format that cannot be read or rendered: the message is one line."""


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


def _json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, {} where the file is absent; ChatError where it is not an object."""
    if not path.is_file():
        return {}
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
        if len(raw) > MAX_JSON_BYTES:
            raise ChatError(f"{path} is larger than {MAX_JSON_BYTES >> 20} MiB")
        got = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ChatError(f"cannot read {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not isinstance(got, dict):
        raise ChatError(f"{path} is not a JSON object")
    return got


def _token_text(value: object) -> str:
    """tokenizer_config's `eos_token` / `bos_token`: a string, or an added token's {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def hf_format(folder: Path, tok: Tokenizer, vocab: int) -> ChatFormat:
    """An HF folder's end ids (its config files' eos_token_id, tokenizer_config's eos_token) and chat template."""
    files = {n: _json(folder / n) for n in ("config.json", "generation_config.json", "tokenizer_config.json")}
    tc, ends = files.pop("tokenizer_config.json"), []
    for name, got in files.items():
        value = got.get("eos_token_id")
        ids = value if isinstance(value, list) else [] if value is None else [value]
        if not all(type(i) is int and 0 <= i < vocab for i in ids):
            raise ChatError(f"{name} eos_token_id must be token ids below {vocab}, got {value!r}")
        ends += ids
    eos, bos = _token_text(tc.get("eos_token")), _token_text(tc.get("bos_token"))
    if eos and (i := tok.token_to_id(eos)) is not None:
        ends.append(i)
    template = tc.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ChatError(f"{folder / 'tokenizer_config.json'}: chat_template is not a string")
    return ChatFormat(tuple(dict.fromkeys(ends)), template, bos, eos)


def messages(user: str, system: str | None = None) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": user}]


def render(fmt: ChatFormat, conversation: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The conversation through its template; ChatError (one line) where it has none, or the template fails."""
    if fmt.template is None:
        raise ChatError("the model has no chat template: give the prompt as plain text (without --chat)")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatError(f"the chat template refused the conversation: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(fmt.template).render(
            messages=conversation, add_generation_prompt=add_generation_prompt, bos_token=fmt.bos, eos_token=fmt.eos
        )
    except ChatError:
        raise
    except Exception as e:  # a template is a program: whatever it raises is its failure, on one line
        why = str(e).splitlines()[0] if str(e) else ""
        raise ChatError(f"the chat template failed: {type(e).__name__}: {why}") from None


def chat_ids(tok: Tokenizer, fmt: ChatFormat, conversation: list[dict[str, str]]) -> list[int]:
    """The conversation's ids: every special token written by the template, none added by the tokenizer."""
    return encode(tok, render(fmt, conversation), special=False)
