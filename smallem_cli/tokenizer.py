"""Byte-level BPE tokenizer (8,192 tokens, like the seed's), trained with `tokenizers`."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from . import atomic
from .data import EOT, read_documents


def train_tokenizer(text_path: Path, out: Path, vocab_size: int = 8192) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],  # id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(read_documents(text_path), trainer=trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic.replace_with(out, lambda tmp: tok.save(str(tmp)))
    return tok


class TokenizerError(ValueError):
    """A tokenizer file that is missing or unreadable."""


def load_tokenizer(path: str | Path) -> Tokenizer:
    if not Path(path).is_file():
        raise TokenizerError(f"tokenizer not found: {path}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise TokenizerError(f"cannot read tokenizer {path}: {e}") from None
