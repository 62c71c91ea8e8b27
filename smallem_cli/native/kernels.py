"""The native engine's compiled kernels: built once by the system's C++ compiler, cached on
disk by the hash of their source, flags and compiler, loaded with ctypes.

Two builds: "avx512" where torch finds AVX-512 on this CPU (the products read panels of 16
output rows, one 512-bit register: a loop of independent FMAs ran 110-112 GFLOP/s a core here
on them against 67 on 256-bit ones, and a pass over a few rows is bound by them), and "avx2"
(panels of 8) everywhere
else. An AVX-512 CPU can load the AVX2 build beside it (`--engine native-avx2`), so that
`smallem bench` times both in one run.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from .pack import NativeUnavailable

Log = Callable[[str], None]
HERE = Path(__file__).parent
SOURCES = ("step.cpp",)  # it includes the headers beside it
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
ISA_FLAGS = {"avx2": [], "avx512": ["-mavx512f"]}
# The engines (`--engine`) and their builds: the widest this CPU runs, and the AVX2 one beside it
# (on an AVX-512 CPU, to time both in one run); each a model's attribute of that name, "-" as "_".
ENGINES = {"native": None, "native-avx2": "avx2"}
_LIBS: dict[str, ctypes.CDLL] = {}  # by ISA, loaded once a process


def prefetch_rows(cpuinfo: str | None = None) -> int:
    """The fewest input rows a product tile prefetches its next panels for (`matmul.h`
    PREFETCH_ROWS), by the CPU's maker (`cpuinfo`: /proc/cpuinfo's text, read when None): 5 on
    AMD, 8 elsewhere. Measured, whole target passes alternated pass by pass: over 5 to 7 rows an
    AMD Zen 4 host took 2-12% less with it; an Emerald Rapids host 5-7% more at 5 and 6 rows."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    return 5 if "AuthenticAMD" in cpuinfo else 8


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


def library(root: Path, log: Log, isa: str | None = None) -> ctypes.CDLL:
    """The kernels for `isa` (None: `best_isa`), built into `root`/native once."""
    best = best_isa()
    isa = isa or best
    if isa not in ISA_FLAGS or (isa == "avx512" and best != "avx512"):
        raise NativeUnavailable(f"this CPU does not run the {isa} build")
    if isa in _LIBS:
        return _LIBS[isa]
    flags = FLAGS + ISA_FLAGS[isa] + [f"-DPREFETCH_ROWS={prefetch_rows()}"]
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise NativeUnavailable(f"no C++ compiler ({cxx}) on PATH")
    code = b"".join(f.name.encode() + f.read_bytes() for f in sorted([*HERE.glob("*.cpp"), *HERE.glob("*.h")]))
    key = hashlib.sha256(code + repr((flags, cxx)).encode()).hexdigest()[:24]
    path = root / "native" / f"step-{key}.so"
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.parent.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:  # a library that gets loaded: only from a private folder
        raise NativeUnavailable(f"{path.parent} is writable by others or not yours")
    if not path.is_file():
        log(f"building the native decode step for this machine ({isa}; once, cached in {root})")
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=path.parent))
        try:
            out = tmp / "step.so"
            sources = [str(HERE / s) for s in SOURCES]
            r = subprocess.run([cxx, *flags, "-o", str(out), *sources], capture_output=True, text=True)
            if r.returncode != 0:
                first = (r.stderr.strip().splitlines() or ["no message"])[0][:200]
                raise NativeUnavailable(f"the C++ compiler failed: {first}")
            os.replace(out, path)  # whole or absent, even with another process building the same key
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    lib = ctypes.CDLL(str(path))
    ptr, num = ctypes.c_void_p, ctypes.c_int  # the C signatures (step.cpp, verify.h), argument by argument
    lib.smallem_step.restype = lib.smallem_chain.restype = None
    lib.smallem_step.argtypes = [ptr] * 3 + [num] + [ptr] * 4 + [num] + [ptr] * 2 + [num] + [ptr] * 3 + [num, ptr]
    lib.smallem_chain.argtypes = [ptr] * 3 + [num] + [ptr] * 5 + [num] * 2 + [ptr] * 4 + [num] + [ptr]
    lib.smallem_chain.argtypes += [ctypes.c_float] + [ptr] * 4 + [num] * 2 + [ptr, ctypes.c_float, ptr]
    lib.smallem_batch_step.restype = None
    lib.smallem_batch_step.argtypes = [ptr] * 3 + [num] + [ptr] * 8 + [num] + [ptr] * 2 + [num] + [ptr] * 2 + [num, ptr]
    lib.smallem_verify_sample.restype = None
    lib.smallem_verify_sample.argtypes = [ptr, num, num, ctypes.c_float] + [ptr] * 6 + [num] + [ctypes.c_float] * 2
    lib.smallem_penalize.restype = None
    lib.smallem_penalize.argtypes = [ptr, num, num, ptr, ptr, ctypes.c_float, ptr, ptr]
    lib.smallem_panel.restype, lib.smallem_panel.argtypes = num, []
    lib.smallem_score_rows.restype, lib.smallem_score_rows.argtypes = num, []
    _LIBS[isa] = lib
    return lib
