"""Where a command writes, checked before it works: nothing the user has is replaced unless asked
(--overwrite), and no output lands on an input it still needs. An OutputError says what is wrong."""

from __future__ import annotations

from pathlib import Path

from . import data


class OutputError(ValueError):
    """An output that would replace a file unasked, or that cannot go where it is named."""


def train_outputs(
    dest: Path, option: str, mtp_out: Path | None, joint: bool, teacher: Path | None, overwrite: bool
) -> Path | None:
    """Check a training run's outputs -> where its jointly trained MTP module goes (None: it has none).
    `dest` is named by `option`; `joint`: a target with an MTP module, which goes to `mtp_out` (default:
    mtp.safetensors beside `dest`); `teacher`: the model the run learns from."""
    if mtp_out is not None and not joint:
        raise OutputError("--mtp-out names the MTP module trained jointly with a target (a preset with MTP)")
    mtp_dest = (mtp_out or dest.with_name("mtp.safetensors")) if joint else None
    if mtp_dest is not None and mtp_dest.resolve() == dest.resolve():
        raise OutputError(f"the target and its MTP module would both be written to {dest}: give another --mtp-out")
    if teacher is not None and dest.resolve() == teacher.resolve():
        raise OutputError(f"{option} {dest} is the target it learns from: choose another file")
    for path, opt in ((dest, option), (mtp_dest, "--mtp-out")):
        if path is not None and path.is_dir():
            raise OutputError(f"{path} is a folder, not a file: choose another {opt}")
        if path is not None and path.exists() and not overwrite:
            raise OutputError(f"{path} exists: pass --overwrite to replace it, or {opt} to write elsewhere")
    return mtp_dest


def corpus_replaces(out_dir: Path, parts: tuple[list[str], list[str]]) -> Path | None:
    """The first of `out_dir`'s train.txt and val.txt that writing the (train, validation) documents
    `parts` would change, or None (a rerun writing the same corpus replaces nothing)."""
    for path, part in zip((out_dir / "train.txt", out_dir / "val.txt"), parts, strict=True):
        if path.exists() and (not path.is_file() or path.read_bytes() != data.EOT.join(part).encode("utf-8")):
            return path
    return None


def write_corpus(out_dir: Path, chunks: list[str], overwrite: bool, option: str) -> tuple[Path, Path]:
    """Write train.txt and val.txt of `chunks`' split (`data.split`), unless that would replace
    another corpus in `out_dir` (named by `option`) unasked."""
    parts = data.split(chunks)
    if (taken := corpus_replaces(out_dir, parts)) and not overwrite:
        raise OutputError(f"{taken} holds another corpus: pass --overwrite to replace it, or {option} to use another")
    return data.write_parts(out_dir, parts)


def continuations_out(out_dir: Path, source: Path, overwrite: bool) -> None:
    """Check `smallem data --continuations`' folder before any work: not the corpus its contexts come
    from, and no corpus there unless --overwrite (any counts: what it will hold is not known yet)."""
    if out_dir.resolve() == source.resolve():
        raise OutputError(f"--out {out_dir} is the corpus the contexts come from: choose another folder")
    taken = [p for p in (out_dir / "train.txt", out_dir / "val.txt") if p.exists()]
    if taken and not overwrite:
        raise OutputError(f"{taken[0]} exists: pass --overwrite to replace it, or --out to write elsewhere")
