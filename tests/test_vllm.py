"""vLLM beside Smallem: what is read from vLLM (its counters, its answers, its logs), the agreement
table, how its venv is found and refused, and `bench --peer vllm` on a stand-in for vLLM's run.
All of this runs without vLLM. The last test runs the real check, `python -m
smallem_cli.interop.vllm_check`, only where `.venv-vllm` (built by `make vllm-venv`) exists.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import Family
from typer.testing import CliRunner

from smallem_cli.bench import run as bench
from smallem_cli.cli.app import app
from smallem_cli.defaults import default_k
from smallem_cli.interop import vllm_check, vllm_run
from smallem_cli.interop import vllm_peer as V

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

# --- what vLLM reports ---------------------------------------------------------------------------
METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="t"} 40.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="t"} 120.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="t"} 66.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="0"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="2"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="1"} 24.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="t",position="1"} 1.7e9
vllm:num_requests_running{engine="0",model_name="t"} 0.0
"""


def test_prometheus_counters_and_acceptance() -> None:
    c = V.prometheus_counters(METRICS)
    assert c == {"drafts": 40, "draft_tokens": 120, "accepted": 66, "per_pos": [30, 24, 12]}
    a = V.acceptance(c)
    assert a is not None and a.drafts == 40
    assert a.rate == pytest.approx(66 / 120) and a.tokens_per_step == pytest.approx(1 + 66 / 40)
    assert a.per_pos == pytest.approx([0.75, 0.6, 0.3])
    assert V.acceptance(V.prometheus_counters("")) is None  # no speculation: no figures, not zeros
    assert V.acceptance({"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}) is None


def test_offline_counters_and_their_growth() -> None:
    """vllm_run reads LLM.get_metrics()'s: counters summed over engines, the per-position vector."""
    metrics = [
        SimpleNamespace(name="vllm:spec_decode_num_drafts", value=10),
        SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=30),
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=17),
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[8, 6]),
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[1, 1, 1]),
        SimpleNamespace(name="vllm:num_requests_running", value=3),
    ]
    after = vllm_run.spec_counters(metrics)
    assert after == {"drafts": 10, "draft_tokens": 30, "accepted": 17, "per_pos": [9, 7, 1]}
    before = {"drafts": 4, "draft_tokens": 12, "accepted": 7, "per_pos": [4, 3]}
    assert vllm_run.minus(after, before) == {"drafts": 6, "draft_tokens": 18, "accepted": 10, "per_pos": [5, 4, 1]}
    empty = vllm_run.spec_counters([])
    assert V.acceptance(empty) is None
    assert V.grown(after, before) == vllm_run.minus(after, before)  # the server's counters, the same way


def test_completion_tokens() -> None:
    assert V.completion_tokens(json.dumps({"choices": [{"text": "x", "token_ids": [5, 6, 7]}]})) == [5, 6, 7]
    for bad in ({"choices": [{"text": "x"}]}, {"choices": []}, {"error": "no"}, {"choices": [{"token_ids": ["a"]}]}):
        with pytest.raises(V.VllmError, match="no token ids"):
            V.completion_tokens(json.dumps(bad))
    with pytest.raises(V.VllmError, match="no token ids"):
        V.completion_tokens("<html>not JSON</html>")


def test_agreement() -> None:
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert V.agreement(ref, [[1, 2, 3, 4], [5, 6, 7, 8]]) == (2, 8, 8)
    assert V.agreement(ref, [[1, 2, 9, 4], [5, 6, 7]]) == (0, 6, 8)  # a short answer is not equal
    with pytest.raises(V.VllmError):
        V.agreement(ref, [[1, 2, 3, 4]])


def test_last_error_names_why_vllm_stopped() -> None:
    log = "INFO loading\nTraceback (most recent call last):\n  File x\nValueError: head size 8 unsupported\nINFO bye\n"
    assert V.last_error(log) == "ValueError: head size 8 unsupported"
    assert V.last_error("only this\n\n") == "only this"
    assert V.last_error("") == "(no output)"


def test_check_table_marks_a_disagreement() -> None:
    ref = [[1, 2, 3], [4, 5, 6]]
    counters = {"drafts": 2, "draft_tokens": 6, "accepted": 3, "per_pos": [2, 1, 0]}
    rows = [
        vllm_check.check_row("alone", ref, [[1, 2, 3], [4, 5, 6]], {}),
        vllm_check.check_row("draft", ref, [[1, 2, 3], [4, 0, 6]], counters, (4, 6)),
    ]
    assert rows[0].ok and not rows[1].ok and rows[1].tokens_equal == 5
    from rich.console import Console

    con = Console(width=200, record=True)
    con.print(vllm_check.check_table(rows, 3, "0.32.0+cpu"))
    text = con.export_text()
    assert "2/2" in text and "1/2 FAILED" in text and "50.0% (3/6)" in text and "66.7% (4/6)" in text
    assert "2.50" in text
    assert "1.00 / 0.50 / 0.00" in text


