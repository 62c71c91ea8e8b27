"""Peers side by side, timed in the same process as our rows, on the same weights (exported),
prompts and token counts:
- `hf`: transformers' generate() and assisted generation (the `hf` extra: transformers);
- `llamacpp`: llama.cpp on the target exported as GGUF, f32 and f16 weights, the engine a CPU
  user would pick instead (the `llamacpp` extra: llama-cpp-python and gguf);
- `vllm`: vLLM's CPU build, one request at a time and a batch, the target alone and with
  draft-2l, run by the python of its own venv (`.venv-vllm`; see vllm_peer.py).
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Group
from rich.table import Table

from ..backends.engines import Backend, engine_mode, fastest
from ..defaults import default_k
from ..engine.family import NONE, Proposer, Target
from ..engine.generate import generate
from .costs import forward_costs, sync
from .run import Row, our_row


def hf_peer(target: Target, ckpt_dir: Path, prompts: list[list[int]], max_new: int, rows: list[Row]) -> list[dict]:
    """transformers' generate() (target alone) and assisted generation (draft-2l), same
    weights, prompts and token counts, timed here; greedy outputs checked against ours, and
    their speed compared with our rows of the same run (the fastest engine's)."""
    try:
        import transformers
    except ImportError:
        raise ImportError("--peer hf needs transformers: pip install 'smallem[hf]'") from None
    from ..interop.hf import export_hf

    def ours(name: str, k: int) -> float:
        """Our greedy row's tokens/s (`our_row`: the fastest engine's)."""
        row = our_row(rows, name, k)
        return row.tokens_per_s if row else float("nan")

    k = default_k("draft-2l", greedy=True)  # our draft-2l row beside assisted generation: its default greedy k
    out: list[dict] = []
    dev = target.model.embed_tokens.weight.device
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for name in ("target", "draft-2l"):
            export_hf(ckpt_dir / f"{name}.safetensors", Path(tmp) / name, target.tokenizer)
            m = transformers.AutoModelForCausalLM.from_pretrained(Path(tmp) / name, dtype=torch.float32).eval()
            m.generation_config.eos_token_id = None  # run the full token count, as we do
            m.generation_config.pad_token_id = 0
            models[name] = m.to(dev)
        ref = {i: generate(target.model, NONE, p, max_new, 0)[0] for i, p in enumerate(prompts)}
        for label, kwargs, ours_tps in (
            ("transformers generate()", {}, ours("none", 0)),
            ("transformers assisted (draft-2l)", {"assistant_model": models["draft-2l"]}, ours("draft-2l", k)),
        ):
            tokens, secs, same = 0, 0.0, 0
            with torch.inference_mode():
                warm = torch.tensor([prompts[0]], device=dev)
                models["target"].generate(warm, do_sample=False, max_new_tokens=8, **kwargs)
                for i, p in enumerate(prompts):
                    ids = torch.tensor([p], device=dev)
                    t0 = time.perf_counter()
                    res = models["target"].generate(ids, do_sample=False, max_new_tokens=max_new, **kwargs)
                    sync()
                    secs += time.perf_counter() - t0
                    new = res[0, len(p) :].tolist()
                    tokens += len(new)
                    same += new == ref[i]
            out.append(peer_row(label, tokens / secs, ours_tps, f"{same}/{len(prompts)}"))
    return out


def peer_row(peer: str, tps: float, ours_tps: float, identical: str, **more: Any) -> dict[str, Any]:
    """A peer's row: its tokens/s beside ours (nan: our row was not run), then `more`."""
    return {"peer": peer, "tokens_per_s": tps, "ours_tokens_per_s": ours_tps, "ours_over_peer": ours_tps / tps,
            "identical": identical, **more}  # fmt: skip


def peer_table(peer_rows: list[dict]) -> Table | Group:
    """The peers' rows; with llama.cpp's, also the pass costs over T tokens, in one-token passes."""
    t = Table(title="side by side with a peer (greedy, same weights and prompts)")
    steps = any("tokens_per_step" in r for r in peer_rows)  # vLLM's: tokens per target step, beside ours
    spec = any("spec" in r for r in peer_rows)  # llama.cpp's: our speculative decoding, timed in turn
    for col in ("peer", "peer tok/s", "ours tok/s", "ours / peer", "identical to ours"):
        t.add_column(col, justify="right")
    if steps:
        t.add_column("tokens/step peer | ours", justify="right")
    if spec:
        for col in ("ours, speculative", "tok/s", "/ peer", "identical"):
            t.add_column(col, justify="right")
    for r in peer_rows:
        ran = not math.isnan(r["ours_tokens_per_s"])  # our row of that proposer was in the plan
        batch = f" (batch {n})" if (n := r.get("ours_batch") or 1) > 1 else ""
        cells = [r["peer"], f"{r['tokens_per_s']:.1f}", f"{r['ours_tokens_per_s']:.1f}{batch}" if ran else "not run"]
        cells += [f"×{r['ours_over_peer']:.2f}" if ran else "–", r["identical"]]
        if steps:
            cells.append(f"{r['tokens_per_step']:.2f} | {r['ours_tokens_per_step']:.2f}")
        if "spec" in r:  # (the last columns: a row without them leaves them empty)
            cells += [r["spec"], f"{r['spec_tokens_per_s']:.1f}", f"×{r['spec_over_peer']:.2f}", r["spec_identical"]]
        t.add_row(*cells)
    costs = [r for r in peer_rows if r.get("one_pass_ms")]
    if not costs:
        return t
    passes = sorted({int(T) for r in costs for T in r["pass_cost"]})
    c = Table(title="pass over T tokens, in one-token passes of the same engine (context 132)")
    for col in ("engine", "one-token pass ms", *(f"T={T}" for T in passes)):
        c.add_column(col, justify="right")
    for r in costs:
        c.add_row(r["peer"], f"{r['one_pass_ms']:.3f}", *(f"{r['pass_cost'][str(T)]:.2f}" for T in passes))
    r = costs[-1]  # ours: the same reading in every row
    if r.get("ours_pass_cost"):
        ours = [f"{r['ours_pass_cost'][str(T)]:.2f}" for T in passes]
        c.add_row(f"ours ({r['ours_engine']})", f"{r['ours_one_pass_ms']:.3f}", *ours)
    return Group(t, c)


# --- llama.cpp -------------------------------------------------------------------------------
Spec = tuple[str, Proposer, int]  # our speculative row beside llama.cpp: its name, the proposer, k
LLAMACPP_PASSES = (2, 3, 5, 9)  # T of the passes timed against a one-token pass (k+1 of k = 1, 2, 4, 8)
COST_CONTEXT = 132  # positions in the cache when a pass is timed, as bench's forward_costs


def run_peer(
    peer: str,
    target: Target,
    ckpt_dir: Path,
    prompts: list[list[int]],
    max_new: int,
    rows: list[Row],
    engines: tuple[str, ...] = ("eager",),
    repeats: int = 1,
    log: Callable[[str], None] | None = None,
    spec: Spec | None = None,
) -> list[dict]:
    """`bench --peer NAME`: the named peer's rows (see `hf_peer`, `llamacpp_peer`, `vllm_peer.bench_peer`)."""
    if peer == "llamacpp":
        return llamacpp_peer(target, prompts, max_new, engines, repeats, log, spec)
    if peer == "vllm":
        from ..interop.vllm_peer import bench_peer
        from .batch import alone_at_batch

        def at_batch(engine: str) -> tuple[float, list[list[int]]]:  # vLLM's batch against our batch engine's
            return alone_at_batch(target, target.model.embed_tokens.weight.device, prompts, max_new, engine, log)

        return bench_peer(target, ckpt_dir, prompts, max_new, rows, torch.get_num_threads(), log, at_batch=at_batch)
    return hf_peer(target, ckpt_dir, prompts, max_new, rows)


def _llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError:
        raise ImportError("--peer llamacpp needs llama-cpp-python: pip install 'smallem[llamacpp]'") from None
    return llama_cpp


class LlamaCpp:
    """One GGUF file under llama.cpp, driven through its C API (`llama_decode` on a batch): greedy
    generation by argmax of the logits, and passes over T tokens for their cost. The K/V cache is
    float32 (llama.cpp's default is float16): it then holds what ours holds, and a greedy run depends
    on the weights' dtype alone."""

    def __init__(self, path: Path, n_ctx: int, threads: int, n_vocab: int) -> None:
        lib = self.lib = _llama_cpp()
        f32 = lib.GGML_TYPE_F32
        self.llm = lib.Llama(
            model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,
            n_threads_batch=threads, n_gpu_layers=0, type_k=f32, type_v=f32, verbose=False,
        )  # fmt: skip
        self.ctx, self.n_vocab = self.llm.ctx, n_vocab
        if hasattr(lib, "llama_get_memory"):  # llama.cpp since mid-2025
            mem = lib.llama_get_memory(self.ctx)
            self.clear = lambda: lib.llama_memory_clear(mem, True)
            self.drop = lambda p0: lib.llama_memory_seq_rm(mem, 0, p0, -1)
        else:  # earlier 0.3 releases
            self.clear = lambda: lib.llama_kv_self_clear(self.ctx)
            self.drop = lambda p0: lib.llama_kv_self_seq_rm(self.ctx, 0, p0, -1)
        self.batch = lib.llama_batch_init(n_ctx, 0, 1)
        for i in range(n_ctx):  # every slot: one sequence, number 0
            self.batch.n_seq_id[i] = 1
            self.batch.seq_id[i][0] = 0

    def decode(self, tokens: list[int], start: int, all_logits: bool = False) -> None:
        """Tokens at positions start.. of sequence 0; logits of the last one (of all, with all_logits)."""
        b, n = self.batch, len(tokens)
        b.n_tokens = n
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.logits[i] = t, start + i, all_logits or i == n - 1
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc}")

    def argmax(self) -> int:
        logits = self.lib.llama_get_logits_ith(self.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def generate(self, prompt: list[int], n: int) -> list[int]:
        """n greedy tokens after the prompt, from an empty cache."""
        self.clear()
        self.decode(prompt, 0)
        out = [self.argmax()]
        while len(out) < n:
            self.decode(out[-1:], len(prompt) + len(out) - 1)
            out.append(self.argmax())
        return out

    def pass_seconds(self, prompt: list[int], passes: list[int], reps: int = 60) -> dict[int, float]:
        """Median seconds of a pass over T tokens (logits of all T, as a verify pass needs), at
        COST_CONTEXT positions of context, round-robin over the T values after two warm-up rounds."""
        ids = (prompt * (COST_CONTEXT // len(prompt) + 1))[:COST_CONTEXT]
        self.clear()
        self.decode(ids, 0)
        times: dict[int, list[float]] = {T: [] for T in passes}
        for r in range(reps + 2):
            for T in passes:
                t0 = time.perf_counter()
                self.decode(ids[:T], COST_CONTEXT, all_logits=True)
                self.lib.llama_get_logits_ith(self.ctx, -1)
                dt = time.perf_counter() - t0
                self.drop(COST_CONTEXT)
                if r >= 2:
                    times[T].append(dt)
        return {T: statistics.median(ts) for T, ts in times.items()}

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.llm.close()


def llamacpp_peer(
    target: Target,
    prompts: list[list[int]],
    max_new: int,
    engines: tuple[str, ...] = ("eager",),
    repeats: int = 1,
    log: Callable[[str], None] | None = None,
    spec: Spec | None = None,
) -> list[dict]:
    """llama.cpp on the target's weights (exported as GGUF, f32 and f16), greedy, on torch's thread
    count; timed prompt by prompt in alternation with our target alone on the fastest of `engines`
    and, with `spec`, our speculative decoding with that proposer, `repeats` times (median of the
    runs' tokens/s). Its tokens are checked against our eager target alone's; the pass costs over T
    tokens (LLAMACPP_PASSES) are read for both engines."""
    from ..interop.gguf import write_gguf

    _llama_cpp()
    model = target.model
    threads = torch.get_num_threads()
    engine = fastest(engines)
    n_ctx = min(1024, model.cfg.max_seq_len)
    passes = [1, *LLAMACPP_PASSES]
    backend = Backend(engine_mode(engine, model.embed_tokens.weight.device))
    # our passes (and the proposer's), built (or loaded) before anything is timed
    backend.prepare(model, spec[1].models if spec else [], log, spec[1].models if spec and spec[1].int8 else [])

    def ours(p: list[int]) -> tuple[list[int], float]:
        out, st = generate(model, NONE, p, max_new, 0, backend=backend)
        return out, st.elapsed_s

    def ours_spec(p: list[int], n: int) -> list[int]:
        assert spec is not None
        return generate(model, spec[1], p, n, spec[2], backend=backend)[0]

    ref = [generate(model, NONE, p, max_new, 0)[0] for p in prompts]  # the reference: the eager target alone
    with tempfile.TemporaryDirectory() as tmp:
        peers: dict[str, LlamaCpp] = {}
        try:
            for dtype in ("f32", "f16"):
                path = Path(tmp) / f"target-{dtype}.gguf"
                write_gguf(model, path, target.tokenizer, dtype, target.path.stem)
                peers[dtype] = LlamaCpp(path, n_ctx, threads, model.cfg.vocab_size)
            gens = {d: p.generate for d, p in peers.items()}
            if spec is not None:  # timed as the peers are: the wall clock around the whole call
                gens["spec"] = ours_spec
            runs = _alternate(ours, gens, prompts, max_new, ref, repeats)
            costs = {d: p.pass_seconds(prompts[0], passes) for d, p in peers.items()}
        finally:
            for p in peers.values():
                p.close()
    got = forward_costs(model, {}, [T - 1 for T in LLAMACPP_PASSES], prompts[0], backend, COST_CONTEXT)
    ours_tps, n = statistics.median(runs["ours"][0]), len(prompts)
    out = []
    for dtype, secs in costs.items():
        tps = statistics.median(runs[dtype][0])
        row = peer_row(
            f"llama.cpp {dtype} ({threads} threads)",
            tps,
            ours_tps,
            f"{runs[dtype][1]}/{n}",
            tokens_identical=f"{runs[dtype][2]}/{n * max_new}",
            ours_engine=engine,
            ours_identical=f"{runs['ours'][1]}/{n}",
            one_pass_ms=secs[1] * 1e3,
            pass_cost={str(T): secs[T] / secs[1] for T in LLAMACPP_PASSES},
            ours_one_pass_ms=got.round_s * 1e3,
            ours_pass_cost={str(T): got.v[T - 1] for T in LLAMACPP_PASSES},
            threads=threads,
        )
        if spec is not None:
            spec_tps = statistics.median(runs["spec"][0])
            row.update(spec=f"{spec[0]} k={spec[2]}", spec_tokens_per_s=spec_tps, spec_over_peer=spec_tps / tps,
                       spec_identical=f"{runs['spec'][1]}/{n}")  # fmt: skip
        out.append(row)
    return out


def _alternate(
    ours: Callable[[list[int]], tuple[list[int], float]],
    peers: dict[str, Callable[[list[int], int], list[int]]],
    prompts: list[list[int]],
    max_new: int,
    ref: list[list[int]],
    repeats: int,
) -> dict[str, tuple[list[float], int, int]]:
    """Ours and each peer, prompt by prompt in turn, `repeats` times (after a warm-up):
    name -> (tokens/s of each run, prompts whose tokens equal ref's, tokens equal to ref's at
    the same place, in the first run)."""
    warm = prompts[0][:16]
    ours(warm)
    for gen in peers.values():
        gen(warm, 16)
    names = ["ours", *peers]
    tps: dict[str, list[float]] = {n: [] for n in names}
    same: dict[str, tuple[int, int]] = {}
    for rep in range(repeats):
        secs = dict.fromkeys(names, 0.0)
        outs: dict[str, list[list[int]]] = {n: [] for n in names}
        for p in prompts:
            out, s = ours(p)
            secs["ours"] += s
            outs["ours"].append(out)
            for name, gen in peers.items():
                t0 = time.perf_counter()
                outs[name].append(gen(p, max_new))
                secs[name] += time.perf_counter() - t0
        for n in names:
            tps[n].append(len(prompts) * max_new / secs[n])
            if rep == 0:
                whole = sum(a == b for a, b in zip(outs[n], ref, strict=True))
                each = sum(x == y for a, b in zip(outs[n], ref, strict=True) for x, y in zip(a, b, strict=True))
                same[n] = (whole, each)
    return {n: (tps[n], *same[n]) for n in names}
