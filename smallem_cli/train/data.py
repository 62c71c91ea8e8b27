"""Corpus, split and token files.

The default corpus is the King James Bible (Debian's `bible-kjv`), verse references stripped, a chapter per document;
any UTF-8 text files are split into paragraph chunks instead. The split is deterministic and by whole chunks (every
20th, about 5%, held out), so no verse is in both halves."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .. import atomic
from ..model.tokenizer import EOT, load_tokenizer

HOLDOUT_EVERY = 20  # one chunk in 20 goes to validation: about 5%
_REF = re.compile(r"^([1-3]?[A-Za-z]+)(\d+):(\d+) (.*)$")


def kjv_chapters() -> list[str]:
    """All 1,189 chapters of the KJV as plain text, one verse a line, references stripped."""
    if shutil.which("bible") is None:
        raise FileNotFoundError("the `bible` command is missing: install Debian's bible-kjv package")
    out = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True).stdout
    chapters: dict[tuple[str, str], list[str]] = {}  # by book and chapter, in order
    verses: list[str] = []
    for line in out.splitlines():
        if m := _REF.match(line):
            verses = chapters.setdefault(m.group(1, 2), [])
            verses.append(m.group(4).strip())
        elif line.strip() and verses:  # a wrapped verse continues the previous line
            verses[-1] += " " + line.strip()
    return ["\n".join(v) + "\n" for v in chapters.values()]


def text_chunks(paths: list[Path]) -> list[str]:
    """User corpora: split each UTF-8 file on blank lines into chunks of about 4 KB."""
    chunks: list[str] = []
    for path in paths:
        buf = ""
        for para in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")):
            buf += para.strip() + "\n\n"
            if len(buf) >= 4096:
                chunks.append(buf)
                buf = ""
        if buf.strip():
            chunks.append(buf)
    return chunks


def split(chunks: list[str]) -> tuple[list[str], list[str]]:
    train = [c for i, c in enumerate(chunks) if i % HOLDOUT_EVERY != HOLDOUT_EVERY // 2]
    val = [c for i, c in enumerate(chunks) if i % HOLDOUT_EVERY == HOLDOUT_EVERY // 2]
    return train, val


def write_parts(out_dir: Path, parts: tuple[list[str], list[str]]) -> tuple[Path, Path]:
    """train.txt and val.txt: the documents separated by the end-of-text marker, each written aside, then renamed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "train.txt", out_dir / "val.txt"
    for path, part in zip(paths, parts, strict=True):
        text = EOT.join(part)
        atomic.replace_with(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))  # noqa: B023 (called at once)
    return paths


def read_documents(path: Path) -> list[str]:
    return [d for d in path.read_text(encoding="utf-8").split(EOT) if d]


def encode_file(tokenizer_json: Path | Tokenizer, text_path: Path) -> np.ndarray:
    """Token ids of a corpus file as uint16, each document followed by end-of-text (if the tokenizer has it)."""
    tok = tokenizer_json if isinstance(tokenizer_json, Tokenizer) else load_tokenizer(tokenizer_json)
    eot = tok.token_to_id(EOT)
    if (size := tok.get_vocab_size(with_added_tokens=True)) > 1 << 16:
        raise ValueError(f"a vocabulary of {size} tokens does not fit uint16")
    ids: list[int] = []
    for enc in tok.encode_batch(read_documents(text_path)):
        ids += enc.ids if eot is None else [*enc.ids, eot]
    return np.asarray(ids, dtype=np.uint16)


def token_file(tokenizer_json: Path | None, text_path: Path, tok: Tokenizer | None = None) -> np.ndarray:
    """Encoded ids, cached beside the text as .bin (rebuilt when older than its inputs); with no
    tokenizer file (a GGUF target's is inside it), encoded by `tok` each time, nothing cached."""
    if tokenizer_json is None:
        assert tok is not None, "token_file needs a tokenizer file or a loaded tokenizer"
        return encode_file(tok, text_path)
    bin_path = text_path.with_suffix(".bin")
    newest = max(text_path.stat().st_mtime, tokenizer_json.stat().st_mtime)
    if not bin_path.exists() or bin_path.stat().st_mtime < newest:
        ids = encode_file(tokenizer_json, text_path)
        atomic.replace_with(bin_path, ids.tofile)
    return np.fromfile(bin_path, dtype=np.uint16)


def train_tokenizer(text_path: Path, out: Path, vocab_size: int = 8192) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], initial_alphabet=alphabet, show_progress=False
    )  # EOT: id 0
    tok.train_from_iterator(read_documents(text_path), trainer=trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic.replace_with(out, lambda tmp: tok.save(str(tmp)))
    return tok
