"""Fuzzing the loaders: a few hundred seeded mutations of a small family's files.

Mutated: a checkpoint's header (dtypes, shapes, offsets, names), its metadata (config
fields, kind, vocab_rank), its tensors' bytes (NaN, infinity, garbage), its length
(truncated, padded, a huge declared header), and an HF folder's config.json and
tokenizer. Every case must either load, or raise the project's own error
(CheckpointError, HFFormatError or TokenizerError: what the CLI prints as one
`error:` line with exit 2); never another exception, never a hang, and never more
than a few hundred MB allocated: the cases run in a child process whose data segment
is capped (RLIMIT_DATA) at 400 MB above what the libraries take, each under an alarm.
Some cases also go through `smallem generate`, which must exit 0 or 2 with one line.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import Family

from smallem_cli.interop import hf

CASES = 320
SEED = 11
MEMORY_CAP = 400_000_000  # bytes of data segment the cases may add to what imports took
CASE_SECONDS = 10  # a case that takes longer is a hang

VALUES: list[Any] = [
    0, -1, 1, 2, 3, 7, 31, 64, 299, 300, 1000, 10**6, 10**12, 2**63, -(2**63),
    0.0, -0.5, 0.5, 1e-300, 1e308, float("nan"), float("inf"), float("-inf"),
    True, False, None, "", "256", "nan", [], [1, 2], {}, {"a": 1},
]  # fmt: skip
DTYPES = ["F16", "BF16", "F32", "F64", "I8", "I32", "I64", "U8", "BOOL", "F8_E4M3", "XX", 7, None]


def split(blob: bytes) -> tuple[dict[str, Any], bytes]:
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def join(header: dict[str, Any], data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def mutate_safetensors(blob: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One random mutation of a safetensors file -> (what was done, the new bytes)."""
    header, data = split(blob)
    meta = header.get("__metadata__", {})
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    kind = rng.choice(
        ["config", "config", "config", "meta", "dtype", "shape", "offsets", "drop", "rename", "values", "nan",
         "truncate", "garbage", "header_len", "pad", "vocab_rank"]
    )  # fmt: skip
    if kind == "config" and "config" not in meta:  # an HF file: no smallem metadata
        kind = "values"
    if kind == "config":
        cfg = json.loads(meta["config"])
        field = rng.choice([*cfg, "extra"])
        value = rng.choice(VALUES)
        cfg[field] = value
        if rng.random() < 0.2:
            cfg.pop(rng.choice(list(cfg)))
        meta["config"] = json.dumps(cfg)
        what = f"config {field}={value!r}"
    elif kind == "meta":
        key = rng.choice(["config", "kind", "format", "tokenizer", "facts", "vocab_rank"])
        value = rng.choice(["", "{", "[]", "null", "mtp", "model", "smallem", '{"dim": 8}', "x" * 1000])
        meta[key] = value if rng.random() < 0.8 else rng.choice([1, None, ["a"]])
        what = f"metadata {key}={meta[key]!r:.40}"
    elif kind == "vocab_rank":
        value = rng.choice([[300], [-1], [0, 0], list(range(400)), ["1"], [1.5], {"a": 1}, [2**70], []])
        meta["vocab_rank"] = json.dumps(value)
        what = f"vocab_rank {value!r:.40}"
    elif kind == "dtype":
        header[name]["dtype"] = rng.choice(DTYPES)
        what = f"{name} dtype {header[name]['dtype']}"
    elif kind == "shape":
        shape = list(header[name]["shape"])
        choice = rng.choice(["swap", "grow", "huge", "zero", "neg", "rank"])
        if choice == "swap":
            shape = shape[::-1]
        elif choice == "grow":
            shape[0] += rng.choice([1, 7, 1000])
        elif choice == "huge":
            shape = [2**40, *shape[1:]]
        elif choice == "zero":
            shape[0] = 0
        elif choice == "neg":
            shape[0] = -shape[0]
        else:
            shape = [*shape, 1] if rng.random() < 0.5 else shape[:-1]
        header[name]["shape"] = shape
        what = f"{name} shape {shape}"
    elif kind == "offsets":
        lo, hi = header[name]["data_offsets"]
        header[name]["data_offsets"] = rng.choice([[hi, lo], [lo, hi + 2], [lo, 2**62], [0, hi - lo], [-1, hi]])
        what = f"{name} offsets {header[name]['data_offsets']}"
    elif kind == "drop":
        del header[name]
        what = f"drop {name}"
    elif kind == "rename":
        header[name + rng.choice(["x", ".bias", "_"])] = header.pop(name)
        what = f"rename {name}"
    elif kind in ("values", "nan"):
        lo, hi = header[name]["data_offsets"]
        buf = bytearray(data)
        word = rng.choice([b"\x00\x7e", b"\x00\x7c", b"\x00\xfc", b"\xff\xff"]) if kind == "nan" else rng.randbytes(2)
        for _ in range(rng.choice([1, 3, 50])):
            at = lo + 2 * rng.randrange((hi - lo) // 2)
            buf[at : at + 2] = word
        data = bytes(buf)
        what = f"{name} values {word.hex()}"
    else:
        whole = join(header | {"__metadata__": meta}, data)
        if kind == "truncate":
            cut = rng.randrange(len(whole))
            return f"truncate at {cut}", whole[:cut]
        if kind == "garbage":
            at = rng.randrange(len(whole))
            return f"garbage at {at}", whole[:at] + rng.randbytes(rng.choice([1, 8, 64])) + whole[at + 8 :]
        if kind == "header_len":
            n = rng.choice([0, 1, 7, 2**31, 2**62, 2**64 - 1])
            return f"header length {n}", struct.pack("<Q", n) + whole[8:]
        return "padded", whole + rng.randbytes(rng.choice([1, 8, 4096]))
    header["__metadata__"] = meta
    return what, join(header, data)


def mutate_hf(folder: Path, rng: random.Random) -> str:
    """One random mutation of an HF folder's config.json, tokenizer.json or weights (in place)."""
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    kind = rng.choice(["field", "field", "field", "drop", "text", "tokenizer", "weights"])
    if kind == "field":
        field = rng.choice([*cfg, "head_dim", "rope_scaling", "quantization_config"])
        cfg[field] = rng.choice([*VALUES, {"rope_type": "default", "rope_theta": -1.0}])
        cfg_path.write_text(json.dumps(cfg))
        return f"config.json {field}={cfg[field]!r:.40}"
    if kind == "drop":
        field = rng.choice(list(cfg))
        del cfg[field]
        cfg_path.write_text(json.dumps(cfg))
        return f"config.json without {field}"
    if kind == "text":
        raw = rng.choice([b"", b"{", b"[1]", b"null", b"\xff\xfe{}", b"[" * 100_000, b'{"model_type": "llama"}'])
        cfg_path.write_bytes(raw)
        return f"config.json = {raw[:20]!r}"
    target = folder / ("tokenizer.json" if kind == "tokenizer" else "model.safetensors")
    if kind == "weights":
        what, blob = mutate_safetensors(target.read_bytes(), rng)
        target.write_bytes(blob)
        return f"model.safetensors: {what}"
    blob = target.read_bytes()
    cut = rng.randrange(len(blob))
    target.write_bytes(blob[:cut])
    return f"tokenizer.json truncated at {cut}"


# --- the child process --------------------------------------------------------------------------
def run_cases(base: Path, work: Path, n: int, seed: int) -> dict[str, Any]:
    import signal

    import torch
    from typer.testing import CliRunner

    from smallem_cli.cli.app import app
    from smallem_cli.engine import family as fam
    from smallem_cli.model import checkpoint
    from smallem_cli.model.chat import ChatError
    from smallem_cli.model.tokenizer import TokenizerError

    ours = (checkpoint.CheckpointError, hf.HFFormatError, TokenizerError, ChatError)  # ChatError: the end ids
    cpu = torch.device("cpu")
    target = fam.load_target(base / "target.safetensors", cpu)

    def alarm(*_: object) -> None:
        raise TimeoutError("the case hung")

    signal.signal(signal.SIGALRM, alarm)
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    failures: list[str] = []
    for i in range(n):
        which = ["target", "mtp", "draft-2l", "hf"][i % 4]
        case = work / f"case{i}"
        case.mkdir()
        shutil.copy(base / "tokenizer.json", case / "tokenizer.json")
        if which == "hf":
            path = case / "hf"
            shutil.copytree(base / "hf", path)
            what = mutate_hf(path, rng)
        else:
            path = case / f"{which}.safetensors"
            what, blob = mutate_safetensors((base / f"{which}.safetensors").read_bytes(), rng)
            path.write_bytes(blob)
        signal.alarm(CASE_SECONDS)
        try:
            if which in ("target", "hf"):
                fam.load_target(path, cpu)
            else:
                fam.load_proposer(str(path), target, cpu, 20)
            outcomes["loaded"] += 1
        except ours as e:
            outcomes["refused"] += 1
            if not str(e).strip():
                failures.append(f"case {i} ({which}: {what}): an empty message")
        except BaseException as e:  # anything else is what the fuzzing looks for
            failures.append(f"case {i} ({which}: {what}): {type(e).__name__}: {str(e)[:200]}")
        finally:
            signal.alarm(0)
        if i % 16 == 0 and which in ("target", "hf"):  # the CLI's view of the same file
            res = CliRunner().invoke(app, ["generate", "The word", "--target", str(path), "-n", "3", "-q"])
            lines = res.stderr.splitlines()
            if res.exit_code not in (0, 2) or (res.exit_code == 2 and (len(lines) != 1 or "error: " not in lines[0])):
                failures.append(f"case {i} via the CLI ({what}): exit {res.exit_code}, {res.stderr[-300:]!r}")
        shutil.rmtree(case)
    return {"outcomes": dict(outcomes), "failures": failures}


def cap_memory(extra: int) -> None:
    import resource

    status = Path("/proc/self/status").read_text()
    used = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmData:"))
    resource.setrlimit(resource.RLIMIT_DATA, (used + extra, resource.RLIM_INFINITY))


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    import smallem_cli.cli.app  # noqa: F401 - everything imported before the cap

    base, work, n, seed = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    cap_memory(MEMORY_CAP)
    print(json.dumps(run_cases(base, work, n, seed)))


# --- the test -------------------------------------------------------------------------------------
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux to cap the child's memory")
def test_mutated_files_load_or_are_refused(family: Family, tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    for f in (family.target, family.mtp, family.draft, family.tokenizer):
        shutil.copy(f, base / f.name)
    hf.export_hf(family.target, base / "hf", family.tokenizer)
    work = tmp_path / "work"
    work.mkdir()
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), str(Path(__file__).parent)])}
    argv = [sys.executable, __file__, str(base), str(work), str(CASES), str(SEED)]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.splitlines()[-1])
    assert report["failures"] == [], "\n".join(report["failures"])
    # the mutations reach both outcomes: some files still load, most are refused
    assert report["outcomes"]["loaded"] >= 10 and report["outcomes"]["refused"] >= CASES // 2, report
