"""The tokenizer file a model reads (`tokenizers`' JSON; Smallem's own: `train.data.train_tokenizer`)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

EOT = "<|endoftext|>"  # the special token that ends a document, and the generation: id 0 of Smallem's


class TokenizerError(ValueError):
    """A tokenizer file that is missing or unreadable."""


def encode(tok: Tokenizer, text: str, special: bool = True) -> list[int]:
    """`text`'s ids; TokenizerError on one line where it refuses the text (a lone surrogate: bytes not UTF-8)."""
    try:
        return tok.encode(text, add_special_tokens=special).ids
    except Exception as e:  # tokenizers raises a bare Exception (or a TypeError) on such text
        why = " ".join(str(e).split()) or type(e).__name__
        raise TokenizerError(f"the tokenizer refused the prompt: {why}") from None


def load_tokenizer(path: str | Path) -> Tokenizer:
    if not Path(path).is_file():
        raise TokenizerError(f"tokenizer not found: {path}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise TokenizerError(f"cannot read tokenizer {path}: {e}") from None