# --- finding vLLM ------------------------------------------------------------------------------------
def test_find_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(V, "VENV", "no-such-venv")
    monkeypatch.delenv(V.PYTHON_ENV, raising=False)
    with pytest.raises(V.VllmError, match="make vllm-venv"):
        V.find_python()
    monkeypatch.setenv(V.PYTHON_ENV, str(tmp_path / "missing"))
    with pytest.raises(V.VllmError, match="not an executable"):
        V.find_python()
    monkeypatch.setenv(V.PYTHON_ENV, sys.executable)
    assert V.find_python() == Path(sys.executable)
    monkeypatch.delenv(V.PYTHON_ENV)
    py = tmp_path / "no-such-venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.symlink_to(sys.executable)
    assert V.find_python() == Path("no-such-venv/bin/python").absolute()


def test_vllm_env(tmp_path: Path) -> None:
    """The CPU settings, kept where the user set them; the preloads only where present."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    py = venv / "bin" / "python"
    env = V.vllm_env(py, 2, {"VLLM_CPU_KVCACHE_SPACE": "4"})
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == ("0-1" if (os.cpu_count() or 1) >= 2 else "0")
    assert V.vllm_env(py, 1, {})["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert V.preloads(py, lib_dirs=()) == []
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    libs = tmp_path / "libs"
    libs.mkdir()
    (libs / V.TCMALLOC).write_bytes(b"")
    assert V.preloads(py, lib_dirs=(str(tmp_path / "none"), str(libs))) == [
        str(libs / V.TCMALLOC),
        str(venv / "lib" / "libiomp5.so"),
    ]
    assert V.vllm_env(py, 2, {"LD_PRELOAD": "mine.so"})["LD_PRELOAD"] == "mine.so"


def test_version_lookup_answered(monkeypatch: pytest.MonkeyPatch) -> None:
    """`vllm serve` asks importlib.metadata for "vllm"; the CPU build is named vllm-cpu."""
    monkeypatch.setattr(importlib.metadata, "version", importlib.metadata.version)  # restored after
    monkeypatch.setattr(vllm_run, "vllm_version", lambda: "0.32.0+cpu")
    real = importlib.metadata.version
    try:
        expected = real("vllm")  # a real vllm distribution answers for itself
    except importlib.metadata.PackageNotFoundError:
        expected = "0.32.0+cpu"
    vllm_run.answer_version_lookup()
    assert importlib.metadata.version("vllm") == expected
    assert importlib.metadata.version("pytest") == real("pytest")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("no-such-distribution-here")


def test_runner_usage_and_no_vllm_at_import() -> None:
    """The runner names no vllm at import (Smallem's side reads it); bad arguments: usage, exit 2."""
    res = subprocess.run([sys.executable, str(V.RUNNER), "nonsense"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stderr.startswith("usage:") and res.stderr.count("\n") == 1
    assert "vllm" not in sys.modules


# --- bench --peer vllm ---------------------------------------------------------------------------
def _prompts(tmp_path: Path) -> Path:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"tokens": list(range(5 + i, 17 + i)), "text": ""}) for i in range(2)))
    return prompts


