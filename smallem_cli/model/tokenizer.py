"""The tokenizer file a model reads (`tokenizers`' JSON; Smallem's own: `train.data.train_tokenizer`)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

from tokenizers import Tokenizer

EOT = "<|endoftext|>"  # the special token that ends a document, and the generation: id 0 of Smallem's


class TokenizerError(ValueError):
    """A tokenizer file that is missing or unreadable."""


def encode(tok: Tokenizer, text: str, special: bool = True) -> list[int]:
    """`text`'s ids; TokenizerError on one line where it refuses the text (a lone surrogate: bytes not UTF-8)."""
    try:
        # encode_batch lets go of the GIL while it works (encode holds it): a server's loop goes on meanwhile
        return tok.encode_batch([text], add_special_tokens=special)[0].ids
    except Exception as e:  # tokenizers raises a bare Exception (or a TypeError) on such text
        why = " ".join(str(e).split()) or type(e).__name__
        raise TokenizerError(f"the tokenizer refused the prompt: {why}") from None


@functools.lru_cache(maxsize=4)  # by the tokenizer object (hashed by identity, and kept alive while cached)
def special_pattern(tok: Tokenizer) -> re.Pattern[str] | None:
    """What finds the tokenizer's special tokens in a text, longest first as the tokenizer matches them, or None."""
    added = sorted({t.content for t in tok.get_added_tokens_decoder().values() if t.special and t.content}, key=len)
    return re.compile("|".join(map(re.escape, reversed(added)))) if added else None


@functools.lru_cache(maxsize=4)
def _as_text(tok: Tokenizer) -> Tokenizer:
    """A copy of the tokenizer that encodes special tokens' text as text (the shared one is not changed)."""
    copy = Tokenizer.from_str(tok.to_str())
    copy.encode_special_tokens = True
    return copy


def encode_parts(tok: Tokenizer, parts: list[str]) -> list[int]:
    """Markup and plain text alternating (parts[0::2] markup, parts[1::2] plain) -> ids, none added: the special
    tokens written in markup are the tokenizer's, those in plain text are encoded as text. The text is split at
    the markup's special tokens and each piece between encoded alone, as the tokenizer itself splits it: one part
    of markup alone gets exactly `encode(tok, part, special=False)`."""
    pattern, ids, run = special_pattern(tok), [], []

    def flush() -> None:
        if text := "".join(run):
            ids.extend(encode(_as_text(tok), text, special=False))
        run.clear()

    for i, part in enumerate(parts):
        start = 0
        for m in pattern.finditer(part) if pattern is not None and i % 2 == 0 else ():
            run.append(part[start : m.start()])
            flush()
            ids.append(tok.token_to_id(m.group()))
            start = m.end()
        run.append(part[start:])
    flush()
    return ids


def load_tokenizer(path: str | Path) -> Tokenizer:
    if not Path(path).is_file():
        raise TokenizerError(f"tokenizer not found: {path}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise TokenizerError(f"cannot read tokenizer {path}: {e}") from None
