"""Peers side by side, timed in the same process as our rows, on the same weights (exported), prompts and token
counts: `hf`, transformers' generate() and assisted generation; `llamacpp`, llama.cpp on the target as GGUF in
f32 and f16, what a CPU user would pick instead; `vllm`, vLLM's CPU build, in its own venv (`interop.vllm_peer`)."""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Group
from rich.table import Table

from ..backends.engines import Log, fastest
from ..defaults import default_k
from ..engine.family import NONE, LoadedProposer, Target
from ..engine.generate import generate
from ..interop import vllm_peer as vllm  # (the module: `vllm_peer` below is this one's rows)
from ..interop.hf import export_hf
from ..stats import Stats
from .batch import alone_at_batch
from .run import Gen, Plan, Row, best_greedy, interleaved, our_row, pass_costs, right_table, round_robin

LLAMACPP_PASSES = (2, 3, 5, 9)  # T of the passes timed against a one-token pass (k+1 of k = 1, 2, 4, 8)
COST_CONTEXT = 132  # positions in the cache when a pass is timed, as `run.pass_costs`'s


def run_peer(peer: str, target: Target, ckpt_dir: Path, prompts: list[list[int]], rows: list[Row], plan: Plan,
             log: Log) -> list[dict]:  # fmt: skip
    max_new = plan.max_new
    if peer == "llamacpp":  # with our fastest greedy speculative row, timed in turn
        return llamacpp_peer(target, prompts, plan, best_greedy(rows, plan))
    if peer == "vllm":
        at_batch = partial(alone_at_batch, target, prompts, max_new, log=log)  # vLLM's batch beside our batch engine's
        return vllm_peer(target, ckpt_dir, prompts, max_new, rows, torch.get_num_threads(), log, at_batch=at_batch)
    return hf_peer(target, ckpt_dir, prompts, max_new, rows)


def peer_table(peer_rows: list[dict]) -> Table | Group:
    """The peers' rows; with llama.cpp's, also the pass costs over T tokens, in one-token passes."""
    steps = any("tokens_per_step" in r for r in peer_rows)  # vLLM's: tokens per target step, beside ours
    spec = any("spec" in r for r in peer_rows)  # llama.cpp's: our speculative decoding, timed in turn
    cols = ["peer", "peer tok/s", "ours tok/s", "ours / peer", "identical to ours"]
    cols += ["tokens/step peer | ours"] if steps else []
    cols += ["ours, speculative", "tok/s", "/ peer", "identical"] if spec else []
    t = right_table("side by side with a peer (greedy, same weights and prompts)", cols)
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
    title = "pass over T tokens, in one-token passes of the same engine (context 132)"
    c = right_table(title, ("engine", "one-token pass ms", *(f"T={T}" for T in passes)))
    for r in costs:
        c.add_row(r["peer"], f"{r['one_pass_ms']:.3f}", *(f"{r['pass_cost'][str(T)]:.2f}" for T in passes))
    if (r := costs[-1]).get("ours_pass_cost"):  # ours: the same reading in every row
        ours = [f"{r['ours_pass_cost'][str(T)]:.2f}" for T in passes]
        c.add_row(f"ours ({r['ours_engine']})", f"{r['ours_one_pass_ms']:.3f}", *ours)
    return Group(t, c)


def _wall(gen: Callable[[list[int], int], list[int]]) -> Gen:
    """`gen` (prompt, n) -> its n tokens, timed by the wall clock around the whole call."""

    def timed(i: int, p: list[int], n: int) -> tuple[list[int], Stats]:
        t0 = time.perf_counter()
        out = gen(p, n)
        return out, Stats("", 0, new_tokens=len(out), elapsed_s=time.perf_counter() - t0)

    return timed


def hf_peer(target: Target, ckpt_dir: Path, prompts: list[list[int]], max_new: int, rows: list[Row]) -> list[dict]:
    """transformers' generate() and assisted generation (draft-2l), greedy, beside our rows (`our_row`)."""
    import transformers

    dev = target.model.device
    ref = [generate(target.model, NONE, p, max_new, 0)[0] for p in prompts]
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for name in ("target", "draft-2l"):
            export_hf(ckpt_dir / f"{name}.safetensors", Path(tmp) / name, target.tokenizer)
            m = transformers.AutoModelForCausalLM.from_pretrained(Path(tmp) / name, dtype=torch.float32).eval()
            m.generation_config.update(eos_token_id=None, pad_token_id=0)  # no eos: the full token count, as ours
            models[name] = m.to(dev)

        def hf(p: list[int], n: int, **kwargs: Any) -> list[int]:  # greedy; the assistant, if any, in kwargs
            res = models["target"].generate(torch.tensor([p], device=dev), do_sample=False, max_new_tokens=n, **kwargs)
            return res[0, len(p) :].tolist()  # (waits for the device)

        assisted = partial(hf, assistant_model=models["draft-2l"])
        gens = {"transformers generate()": _wall(hf), "transformers assisted (draft-2l)": _wall(assisted)}
        with torch.inference_mode():
            runs = round_robin(gens, prompts, max_new, 1)
    k = default_k("draft-2l", greedy=True)  # our draft-2l row beside assisted generation: its default greedy k
    out = []
    for (label, [(st, outs)]), (name, kk) in zip(runs.items(), [("none", 0), ("draft-2l", k)], strict=True):
        row, same = our_row(rows, name, kk), vllm.agreement(ref, outs)[0]
        ours = row.tokens_per_s if row else math.nan
        out.append(vllm.peer_row(label, st.tokens_per_s, ours, f"{same}/{len(prompts)}"))
    return out