def test_bench_peer_vllm_refused_without_its_venv(
    family: Family, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    timed: list[object] = []
    monkeypatch.setattr(bench, "run_bench", lambda *a, **kw: timed.append(a))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(V, "VENV", "no-such-venv")
    monkeypatch.delenv(V.PYTHON_ENV, raising=False)
    res = CliRunner().invoke(app, ["bench", "--target", str(family.target), "--peer", "vllm"])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1 and "make vllm-venv" in res.stderr
    monkeypatch.setenv(V.PYTHON_ENV, str(tmp_path / "nothing"))
    res = CliRunner().invoke(app, ["bench", "--target", str(family.target), "--peer", "vllm"])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1 and "not an executable" in res.stderr
    assert timed == []


def _stand_in(runs: list[dict[str, Any]], wrong: bool = False) -> Any:
    """A stand-in for vllm_run.py offline: our own greedy tokens (one of them changed if `wrong`),
    fixed seconds, and counters of 3 tokens a step for a draft."""
    from smallem_cli.engine import family as fam
    from smallem_cli.engine.family import NONE
    from smallem_cli.engine.generate import generate

    def run_offline(python: Path, job: dict[str, Any], env: dict[str, str], log: Path | None = None) -> dict:
        runs.append(job)
        assert Path(job["target"], "config.json").is_file()
        if job["spec"]:
            assert Path(job["spec"]["model"], "config.json").is_file()
        model = fam.load_target(Path(job["target"]), fam.pick_device("cpu")).model
        tokens = [generate(model, NONE, p, job["max_new"], 0)[0] for p in job["prompts"]]
        if wrong:
            tokens[0][-1] = (tokens[0][-1] + 1) % model.cfg.vocab_size
        steps = sum(len(t) for t in tokens) // 3
        spec = {"drafts": steps, "draft_tokens": 4 * steps, "accepted": 2 * steps, "per_pos": [steps, steps, 0, 0]}
        part = {"tokens": tokens, "spec": spec if job["spec"] else {}}
        batch, single = {**part, "seconds": 0.5}, {**part, "seconds": 2.0}
        return {"version": "0.32.0+cpu", "load_s": 1.0, "batch": batch, "single": single}

    return run_offline


def test_bench_peer_vllm_rows(family: Family, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four rows (alone, draft; one at a time, batch) beside our rows of the same run."""
    runs: list[dict[str, Any]] = []
    monkeypatch.setenv(V.PYTHON_ENV, sys.executable)
    monkeypatch.setattr(V, "run_offline", _stand_in(runs))
    args = ["bench", "--target", str(family.target), "--proposers", "draft-2l", "--prompts", str(_prompts(tmp_path))]
    args += ["-n", "12", "--repeats", "1", "--modes", "greedy", "--engines", "eager", "--peer", "vllm", "--json"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, (res.stderr, res.exception)
    out = json.loads(res.stdout)
    k = default_k("draft-2l", greedy=True)
    ours = {(r["proposer"], r["k"]): r for r in out["rows"]}
    peer = {r["peer"]: r for r in out["peer"]}
    assert list(peer) == [
        "vLLM target alone, one request at a time",
        "vLLM target alone, batch of 2",
        f"vLLM + draft-2l (k={k}), one request at a time",
        f"vLLM + draft-2l (k={k}), batch of 2",
    ]
    assert runs[0]["spec"] is None and runs[1]["spec"]["num_speculative_tokens"] == k
    assert all(j["single"] and j["max_new"] == 12 and len(j["prompts"]) == 2 for j in runs)
    assert all(r["identical"] == "2/2" and r["tokens_identical"] == "24/24" for r in peer.values())
    alone, _, _, draft = peer.values()
    assert alone["tokens_per_s"] == pytest.approx(24 / 2.0) and draft["tokens_per_s"] == pytest.approx(24 / 0.5)
    assert alone["tokens_per_step"] == 1.0 and draft["tokens_per_step"] == pytest.approx(3.0)
    assert draft["accepted_at"] == [1.0, 1.0, 0.0, 0.0] and draft["acceptance"] == pytest.approx(0.5)
    assert alone["ours_tokens_per_s"] == ours[("none", 0)]["tokens_per_s"]
    assert draft["ours_tokens_per_s"] == ours[("draft-2l", k)]["tokens_per_s"]
    assert draft["ours_tokens_per_step"] == ours[("draft-2l", k)]["tokens_per_pass"]
    table = CliRunner().invoke(app, [a for a in args if a != "--json"])
    assert table.exit_code == 0 and "tokens/step peer | ours" in table.stdout and "3.00 |" in table.stdout


def test_bench_peer_vllm_counts_a_difference_and_reports_a_failure(
    family: Family, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(V.PYTHON_ENV, sys.executable)
    monkeypatch.setattr(V, "run_offline", _stand_in([], wrong=True))
    args = ["bench", "--target", str(family.target), "--proposers", "draft-2l", "--prompts", str(_prompts(tmp_path))]
    args += ["-n", "12", "--repeats", "1", "--modes", "greedy", "--engines", "eager", "--peer", "vllm", "--json"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, (res.stderr, res.exception)
    assert {r["identical"] for r in json.loads(res.stdout)["peer"]} == {"1/2"}

    def fails(*a: object, **kw: object) -> dict:
        raise V.VllmError("vLLM failed (exit 1): ValueError: no")

    monkeypatch.setattr(V, "run_offline", fails)
    res = CliRunner().invoke(app, args)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]  # progress lines come before
    assert res.exit_code == 1 and errors == ["error: vLLM failed (exit 1): ValueError: no"]
    assert "Traceback" not in res.stderr


# --- the real thing, where vLLM is installed -------------------------------------------------------
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="vLLM's venv .venv-vllm is not built (make vllm-venv)")
def test_vllm_check(tmp_path: Path) -> None:
    """`make vllm-check`'s check on the shipped family, 48 new tokens: vLLM offline (target alone,
    with draft-2l, ngram, the MTP module at k = 1 and 3) and `vllm serve` give Smallem's greedy
    tokens; the MTP module's first guesses are accepted as often as ours; the server is gone after."""
    from smallem_cli.interop.hf import export_hf, export_mimo

    ck = ROOT / "checkpoints"
    for name in ("target", "draft-2l"):
        export_hf(ck / f"{name}.safetensors", tmp_path / "hf" / name, ck / "tokenizer.json")
    export_mimo(ck / "target.safetensors", ck / "mtp.safetensors", tmp_path / "hf" / "mimo", ck / "tokenizer.json")
    env = {**os.environ, V.PYTHON_ENV: str(VLLM_PYTHON), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "smallem_cli.interop.vllm_check", "--hf", str(tmp_path / "hf"), "-n", "48"]
    cmd += ["--logs", str(tmp_path / "logs")]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [ln for ln in res.stdout.splitlines() if "│" in ln and ("LLM:" in ln or "vllm serve" in ln)]
    assert len(rows) == 6 and all(" 8/8 " in ln for ln in rows), res.stdout
    mtp1 = next(ln for ln in rows if "MTP" in ln and "k=1" in ln).split("│")
    assert mtp1[4].split("(")[1] == mtp1[5].split("(")[1], res.stdout  # vLLM's accepted/proposed = ours
    pids = [int(ln.split("PID ")[1].split()[0]) for ln in res.stderr.splitlines() if "PID " in ln]
    assert len(pids) == 1
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)


