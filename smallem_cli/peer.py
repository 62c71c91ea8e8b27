"""A peer side by side: transformers' generate() and assisted generation, timed in the
same process as our rows, on the same weights (exported), prompts and token counts.

Needs the `hf` extra (transformers).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from rich.table import Table

from .bench import Row, sync
from .defaults import default_k
from .family import Target
from .generate import generate
from .proposers import NoProposer


def hf_peer(target: Target, ckpt_dir: Path, prompts: list[list[int]], max_new: int, rows: list[Row]) -> list[dict]:
    """transformers' generate() (target alone) and assisted generation (draft-2l), same
    weights, prompts and token counts, timed here; greedy outputs checked against ours."""
    import tempfile

    try:
        import transformers
    except ImportError:
        raise ImportError("--peer hf needs transformers: pip install 'smallem[hf]'") from None
    from .hf import export_hf

    def ours(name: str, k: int) -> float:
        found = [r.tokens_per_s for r in rows if r.proposer == name and r.k == k and r.mode == "greedy"]
        return found[0] if found else float("nan")

    out: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for name in ("target", "draft-2l"):
            dirs[name] = Path(tmp) / name
            export_hf(ckpt_dir / f"{name}.safetensors", dirs[name], target.tokenizer)
        models = {}
        for name, d in dirs.items():
            m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
            m.generation_config.eos_token_id = None  # run the full token count, as we do
            m.generation_config.pad_token_id = 0
            models[name] = m
        dev = target.model.embed_tokens.weight.device
        for m in models.values():
            m.to(dev)
        ref = {i: generate(target.model, NoProposer(), p, max_new, 0)[0] for i, p in enumerate(prompts)}
        for label, kwargs, ours_tps in (
            ("transformers generate()", {}, ours("none", 0)),
            ("transformers assisted (draft-2l)", {"assistant_model": models["draft-2l"]}, None),
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
            hf_tps = tokens / secs
            if ours_tps is None:  # our draft-2l run at its default greedy k
                ours_tps = ours("draft-2l", default_k("draft-2l", greedy=True))
            out.append(
                {
                    "peer": label,
                    "tokens_per_s": hf_tps,
                    "ours_tokens_per_s": ours_tps,
                    "ours_over_peer": ours_tps / hf_tps,
                    "identical": f"{same}/{len(prompts)}",
                }
            )
    return out


def peer_table(peer_rows: list[dict]) -> Table:
    t = Table(title="side by side with transformers (greedy, same weights and prompts)")
    for col in ("peer", "peer tok/s", "ours tok/s", "ours / peer", "identical to ours"):
        t.add_column(col, justify="right")
    for r in peer_rows:
        t.add_row(
            r["peer"],
            f"{r['tokens_per_s']:.1f}",
            f"{r['ours_tokens_per_s']:.1f}",
            f"×{r['ours_over_peer']:.2f}",
            r["identical"],
        )
    return t
