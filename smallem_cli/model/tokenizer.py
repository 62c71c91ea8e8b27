"""The tokenizer file a model reads (`tokenizers`' JSON); Smallem's own is a byte-level BPE of
8,192 tokens, like the seed's (`train.data.train_tokenizer`)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

# The special token that ends a document, and the generation: id 0 of Smallem's tokenizer.
EOT = "<|endoftext|>"


class TokenizerError(ValueError):
    """A tokenizer file that is missing or unreadable."""


def load_tokenizer(path: str | Path) -> Tokenizer:
    if not Path(path).is_file():
        raise TokenizerError(f"tokenizer not found: {path}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise TokenizerError(f"cannot read tokenizer {path}: {e}") from None
