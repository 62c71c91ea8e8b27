"""Exports replace only what they may: a regular file (gguf) or a folder (hf, mimo), or nothing.

`smallem export ... --overwrite` once renamed its GGUF file over /dev/null, a FIFO or a device
node, leaving a regular file in its place. Every format must refuse such a destination with one
line and exit 2, before the checkpoint is read, and leave it as it was with nothing beside it.
The shared writers (`atomic.replace_with`, `hf.write_export`) are checked directly too, including a
destination that changes kind while the file or folder is being written.
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import Family
from typer.testing import CliRunner

from smallem_cli import atomic
from smallem_cli.cli.app import app
from smallem_cli.interop import hf
from smallem_cli.model import checkpoint

FORMATS = ("hf", "gguf", "mimo")
KINDS = ("fifo", "chardev", "socket", "symlink", "wrong")  # wrong: a file for a folder's export, and vice versa
WORDS = {"fifo": "FIFO", "chardev": "character device", "socket": "socket", "symlink": "symbolic link"}
EXTRA = "pip install 'smallem[llamacpp]'"
NULL = os.makedev(1, 3)  # what /dev/null is: its copy here is as harmless to write to


def make(kind: str, path: Path, fmt: str) -> None:
    """Create a destination of `kind` at `path`."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "chardev":
        try:
            os.mknod(path, stat.S_IFCHR | 0o666, NULL)
        except PermissionError:
            pytest.skip("creating a device node needs CAP_MKNOD")
    elif kind == "socket":
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(path.name)  # relative to tmp_path (the cwd): a socket's path is at most 107 bytes
        assert stat.S_ISSOCK(path.lstat().st_mode)
    elif kind == "symlink":
        target = path.with_name("linked.txt")
        target.write_text("the link's target")
        path.symlink_to(target)
    elif fmt == "gguf":  # a folder where a file is written
        path.mkdir()
        (path / "keep.txt").write_text("kept")
    else:  # a file where a folder is written
        path.write_text("kept")


def signature(path: Path) -> tuple[object, ...]:
    """What must not change: the kind, device number, inode, and the content of a file or link's target."""
    st = path.lstat()
    content: object = None
    if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
        content = path.read_bytes()
    elif stat.S_ISDIR(st.st_mode):
        content = sorted((p.name, p.read_bytes()) for p in path.iterdir())
    return stat.S_IFMT(st.st_mode), st.st_rdev, st.st_ino, content


def args(family: Family, fmt: str, out: Path, *extra: str) -> list[str]:
    return ["export", str(family.target), str(out), "--format", fmt, *extra]


