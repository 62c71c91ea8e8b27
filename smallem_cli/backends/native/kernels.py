"""The native engine's kernels: built once by the system's C++ compiler, cached on disk by the hash
of their source, flags and compiler, loaded with ctypes. Two builds: "avx512" (panels of 16 output
rows, one 512-bit register) where torch finds AVX-512, else "avx2" (panels of 8), which an AVX-512 CPU
loads beside it (`--engine native-avx2`) to time both."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

Log = Callable[[str], None]
HERE = Path(__file__).parent
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
# torch's AVX512 is AVX512F with BW, VL and DQ; VNNI (`qmatmul.h`'s integer products) only where the CPU has it
ISA_FLAGS = {"avx2": [], "avx512": ["-mavx512f", "-mavx512bw"]}
# The engines (`--engine`) and their builds: the widest this CPU runs (None), and the AVX2 one.
ENGINES = {"native": None, "native-avx2": "avx2"}
_LIBS: dict[str, ctypes.CDLL] = {}  # by ISA, loaded once a process
_FAILED: dict[str, str] = {}  # build key -> why its build failed: a compiler is tried once a process
BUILD_TIMEOUT = 300.0  # seconds a build may run: a hung compiler must not hang generate
# What every build exports (step.cpp, verify.h), a library without one is not ours: each function's
# arguments (p a pointer, i an int, f a float) and whether it returns an int (else nothing).
SIGNATURES = {
    "smallem_step": ("pppippppippipppip", False), "smallem_chain": ("pp", False),
    "smallem_batch_step": ("pppipppppppppippippip", False), "smallem_verify_sample": ("piifppppppiff", False),
    "smallem_penalize": ("piippfpp", False), "smallem_panel": ("", True), "smallem_score_rows": ("", True),
    "smallem_amx": ("i", True),
}  # fmt: skip


class NativeUnavailable(RuntimeError):
    """The native engine cannot serve this machine or this model (the message says why)."""


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""


def prefetch_rows(cpuinfo: str | None = None) -> int:
    """`matmul.h`'s PREFETCH_ROWS by the CPU's maker: 5 on AMD, 8 elsewhere, as measured (docs/decisions.md)."""
    return 5 if "AuthenticAMD" in (_cpuinfo() if cpuinfo is None else cpuinfo) else 8


def has_flags(names: tuple[str, ...], cpuinfo: str | None = None) -> bool:
    """Whether every one of `names` is among /proc/cpuinfo's flags."""
    for line in (_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        if line.startswith("flags"):
            return set(names) <= set(line.split())
    return False


def vnni(cpuinfo: str | None = None) -> bool:
    """Whether the CPU has AVX-512 VNNI: the AVX-512 build's integer products use it, else the same sums without it
    (`qmatmul.h`)."""
    return has_flags(("avx512_vnni",), cpuinfo)


def amx(cpuinfo: str | None = None) -> bool:
    """Whether the CPU has AMX's tiles and their int8 products: the AVX-512 build takes the products of a few rows or
    more there (`amx.h`), the same sums."""
    return has_flags(("amx_tile", "amx_int8"), cpuinfo)


def isa_flags(isa: str) -> list[str]:
    """The compiler's flags for `isa`'s build on this CPU."""
    if isa != "avx512":
        return ISA_FLAGS[isa]
    return ISA_FLAGS[isa] + (["-mavx512vnni"] if vnni() else []) + (["-mamx-tile", "-mamx-int8"] if amx() else [])


def best_isa() -> str:
    """The widest build this CPU runs: "avx512" or "avx2" (NativeUnavailable: neither)."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in ("AVX2", "AVX512"):
        raise NativeUnavailable(f"this CPU lacks AVX2 (torch reports {cap})")
    return cap.lower()


def loaded() -> ctypes.CDLL:
    """A library this process has loaded (what every build shares: `smallem_verify_sample`)."""
    assert _LIBS, "the native library is not loaded (`library`)"
    return next(iter(_LIBS.values()))


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def private_folder(folder: Path) -> Path:
    """`folder` (made 0700 where missing) -> its real path, where every folder from it up to / is this
    user's or root's and not writable by group or others (above `folder`, sticky ones such as /tmp may
    be: others cannot move what is ours in them). NativeUnavailable names the first that fails."""
    me = os.geteuid()
    given = Path(os.path.abspath(folder))
    for p in reversed([given, *given.parents]):  # from / down: another's symlink could be repointed any time
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            try:
                os.mkdir(p, 0o700)  # each missing one private, whatever the umask (mkdir(parents=) is not)
            except FileExistsError:
                pass
            except OSError as e:
                raise NativeUnavailable(f"cannot make the cache folder {p}: {e.strerror}") from None
            continue
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, me):
            raise NativeUnavailable(f"{p} is a symlink someone else owns: no native library is loaded through it")
    # Then the real folders, checked with lstat and used from here on by their real path: once each
    # is ours (or root's) and closed to others, no one else can change any of them after the check.
    real = Path(os.path.realpath(given))
    for p in [real, *real.parents]:
        st = os.lstat(p)
        sticky = p != real and st.st_mode & stat.S_ISVTX
        if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (0, me) or (st.st_mode & 0o022 and not sticky):
            raise NativeUnavailable(f"{p} is writable by others or not yours: no library is loaded from under it")
    return real


def _load(data: bytes, folder: Path) -> ctypes.CDLL | str:
    """`data` loaded as a library with every one of SIGNATURES -> it, or why not (a line). CDLL takes a path,
    looked up again as it loads, so the bytes go into a fresh mkdtemp folder (0700, inside the checked `folder`:
    /tmp may be noexec) and load from there: what was hashed is what runs. The copy goes once loaded: the mapping
    keeps its inode in use, so no later copy gets that inode and is taken for this library by the loader."""
    tmp = tempfile.mkdtemp(prefix=".load-", dir=folder)
    try:
        copy = os.path.join(tmp, "step.so")
        with open(copy, "xb") as f:
            f.write(data)
        lib = ctypes.CDLL(copy)
    except OSError as e:  # not a library of this machine: truncated, garbage, another arch
        return f"does not load ({str(e).rsplit(': ', 1)[-1][:200]})"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    missing = [s for s in SIGNATURES if not hasattr(lib, s)]  # before argtypes: no AttributeError later
    return f"lacks {missing[0]}" if missing else lib


def _cached(path: Path, digest: str, folder: Path) -> ctypes.CDLL | str:
    """The library at `path`, if its bytes are the ones built (sha256 `digest`, in its name) -> it,
    or why not. O_NOFOLLOW: a symlink is refused; O_NONBLOCK: a FIFO does not hang the open."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        return f"cannot be opened ({e.strerror})"
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            return "is not a private file of this user"
        data = f.read()
    if hashlib.sha256(data).hexdigest() != digest:  # truncated, overwritten: mapped, it could SIGBUS
        return "is damaged (its digest differs)"
    return _load(data, folder)


def _build(cxx: str, flags: list[str], key: str, folder: Path) -> ctypes.CDLL:
    """Compile the kernels in a private folder, load them, and only then publish them in `folder`
    as step-`key`-<sha256 of their bytes>.so (a build that does not load is never cached)."""
    if shutil.which(cxx) is None:
        raise NativeUnavailable(f"no C++ compiler ({cxx}) on PATH")
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=folder))  # 0700: no one else can enter
    try:
        out = tmp / "step.so"
        argv = [cxx, *flags, "-o", str(out), str(HERE / "step.cpp")]  # it includes the headers beside it
        # a session of its own: on a timeout the compiler's children (cc1plus) are killed with it,
        # and none of them is left holding the stderr pipe open
        p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, err = p.communicate(timeout=BUILD_TIMEOUT)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            raise NativeUnavailable(f"the C++ compiler ({cxx}) ran over {BUILD_TIMEOUT:g} s") from None
        if p.returncode != 0:
            first = (err.strip().splitlines() or ["no message"])[0][:200]
            raise NativeUnavailable(f"the C++ compiler failed: {first}")
        try:
            data = out.read_bytes()
        except OSError:
            raise NativeUnavailable(f"the C++ compiler ({cxx}) wrote no library") from None
        lib = _load(data, folder)
        if isinstance(lib, str):
            raise NativeUnavailable(f"the library the C++ compiler built {lib}")
        out.chmod(0o500)  # not the umask's: a group-writable file would fail its check when next loaded
        # whole or absent, even with another process building the same key
        os.replace(out, folder / f"step-{key}-{hashlib.sha256(data).hexdigest()}.so")
        return lib
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def library(root: Path, log: Log, isa: str | None = None) -> ctypes.CDLL:
    """The kernels for `isa` (None: `best_isa`), built into `root`/native once, loaded only from a
    `private_folder` and as the bytes built (`_cached`); a cached one that fails is built again."""
    best = best_isa()
    isa = isa or best
    if isa not in ISA_FLAGS or (isa == "avx512" and best != "avx512"):
        raise NativeUnavailable(f"this CPU does not run the {isa} build")
    if isa in _LIBS:
        return _LIBS[isa]
    flags = FLAGS + isa_flags(isa) + [f"-DPREFETCH_ROWS={prefetch_rows()}"]
    cxx = os.environ.get("CXX", "g++")
    code = b"".join(f.name.encode() + f.read_bytes() for f in sorted([*HERE.glob("*.cpp"), *HERE.glob("*.h")]))
    key = hashlib.sha256(code + repr((flags, cxx)).encode()).hexdigest()[:24]
    if key in _FAILED:  # this compiler already failed on this build in this process: once is enough
        raise NativeUnavailable(_FAILED[key])
    folder = private_folder(Path(root) / "native")
    why = None
    for path in sorted(folder.glob(f"step-{key}-*.so")):
        lib = _cached(path, path.name[len(f"step-{key}-") : -len(".so")], folder)
        if not isinstance(lib, str):
            return _bind(isa, lib)
        why = lib
        with contextlib.suppress(OSError):
            path.unlink()
    why = f"again ({isa}): the cached one {why}" if why else f"for this machine ({isa}; once, cached in {root})"
    log(f"building the native decode step {why}")
    try:
        lib = _build(cxx, flags, key, folder)
    except NativeUnavailable as e:
        _FAILED[key] = str(e)
        raise
    return _bind(isa, lib)


def _bind(isa: str, lib: ctypes.CDLL) -> ctypes.CDLL:
    kinds = {"p": ctypes.c_void_p, "i": ctypes.c_int, "f": ctypes.c_float}
    for name, (args, returns_int) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int if returns_int else None, [kinds[a] for a in args]
    lib.smallem_amx(1)  # the tile unit where the build has it and Linux grants it
    _LIBS[isa] = lib
    return lib
