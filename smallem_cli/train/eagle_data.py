"""An EAGLE head's data: the target's own answers to composed instructions, written by the batch engine, with the
target's states at every position saved as they are computed (float16, no second pass).

The states are the outputs of the head's taps and of the last layer (`record_taps`): the head reads the first, its
soft targets are the target's distribution from the last. Shards of `SHARD` answers each are written whole
(`shard-NNNNN.safetensors`: tokens, documents, which tokens are answers, states), so a run stopped anywhere resumes
at the next shard; a larger budget appends shards. Instruction i of the composed grid is answered greedily on its
first pass through the grid, sampled at T = 1 (seed + i) on later ones."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from torch import Tensor

from .. import atomic
from ..engine.proposers import NoProposer
from ..engine.request import Request
from ..engine.scheduler import Engine
from ..engine.sequence import Seq
from ..model.checkpoint import write_safetensors
from ..spec.sampling import Sampling
from .continuations import TASKS, TOPICS

SHARD = 64  # answers a shard


def record_taps(taps: tuple[int, ...], n_layers: int) -> tuple[int, ...]:
    return (*taps, n_layers - 1)


class Recorder(NoProposer):
    """The target alone, keeping the states its passes hand on for each request (by its index)."""

    def __init__(self, taps: tuple[int, ...]) -> None:
        self.taps = taps
        self.states: dict[int, list[Tensor]] = {}

    def start(self, seqs: list[Seq], fed: list[Tensor], hidden: list[Tensor]) -> None:
        for s, h in zip(seqs, hidden, strict=True):  # a preempted sequence starts over, from its whole text
            self.states[s.req.index] = [h.to(torch.float16)]

    def accept(self, seq: Seq, n: int, tokens: Tensor, hidden: Tensor) -> None:
        self.states[seq.req.index].append(hidden.to(torch.float16))


def instruction(i: int) -> str:
    grid = len(TASKS) * len(TOPICS)
    j = (i % grid) * 7919 % grid  # a fixed walk over the grid (7919 is prime to its size): topics mix early
    return TASKS[j // len(TOPICS)].format(TOPICS[j % len(TOPICS)])


@dataclass
class Shards:
    """Every shard of a folder, loaded: the token stream [n], its document of each token [n], whether a token is an
    answer's [n], and the states at each position [n, taps + 1, d] (a document's last: zeros, never read)."""

    tokens: Tensor
    docs: Tensor
    answer: Tensor
    states: Tensor
    meta: dict[str, str]


def shard_paths(folder: Path) -> list[Path]:
    return sorted(folder.glob("shard-*.safetensors"))


def read_shards(folder: Path) -> Shards:
    paths = shard_paths(folder)
    if not paths:
        raise FileNotFoundError(f"no shards in {folder}")
    parts: dict[str, list[Tensor]] = {"tokens": [], "docs": [], "answer": [], "states": []}
    meta: dict[str, str] = {}
    first_doc = 0
    for path in paths:
        with safe_open(str(path), "pt") as f:
            meta = meta or dict(f.metadata())
            for name in parts:
                t = f.get_tensor(name)
                parts[name].append(t + first_doc if name == "docs" else t)
        first_doc = int(parts["docs"][-1][-1]) + 1
    t = {k: torch.cat(v) for k, v in parts.items()}
    return Shards(t["tokens"].long(), t["docs"].long(), t["answer"].bool(), t["states"], meta)


def shard_tokens(folder: Path) -> int:
    total = 0
    for path in shard_paths(folder):
        with safe_open(str(path), "pt") as f:
            total += f.get_slice("tokens").get_shape()[0]
    return total


def generate(
    engine: Engine, recorder: Recorder, prompt_ids: Callable[[str], list[int]], folder: Path, budget: int,
    new_tokens: int, seed: int, meta: dict[str, str], say: Callable[[str], None],
) -> int:  # fmt: skip
    """Shards until the folder holds `budget` tokens (prompts and answers), on `engine` built with `recorder` for
    proposer -> the tokens it holds."""
    folder.mkdir(parents=True, exist_ok=True)
    grid = len(TASKS) * len(TOPICS)
    while (have := shard_tokens(folder)) < budget:
        n = len(shard_paths(folder))
        first = n * SHARD
        reqs = []
        for i in range(first, first + SHARD):
            sampling = Sampling() if i < grid else Sampling(1.0, seed=seed + i)
            reqs.append(Request(i, i, tuple(prompt_ids(instruction(i))), new_tokens, sampling))
        docs = []
        for a in engine.run(reqs):
            states = torch.cat(recorder.states.pop(a.request.index))
            ids = [*a.request.prompt, *a.tokens][: states.shape[0] + 1]  # the last token: never fed, no state
            docs.append((a.request.index, len(a.request.prompt), ids, states[: len(ids) - 1]))
        docs.sort()
        write_shard(folder / f"shard-{n:05d}.safetensors", docs, meta | {"first": str(first)})
        say(f"shard {n}: {SHARD} answers, {have + sum(len(d[2]) for d in docs):,} of {budget:,} tokens")
    return have


def write_shard(path: Path, docs: list[tuple[int, int, list[int], Tensor]], meta: dict[str, str]) -> None:
    tokens, doc, answer, states = [], [], [], []
    for j, (_, prompt, ids, s) in enumerate(docs):
        tokens.append(torch.tensor(ids, dtype=torch.int32))
        doc.append(torch.full((len(ids),), j, dtype=torch.int32))
        answer.append(torch.arange(len(ids)) >= prompt)
        states.append(torch.cat([s, s.new_zeros(1, *s.shape[1:])]))  # the last token's: none
    d = states[0].shape[-1] // len(json.loads(meta["taps"]))
    tensors = {
        "tokens": torch.cat(tokens), "docs": torch.cat(doc), "answer": torch.cat(answer).to(torch.uint8),
        "states": torch.cat(states).view(-1, len(json.loads(meta["taps"])), d).contiguous(),
    }  # fmt: skip
    atomic.replace_with(path, lambda tmp: write_safetensors(tensors, tmp, meta))


def frequent(shards: Shards, n: int, vocab_size: int, always: list[int]) -> Tensor:
    """The n tokens most frequent in the answers (`always` first: the end tokens), a head's vocabulary."""
    counts = np.bincount(shards.tokens[shards.answer].numpy(), minlength=vocab_size)
    first = [t for t in always if t < vocab_size]
    rest = [t for t in np.argsort(-counts, kind="stable").tolist() if t not in set(first)]
    return torch.tensor([*first, *rest][:n])