@pytest.fixture
def guarded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing is renamed onto a path under /dev while the test runs (the real /dev/null is one of
    the destinations): without the fix the export fails on this guard instead of replacing it.
    The checkpoint is never read either: a destination that is refused is refused first."""
    real_replace, real_rename = os.replace, os.rename

    def safe(real: Callable[..., None]) -> Callable[..., None]:
        def rename(src: object, dst: object, *a: object, **k: object) -> None:
            if os.path.abspath(os.fspath(dst)).startswith("/dev/"):  # type: ignore[arg-type]
                raise AssertionError(f"the export renamed a file onto {dst}")
            real(src, dst, *a, **k)

        return rename

    def unread(*a: object, **k: object) -> None:
        raise AssertionError("the checkpoint was read before the destination was refused")

    monkeypatch.setattr(os, "replace", safe(real_replace))
    monkeypatch.setattr(os, "rename", safe(real_rename))
    monkeypatch.setattr(checkpoint, "load_model", unread)
    monkeypatch.setattr(checkpoint, "load_mtp", unread)


def refused(res: object, *words: str) -> None:
    """Exit 2 and exactly one line on stderr, `error: ...`, naming what it is."""
    assert res.exit_code == 2, (res.output, res.exception)  # type: ignore[attr-defined]
    err = res.stderr  # type: ignore[attr-defined]
    assert err.startswith("error:") and err.count("\n") == 1, err
    assert all(w in err for w in words), err


def need_gguf(fmt: str) -> None:
    if fmt == "gguf":
        pytest.importorskip("gguf", reason=f"gguf is not installed (the llamacpp extra: {EXTRA})")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_export_refuses_what_is_not_its_kind(
    family: Family, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, guarded: None, fmt: str, kind: str
) -> None:
    """A FIFO, a device node, a socket, a symbolic link, or a folder for gguf (a file for hf and
    mimo), with --overwrite: one line, exit 2, the destination as it was and nothing left beside it."""
    need_gguf(fmt)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / ("out.gguf" if fmt == "gguf" else "out")
    make(kind, out, fmt)
    before, names = signature(out), sorted(p.name for p in tmp_path.iterdir())
    linked = (tmp_path / "linked.txt").read_bytes() if kind == "symlink" else None
    refused(CliRunner().invoke(app, args(family, fmt, out, "--overwrite")), str(out), WORDS.get(kind, ""))
    assert signature(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == names  # no file or folder aside left
    if linked is not None:
        assert (tmp_path / "linked.txt").read_bytes() == linked  # not written through the link


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_leaves_dev_null_alone(family: Family, guarded: None, fmt: str) -> None:
    """The real /dev/null (the issue's own command): refused, still the null device, nothing
    written beside it. The `guarded` fixture makes sure a fault cannot replace it."""
    need_gguf(fmt)
    null = Path(os.devnull)
    st = null.lstat()
    if not stat.S_ISCHR(st.st_mode) or st.st_rdev != NULL:
        pytest.skip(f"{null} is not the null device here")
    leftovers = set(null.parent.glob(f".{null.name}.*"))
    refused(CliRunner().invoke(app, args(family, fmt, null, "--overwrite")), "character device")
    after = null.lstat()
    assert stat.S_ISCHR(after.st_mode) and (after.st_rdev, after.st_ino) == (NULL, st.st_ino)
    assert set(null.parent.glob(f".{null.name}.*")) == leftovers


def test_gguf_without_overwrite_names_the_kind(family: Family, tmp_path: Path, guarded: None) -> None:
    """Without --overwrite a FIFO is not offered --overwrite as the way out: it would not help."""
    need_gguf("gguf")
    out = tmp_path / "m.gguf"
    os.mkfifo(out)
    res = CliRunner().invoke(app, args(family, "gguf", out))
    refused(res, "FIFO")
    assert "--overwrite" not in res.stderr and stat.S_ISFIFO(out.lstat().st_mode)


# --- the shared writers ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["fifo", "chardev", "socket", "symlink", "folder"])
def test_replace_with_refuses_before_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """atomic.replace_with (every file the package writes): anything but a regular file or nothing
    is refused before the write, as an OSError, and left as it was."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "f.bin"
    make("wrong" if kind == "folder" else kind, out, "gguf")
    before, names = signature(out), sorted(p.name for p in tmp_path.iterdir())
    written: list[Path] = []
    with pytest.raises(atomic.NotRegularFileError, match="only a regular file is replaced") as e:
        atomic.replace_with(out, written.append)
    assert isinstance(e.value, OSError) and written == []
    assert signature(out) == before and sorted(p.name for p in tmp_path.iterdir()) == names


def test_replace_with_judges_again_before_the_rename(tmp_path: Path) -> None:
    """A destination that becomes a FIFO while the file is written aside is not replaced, and the
    file aside is removed."""
    out = tmp_path / "f.bin"
    out.write_text("before")

    def write(tmp: Path) -> None:
        tmp.write_text("after")
        out.unlink()
        os.mkfifo(out)

    with pytest.raises(atomic.NotRegularFileError, match="FIFO"):
        atomic.replace_with(out, write)
    assert stat.S_ISFIFO(out.lstat().st_mode) and [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_replace_with_still_replaces_a_regular_file(tmp_path: Path) -> None:
    out = tmp_path / "f.txt"
    atomic.replace_with(out, lambda tmp: tmp.write_text("one"))
    atomic.replace_with(out, lambda tmp: tmp.write_text("two"))
    assert out.read_text() == "two" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_export_folder_judged_again_before_the_swap(
    family: Family, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An hf/mimo destination that becomes a file while the folder is built is not moved aside or
    replaced; the folder built is removed. (A file, not a FIFO: moved aside, a FIFO would hang
    the old code's rmtree, which opens it, instead of failing this test.)"""
    out = tmp_path / "out"

    def write_safetensors(tensors: object, path: Path, meta: object) -> None:
        out.write_text("kept")

    monkeypatch.setattr(hf.checkpoint, "write_safetensors", write_safetensors)
    with pytest.raises(FileExistsError, match="regular file, not a folder"):
        hf.write_export(out, {}, {"config.json": {}}, family.tokenizer)
    assert out.read_text() == "kept" and [p.name for p in tmp_path.iterdir()] == ["out"]