class LlamaCpp:
    """One GGUF file under llama.cpp's C API (`llama_decode` on a batch): greedy generation and passes over T
    tokens. Its K/V cache is float32, as ours (llama.cpp's default: float16), so that only the weights differ."""

    def __init__(self, path: Path, n_ctx: int, threads: int, n_vocab: int) -> None:
        import llama_cpp as lib

        self.lib, f32 = lib, lib.GGML_TYPE_F32
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
        if (rc := self.lib.llama_decode(self.ctx, b)) != 0:
            raise RuntimeError(f"llama_decode failed with code {rc}")

    def generate(self, prompt: list[int], n: int) -> list[int]:
        self.clear()
        out: list[int] = []
        while len(out) < n:
            fed = out[-1:] or prompt
            self.decode(fed, len(prompt) + len(out) - len(fed))
            logits = self.lib.llama_get_logits_ith(self.ctx, -1)
            out.append(int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax()))
        return out

    def pass_seconds(self, prompt: list[int], passes: list[int], reps: int = 60) -> dict[int, float]:
        """Median seconds of a pass over T tokens (all T's logits) at COST_CONTEXT, timed as ours (`interleaved`)."""
        ids = (prompt * (COST_CONTEXT // len(prompt) + 1))[:COST_CONTEXT]
        self.clear()
        self.decode(ids, 0)
        return interleaved({T: partial(self._pass, ids[:T]) for T in passes}, reps)

    def _pass(self, tokens: list[int]) -> None:
        self.decode(tokens, COST_CONTEXT, all_logits=True)
        self.lib.llama_get_logits_ith(self.ctx, -1)
        self.drop(COST_CONTEXT)  # the cache as it was (timed with the pass: a trim of T cells, next to nothing)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.llm.close()


def llamacpp_peer(target: Target, prompts: list[list[int]], plan: Plan,
                  spec: tuple[str, LoadedProposer, int] | None) -> list[dict]:  # fmt: skip
    """llama.cpp on the target as GGUF in f32 and f16 (a GGUF target's own file first), greedy, timed in turn
    with our target alone and `spec` (name, proposer, k) on the plan's fastest engine; pass costs of both."""
    from ..interop.gguf import restore_gguf, write_gguf

    model, max_new, threads = target.model, plan.max_new, torch.get_num_threads()
    engine = fastest(plan.engines)
    backend = plan.backends[engine]  # prepared (`prepare_engines`)

    ref = [generate(model, NONE, p, max_new, 0)[0] for p in prompts]  # the reference: the eager target alone
    gens: dict[str, Gen] = {"ours": lambda i, p, n: generate(model, NONE, p, n, 0, backend=backend)}
    with tempfile.TemporaryDirectory() as tmp:
        peers: dict[str, LlamaCpp] = {}
        try:
            files = {"/".join(target.gguf): target.path} if target.gguf else {}
            for dtype in ("f32", "f16"):  # a GGUF target's values stored anew, its metadata kept
                files[dtype] = Path(tmp) / f"target-{dtype}.gguf"
                if target.gguf:
                    restore_gguf(target.path, model, files[dtype], dtype)
                else:
                    assert target.tokenizer is not None  # a smallem checkpoint or an HF folder: beside it
                    write_gguf(model, files[dtype], target.tokenizer, dtype, target.path.stem)
            for dtype, path in files.items():
                peers[dtype] = LlamaCpp(path, min(1024, model.cfg.max_seq_len), threads, model.cfg.vocab_size)
                gens[dtype] = _wall(peers[dtype].generate)
            if spec is not None:  # timed as the peers are: the wall clock around the whole call
                _, proposer, k = spec
                gens["spec"] = _wall(lambda p, n: generate(model, proposer, p, n, k, backend=backend)[0])
            runs = round_robin(gens, prompts, max_new, plan.repeats)
            costs = {d: p.pass_seconds(prompts[0], [1, *LLAMACPP_PASSES]) for d, p in peers.items()}
        finally:
            for p in peers.values():
                p.close()
    unit, ours = pass_costs(model, list(LLAMACPP_PASSES), prompts[0], backend, COST_CONTEXT)
    tps = {name: statistics.median(st.tokens_per_s for st, _ in r) for name, r in runs.items()}
    same = {name: vllm.agreement(ref, r[0][1]) for name, r in runs.items()}  # in the first run
    n = len(prompts)
    out = []
    for dtype, secs in costs.items():
        row = vllm.peer_row(
            f"llama.cpp {dtype} ({threads} threads)", tps[dtype], tps["ours"], f"{same[dtype][0]}/{n}",
            tokens_identical=f"{same[dtype][1]}/{n * max_new}", ours_engine=engine,
            ours_identical=f"{same['ours'][0]}/{n}", one_pass_ms=secs[1] * 1e3,
            pass_cost={str(T): secs[T] / secs[1] for T in LLAMACPP_PASSES}, ours_one_pass_ms=unit * 1e3,
            ours_pass_cost={str(T): ours[T] for T in LLAMACPP_PASSES}, threads=threads,
        )  # fmt: skip
        if spec is not None:
            row.update(spec=f"{spec[0]} k={spec[2]}", spec_tokens_per_s=tps["spec"],
                       spec_over_peer=tps["spec"] / tps[dtype], spec_identical=f"{same['spec'][0]}/{n}")  # fmt: skip
        out.append(row)
    return out


@dataclass
class Ours:  # what a row of `bench --peer vllm` sets beside vLLM's (nan and None: our row was not run)
    tokens_per_s: float = float("nan")
    tokens_per_step: float = float("nan")
    engine: str | None = None
    identical: str | None = None  # greedy identity with our eager target alone
    batch: int | None = None  # 1: one request at a time


def vllm_peer(target: Target, ckpt_dir: Path, prompts: list[list[int]], max_new: int, rows: list[Row], threads: int,
              log: Log = lambda m: None, *,
              at_batch: Callable[[str], tuple[float, list[list[int]]]]) -> list[dict[str, Any]]:  # fmt: skip
    """vLLM offline on the same weights exported, greedy: the target alone and with draft-2l at our greedy k,
    one request at a time beside our `rows`, and as one batch beside `at_batch(engine)`'s (tokens/s, answers)."""
    python = vllm.find_python()
    env = vllm.vllm_env(python, threads)
    k, n = default_k("draft-2l", greedy=True), len(prompts)
    ref = [generate(target.model, NONE, p, max_new, 0)[0] for p in prompts]
    engine = fastest(r.engine for r in rows)  # the engine our one-at-a-time rows are read from
    log(f"ours: the target alone through the batch engine ({engine}), a batch of {n}")
    batch_tps, batch_out = at_batch(engine)
    batch = Ours(batch_tps, 1.0, engine, f"{vllm.agreement(ref, batch_out)[0]}/{n}", n)
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="smallem-vllm-") as tmp:
        for name in ("target", "draft-2l"):
            export_hf(ckpt_dir / f"{name}.safetensors", Path(tmp) / name, target.tokenizer)
        for label, draft, kk in (("target alone", None, 0), (f"+ draft-2l (k={k})", "draft-2l", k)):
            log(f"vLLM: {label}, one request at a time and a batch of {n}")
            spec = {"model": str(Path(tmp) / draft), "num_speculative_tokens": kk} if draft else None
            job = {"target": str(Path(tmp) / "target"), "spec": spec, "prompts": prompts, "max_new": max_new}
            res = vllm.run_offline(python, {**job, "single": True}, env)
            row = our_row(rows, draft or "none", kk)
            single = Ours(row.tokens_per_s, row.tokens_per_pass, row.engine, row.identical, 1) if row else Ours()
            for part, how in (("single", "one request at a time"), ("batch", f"batch of {n}")):
                got, ours = res[part], batch if part == "batch" and draft is None else single
                tps = sum(len(t) for t in got["tokens"]) / got["seconds"]
                acc, (whole, each, total) = vllm.acceptance(got["spec"]), vllm.agreement(ref, got["tokens"])
                out.append(vllm.peer_row(
                    f"vLLM {label}, {how}", tps, ours.tokens_per_s, f"{whole}/{n}", tokens_identical=f"{each}/{total}",
                    tokens_per_step=acc.tokens_per_step if acc else 1.0, ours_tokens_per_step=ours.tokens_per_step,
                    ours_engine=ours.engine, ours_batch=ours.batch, ours_identical=ours.identical,
                    acceptance=acc.rate if acc else None, accepted_at=acc.per_pos if acc else None, threads=threads,
                    version=res["version"], load_s=res["load_s"],
                ))  # fmt: skip
    return out