# --- the MTP module for vLLM: the MiMo folder ------------------------------------------------------
def test_export_mimo_layout(family: Family, tmp_path: Path) -> None:
    """The target under Qwen2's names with zero q/k/v biases, the head written out, the MTP module
    as model.mtp_layers.0 ending on the target's norm; MiMo's config; nothing replaced unasked."""
    import torch
    from safetensors.torch import load_file

    from smallem_cli.interop.hf import export_hf, export_mimo
    from smallem_cli.model import checkpoint

    out = tmp_path / "mimo"
    export_mimo(family.target, family.mtp, out, family.tokenizer)
    export_hf(family.target, tmp_path / "llama", family.tokenizer)
    got, llama = load_file(out / "model.safetensors"), load_file(tmp_path / "llama" / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["MiMoForCausalLM"] and cfg["model_type"] == "qwen2"
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["tie_word_embeddings"] is False
    for k, v in llama.items():  # the Llama export's tensors, as they are
        assert torch.equal(got[k].float(), v.float()), k
    target, _ = checkpoint.load_model(family.target)
    mtp, _ = checkpoint.load_mtp(family.mtp, target)
    m = "model.mtp_layers.0"
    assert torch.equal(got["lm_head.weight"].float(), target.embed_tokens.weight.float())
    assert torch.equal(got[f"{m}.final_layernorm.weight"].float(), target.norm.weight.float())
    assert torch.equal(got[f"{m}.input_proj.weight"].float(), mtp.eh_proj.weight.float())
    assert torch.equal(got[f"{m}.hidden_layernorm.weight"].float(), mtp.hnorm.weight.float())
    assert torch.equal(got[f"{m}.token_layernorm.weight"].float(), mtp.enorm.weight.float())
    assert torch.equal(got[f"{m}.self_attn.q_proj.weight"].float(), mtp.block.q_proj.weight.float())
    assert torch.equal(got[f"{m}.mlp.down_proj.weight"].float(), mtp.block.down_proj.weight.float())
    biases = [k for k in got if k.endswith("_proj.bias")]
    assert len(biases) == 3 * (target.cfg.n_layers + 1) and all(not got[k].any() for k in biases)
    n_mtp = len(mtp.state_dict()) + 1 + 3  # its parameters, the final norm, three biases
    assert len(got) == len(llama) + 1 + 3 * target.cfg.n_layers + n_mtp
    res = CliRunner().invoke(app, ["export", str(family.target), str(out), "--format", "mimo"])
    assert res.exit_code == 2 and "--overwrite" in res.stderr and res.stderr.count("\n") == 1
    res = CliRunner().invoke(app, ["export", str(family.mtp), str(tmp_path / "x"), "--format", "mimo"])
    assert res.exit_code == 2 and "MTP module" in res.stderr and not (tmp_path / "x").exists()
    res = CliRunner().invoke(app, ["export", str(family.target), str(tmp_path / "y"), "--mtp", str(family.mtp)])
    assert res.exit_code == 2 and "--mtp applies to --format mimo" in res.stderr
    res = CliRunner().invoke(app, ["export", str(family.target), str(out), "--format", "mimo", "--overwrite"])
    assert res.exit_code == 0, res.stderr


def test_mimo_target_is_the_llama_target(family: Family, tmp_path: Path) -> None:
    """Qwen2 with zero q/k/v biases computes what Llama does: transformers' Qwen2ForCausalLM on the
    MiMo folder gives the logits of its LlamaForCausalLM on the plain export."""
    transformers = pytest.importorskip("transformers")
    import torch

    from smallem_cli.interop.hf import export_hf, export_mimo

    export_mimo(family.target, family.mtp, tmp_path / "mimo", family.tokenizer)
    export_hf(family.target, tmp_path / "llama", family.tokenizer)
    qwen = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "mimo", dtype=torch.float32).eval()
    llama = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.float32).eval()
    ids = torch.tensor([[3, 17, 42, 5, 9, 1, 33, 60, 7, 7, 2]])
    with torch.no_grad():
        torch.testing.assert_close(qwen(ids).logits, llama(ids).logits, rtol=1e-5, atol=1e-5)


