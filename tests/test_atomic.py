"""Files written whole or not at all (`atomic.replace_with`): every writer of the package's
files (corpus splits, token caches, tokenizer, checkpoints, run states, prompt files) goes
through it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from smallem_cli import atomic
from smallem_cli.train.data import token_file, write_parts


def test_a_failed_write_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    out = tmp_path / "f.txt"
    out.write_text("before")

    def half(tmp: Path) -> None:
        tmp.write_text("hal")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic.replace_with(out, half)
    assert out.read_text() == "before" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]
    atomic.replace_with(out, lambda tmp: tmp.write_text("after"), sync=True)
    assert out.read_text() == "after" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_two_writers_of_one_file_both_finish_whole(tmp_path: Path) -> None:
    """Another process writes the same file while this one is writing it (simulated: the other's
    whole write runs inside this one's, under its own process id): each writes its own file aside,
    both renames succeed, the last one's content stays. With one shared name aside, the other would
    truncate and replace this one's file, and this rename would find nothing."""
    out = tmp_path / "train.bin"
    other = "import sys; from pathlib import Path; from smallem_cli import atomic; "
    other += "atomic.replace_with(Path(sys.argv[1]), lambda t: t.write_text('theirs'))"

    def mine(tmp: Path) -> None:
        tmp.write_text("mi")
        subprocess.run([sys.executable, "-c", other, str(out)], check=True)
        with tmp.open("a") as f:
            f.write("ne")

    atomic.replace_with(out, mine)
    assert out.read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["train.bin"]


def test_the_package_writers_go_through_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The corpus splits and the token cache are renamed from this process's file aside."""
    seen: list[Path] = []
    real = atomic.replace_with

    def spy(out: Path, write, sync: bool = False) -> None:  # type: ignore[no-untyped-def]
        seen.append(out)
        real(out, write, sync)

    monkeypatch.setattr(atomic, "replace_with", spy)
    train, val = write_parts(tmp_path, (["In the beginning", "God created"], ["the heaven"]))
    tok = Path(__file__).parents[1] / "checkpoints" / "tokenizer.json"
    ids = token_file(tok, train)
    assert seen == [train, val, train.with_suffix(".bin")] and ids.size > 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.bin", "train.txt", "val.txt"]
