"""Where the native engine's library comes from (`native/kernels.py`): it is loaded only from a
cache no one else could have written (every folder up to / ours or root's and closed to others,
sticky ones such as /tmp aside; no symlink someone else owns on the way), only as the bytes that
were built (their sha256 is in the file's name), and only with every symbol the engine calls.
Anything else is rebuilt, or the run falls back to the eager engine with one line: never a
signal, never a traceback. A compiler that fails, hangs or writes garbage costs one try a process.

Most tests build with a stand-in compiler (`fake_cxx`) that copies a library built once by the
real one, so that a rebuild takes no time; the checks on what is loaded are the real ones.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import Family
from typer.testing import CliRunner

from smallem_cli.backends import engines, native
from smallem_cli.backends.native import kernels
from smallem_cli.backends.native.kernels import NativeUnavailable
from smallem_cli.cli.app import app

no_native = shutil.which("g++") is None or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512")
pytestmark = pytest.mark.skipif(no_native, reason="the native engine needs g++ and an AVX2 CPU")
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user's needs root")
OTHER = 12345  # a user id that is not ours (nor root's)


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing loaded and no failed compiler remembered: each test starts as a new process would."""
    monkeypatch.setattr(kernels, "_LIBS", {})
    monkeypatch.setattr(kernels, "_FAILED", {}, raising=False)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A library built once by the real compiler (the one build of this module)."""
    root = tmp_path_factory.mktemp("built")
    saved = dict(kernels._LIBS)
    kernels._LIBS.clear()
    try:
        kernels.library(root, lambda _: None)
    finally:
        kernels._LIBS.clear()
        kernels._LIBS.update(saved)
    (lib,) = (root / "native").glob("step-*.so")
    return lib


def script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


@pytest.fixture
def fake_cxx(tmp_path: Path, built: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """CXX: a "compiler" that writes the real build's bytes where -o says (and counts its runs)
    -> (the library it writes, the file counting its runs)."""
    runs = tmp_path / "runs"
    cxx = script(
        tmp_path / "fake-cxx",
        f'while [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done\necho run >> {runs}\ncp {built} "$out"\n',
    )
    monkeypatch.setenv("CXX", str(cxx))
    return built, runs


def runs(counter: Path) -> int:
    return len(counter.read_text().splitlines()) if counter.exists() else 0


def prefix(root: Path) -> str:
    """'step-<key>-' of the build the current CXX makes for this CPU (built into `root` for that)."""
    kernels.library(root, lambda _: None)
    kernels._LIBS.clear()
    (lib,) = (root / "native").glob("step-*.so")
    return lib.name[: lib.name.rindex("-") + 1]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def one_good_library(root: Path) -> Path:
    """The one library in `root`'s cache, named by the digest of its bytes."""
    (lib,) = (root / "native").glob("step-*.so")
    assert lib.name.endswith(f"-{digest(lib)}.so") and not lib.is_symlink() and not lib.stat().st_mode & 0o022
    return lib


def test_cache_root_expands_the_home_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_cxx: tuple[Path, Path]
) -> None:
    """SMALLEM_CACHE=~/x is $HOME/x, as a shell would have it, not a folder named `~` where the
    run was started; XDG_CACHE_HOME=~/xdg likewise."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SMALLEM_CACHE", "~/x")
    assert engines.cache_root() == home / "x"
    kernels.library(engines.cache_root(), lambda _: None)
    one_good_library(home / "x")
    assert not (tmp_path / "~").exists()
    monkeypatch.delenv("SMALLEM_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", "~/xdg")
    assert engines.cache_root() == home / "xdg" / "smallem"


@pytest.mark.parametrize(("mode", "loads"), [(0o777, False), (0o770, False), (0o1777, True), (0o755, True)])
def test_a_folder_others_can_write_above_the_cache_is_refused(
    tmp_path: Path, fake_cxx: tuple[Path, Path], mode: int, loads: bool
) -> None:
    """A folder above the cache that group or others can write (they could move ours away and put
    theirs in its place): refused, one line naming it, nothing built or loaded. A sticky one (as
    /tmp) is fine: others cannot move what is ours in it."""
    _, counter = fake_cxx
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    log: list[str] = []
    if loads:
        assert kernels.library(shared / "cache", log.append).smallem_panel() in (8, 16)
        assert runs(counter) == 1 and len(log) == 1
        return
    with pytest.raises(NativeUnavailable, match=f"^{shared} is writable by others or not yours"):
        kernels.library(shared / "cache", log.append)
    assert log == [] and runs(counter) == 0 and not kernels._LIBS


def test_the_cache_folder_itself_must_be_closed_even_if_sticky(tmp_path: Path, fake_cxx: tuple[Path, Path]) -> None:
    """Sticky or not, others must not add names to the folder the library is read from."""
    (tmp_path / "c" / "native").mkdir(parents=True)
    (tmp_path / "c" / "native").chmod(0o1777)
    with pytest.raises(NativeUnavailable, match="native is writable by others"):
        kernels.library(tmp_path / "c", lambda _: None)
    assert runs(fake_cxx[1]) == 0


@as_root
def test_a_folder_or_symlink_of_another_user_is_refused(tmp_path: Path, fake_cxx: tuple[Path, Path]) -> None:
    """A folder on the way that another user owns (they can change it at will), or a symlink on
    the way that another user owns (they can point it elsewhere): refused, naming it. A symlink
    of ours is followed, and the real folders behind it are the ones checked and used."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER, OTHER)
    with pytest.raises(NativeUnavailable, match=f"^{theirs} is writable by others or not yours"):
        kernels.library(theirs / "cache", lambda _: None)

    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    os.lchown(link, OTHER, OTHER)
    with pytest.raises(NativeUnavailable, match=f"^{link} is a symlink someone else owns"):
        kernels.library(link / "cache", lambda _: None)
    assert runs(fake_cxx[1]) == 0

    os.lchown(link, os.geteuid(), os.getegid())
    kernels.library(link / "cache", lambda _: None)
    one_good_library(real / "cache")

    (real / "cache" / "native").chmod(0o777)  # the real folder behind our symlink is checked too
    kernels._LIBS.clear()
    with pytest.raises(NativeUnavailable, match=f"^{real}/cache/native is writable by others"):
        kernels.library(link / "cache", lambda _: None)