# --- vllm serve's handling, on a stand-in server ------------------------------------------------------
FAKE_SERVER = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
if "--fail" in " ".join(args):
    print("INFO starting"); print("RuntimeError: no CPU backend here"); sys.exit(3)
port = int(args[args.index("--port") + 1])
served = []
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def reply(self, body, kind="application/json"):
        data = body.encode(); self.send_response(200); self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        n = len(served)
        text = 'vllm:spec_decode_num_drafts_total{engine="0"} %d.0\n' % (10 * n)
        text += 'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} %d.0\n' % (4 * n)
        self.reply(text if self.path == "/metrics" else "", "text/plain")
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        served.append(req)
        ids = [t + 1 for t in req["prompt"]][: req["max_tokens"]]
        self.reply(json.dumps({"choices": [{"text": "", "token_ids": ids if req.get("return_token_ids") else None}]}))
HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_serving_answers_and_stops_by_pid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`vllm serve`'s driving: started in a group of its own, polled until /health answers, the
    prompts sent as token ids, its counters read, stopped by its PID; a failed start: its error line."""
    runner = tmp_path / "fake_run.py"
    runner.write_text(FAKE_SERVER)
    monkeypatch.setattr(V, "RUNNER", runner)
    pids: list[int] = []
    env = dict(os.environ)
    with V.serving(Path(sys.executable), tmp_path / "t", {"model": "d"}, env, tmp_path / "s.log", pids.append) as url:
        assert url.startswith("http://127.0.0.1:")
        got, counters = V.serve_tokens(url, "t", [[1, 2, 3], [7, 8]], 2)
    assert got == [[2, 3], [8, 9]]
    assert counters == {"drafts": 20, "draft_tokens": 0, "accepted": 0, "per_pos": [8]}
    assert len(pids) == 1
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)
    with (
        pytest.raises(V.VllmError, match=r"stopped \(exit 3\): RuntimeError: no CPU backend here"),
        V.serving(Path(sys.executable), tmp_path / "t", {"model": "--fail"}, env, tmp_path / "f.log"),
    ):
        pass


def test_serving_stops_the_server_on_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = tmp_path / "fake_run.py"
    runner.write_text(FAKE_SERVER)
    monkeypatch.setattr(V, "RUNNER", runner)
    pids: list[int] = []
    with (
        pytest.raises(KeyboardInterrupt),
        V.serving(Path(sys.executable), tmp_path / "t", None, dict(os.environ), tmp_path / "s.log", pids.append),
    ):
        raise KeyboardInterrupt
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)


def test_check_refuses_bad_input_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(V.PYTHON_ENV, sys.executable)
    cases = [
        (["--hf", str(tmp_path)], "no exported target"),
        (["--hf", str(tmp_path), "--nonsense"], "unrecognized arguments"),
        ([], "--hf"),
    ]
    for argv, says in cases:
        with pytest.raises(SystemExit) as stop:
            sys.exit(vllm_check.main(argv))
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1 and says in err, (argv, err)
    monkeypatch.setenv(V.PYTHON_ENV, str(tmp_path / "none"))
    assert vllm_check.main(["--hf", str(tmp_path)]) == 2
    assert "not an executable" in capsys.readouterr().err