def test_cli_falls_back_with_one_line_from_a_shared_cache(
    family: Family, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_cxx: tuple[Path, Path]
) -> None:
    """`smallem generate --engine native` with its cache under a folder anyone can write: the eager
    engine's text, exit 0, and one line on stderr that names the folder (one for every model that
    loads: the target and the MTP module here), before the run's own line."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("SMALLEM_CACHE", str(shared / "cache"))
    argv = ["generate", "The quick brown fox", "--target", str(family.target), "-n", "20", "--proposer", "mtp"]
    runner = CliRunner()
    eager = runner.invoke(app, [*argv, "--engine", "eager"])
    got = runner.invoke(app, [*argv, "--engine", "native"])
    assert got.exit_code == 0 and got.stdout == eager.stdout and eager.stdout.strip()
    lines = got.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("native decode step unavailable (Transformer, MTPModule)"), lines
    assert f"{shared} is writable by others" in lines[0] and lines[1].endswith(", eager)"), lines
    assert runs(fake_cxx[1]) == 0 and not list((shared / "cache" / "native").glob("*.so"))


def plant(root: Path, name: str, data: bytes | None = None, link: Path | None = None, mode: int = 0o500) -> Path:
    folder = root / "native"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / name
    if link is not None:
        path.symlink_to(link)
    else:
        path.write_bytes(data or b"")
        path.chmod(mode)
    return path


def empty_library(tmp_path: Path) -> Path:
    """A shared library with no symbols of ours (an empty translation unit)."""
    (tmp_path / "empty.cpp").write_text("int smallem_nothing_here = 1;\n")
    out = tmp_path / "empty.so"
    subprocess.run(["g++", "-shared", "-fPIC", "-o", str(out), str(tmp_path / "empty.cpp")], check=True)
    return out


@pytest.mark.parametrize("bad", ["truncated", "wrong digest", "no digest", "no symbols", "symlink", "group-writable"])
def test_a_bad_cached_library_is_rebuilt(tmp_path: Path, fake_cxx: tuple[Path, Path], bad: str) -> None:
    """A cached library that is not the bytes built (truncated: mapped, it would end the run with
    SIGBUS; another's; named without a digest), one without the engine's symbols, a symlink, or a
    file others could have written: never loaded; removed, and built again with one line."""
    good, counter = fake_cxx
    pre = prefix(tmp_path / "probe")
    root = tmp_path / "cache"
    data = good.read_bytes()
    if bad == "truncated":
        planted = plant(root, f"{pre}{digest(good)}.so", data[: len(data) // 2])
    elif bad == "wrong digest":
        planted = plant(root, f"{pre}{'0' * 64}.so", data)
    elif bad == "no digest":
        planted = plant(root, f"{pre}.so", data)
    elif bad == "no symbols":
        empty = empty_library(tmp_path)
        planted = plant(root, f"{pre}{digest(empty)}.so", empty.read_bytes())
    elif bad == "symlink":
        planted = plant(root, f"{pre}{digest(good)}.so", link=good)
    else:
        planted = plant(root, f"{pre}{digest(good)}.so", data, mode=0o770)
    before = runs(counter)
    log: list[str] = []
    lib = kernels.library(root, log.append)
    assert hasattr(lib, "smallem_step") and hasattr(lib, "smallem_chain") and lib.smallem_panel() in (8, 16)
    assert runs(counter) == before + 1  # built again
    assert len(log) == 1 and log[0].startswith("building the native decode step again"), log
    why = {"no symbols": "lacks smallem_", "symlink": "cannot be opened", "group-writable": "not a private file"}
    assert why.get(bad, "damaged (its digest differs)") in log[0], log
    good_now = one_good_library(root)  # what was planted is gone, or replaced by the build under its name
    assert not os.path.lexists(planted) or planted == good_now


def test_a_truncated_library_in_the_cli_is_rebuilt_without_a_signal(
    family: Family, tmp_path: Path, fake_cxx: tuple[Path, Path]
) -> None:
    """What the red team saw end every native run with SIGBUS (exit 135), run in a process of its
    own: a truncated library in the cache. The run prints the eager engine's text and exits 0, with
    no traceback; the cache holds a whole library again."""
    good, _ = fake_cxx
    root = tmp_path / "cache"
    pre = prefix(tmp_path / "probe")
    plant(root, f"{pre}{digest(good)}.so", good.read_bytes()[:4096])
    argv = ["generate", "The quick brown fox", "--target", str(family.target), "-n", "20"]
    eager = CliRunner().invoke(app, [*argv, "--engine", "eager"])
    env = {**os.environ, "SMALLEM_CACHE": str(root)}
    code = "from smallem_cli.cli import main; main()"
    r = subprocess.run(
        [sys.executable, "-c", code, *argv, "--engine", "native"], capture_output=True, text=True, env=env, timeout=600
    )
    assert r.returncode == 0 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    assert r.stdout == eager.stdout and eager.stdout.strip()
    assert "building the native decode step again" in r.stderr and "damaged" in r.stderr, r.stderr
    one_good_library(root)


def test_a_compiler_that_writes_garbage_is_tried_once_and_caches_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiler that exits 0 but writes no library (garbage, or one without our symbols): one
    line, nothing cached (the next process tries again), and within this process no second try,
    for any model."""
    counter = tmp_path / "runs"
    empty = empty_library(tmp_path)
    for what, source in [("does not load", "echo garbage >"), ("lacks smallem_step", f"cp {empty}")]:
        cxx = script(
            tmp_path / f"cxx-{len(what)}",
            f'while [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done\necho run >> {counter}\n{source} "$out"\n',
        )
        monkeypatch.setenv("CXX", str(cxx))
        root = tmp_path / f"cache-{len(what)}"
        before = runs(counter)
        for _ in range(2):  # the second: another model of the same run
            with pytest.raises(NativeUnavailable, match=f"^the library the C\\+\\+ compiler built {what}"):
                kernels.library(root, lambda _: None)
        assert runs(counter) == before + 1
        assert list((root / "native").iterdir()) == []  # nothing cached, no build folder left


def test_a_hanging_compiler_times_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler that never ends: stopped at BUILD_TIMEOUT with what it started (the child that
    would hold its output open included), one line, and not tried again in this process."""
    pid_file = tmp_path / "pid"
    cxx = script(tmp_path / "cxx", f"sleep 120 &\necho $! > {pid_file}\nwait\n")
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setattr(kernels, "BUILD_TIMEOUT", 1.0)
    t = time.monotonic()
    with pytest.raises(NativeUnavailable, match=r"ran over 1 s"):
        kernels.library(tmp_path / "cache", lambda _: None)
    assert time.monotonic() - t < 30
    child = int(pid_file.read_text())
    for _ in range(50):  # killed (gone, or a zombie no one reaps in a container)
        try:
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            break
        if state in ("Z", "X"):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the compiler's child {child} still runs")
    t = time.monotonic()
    with pytest.raises(NativeUnavailable, match=r"ran over 1 s"):
        kernels.library(tmp_path / "cache", lambda _: None)
    assert time.monotonic() - t < 1  # remembered: not run again


def test_a_failing_compiler_is_tried_once_a_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler that fails: one try for the target and the proposer's model together."""
    counter = tmp_path / "runs"
    cxx = script(tmp_path / "cxx", f"echo run >> {counter}\necho 'error: no' >&2\nexit 1\n")
    monkeypatch.setenv("CXX", str(cxx))
    log: list[str] = []
    for _ in range(3):
        with pytest.raises(NativeUnavailable, match="the C\\+\\+ compiler failed: error: no"):
            native.library(tmp_path / "cache", log.append)
    assert runs(counter) == 1 and len(log) == 1
