"""The target's own text: its continuations of training contexts, a corpus to fit proposers on.

In a generation a proposer guesses from the prompt and the target's own text (the bench's prompts
too are held-out text continued by the target), not the corpus's. So contexts drawn from the
training split are continued by the target (greedy, or at T = 1 for one in `sampled_every`) on
the batch engine; distillation on them still matches the target's whole distribution at every
position (sequence-level distillation). A document is a context and its continuation; the
validation split is the source corpus's own, copied.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from ..engine.request import Finished, Request
from ..spec.sampling import Sampling


def contexts(ids: np.ndarray, n: int, length: int, seed: int, eot: int | None) -> list[tuple[int, ...]]:
    """n windows of `length` tokens of `ids` (a token file), each within one document (no end-of-text
    marker; None: the tokenizer has none, so the documents run together), drawn by a generator of
    `seed`: the same arguments give the same windows."""
    if len(ids) <= length:
        raise ValueError(f"the training split holds {len(ids)} tokens: too few for contexts of {length}")
    rng = np.random.default_rng(seed)
    out: list[tuple[int, ...]] = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 100 * n:  # documents shorter than the context almost everywhere
            raise ValueError(f"too few windows of {length} tokens within one document of the training split")
        s = int(rng.integers(0, len(ids) - length))
        w = ids[s : s + length]
        if eot is None or not (w == eot).any():
            out.append(tuple(int(t) for t in w))
    return out


def requests(ctxs: list[tuple[int, ...]], new_tokens: int, sampled_every: int, seed: int) -> list[Request]:
    """A request per context: greedy, or sampled at T = 1 (seeded by seed + its index) for every
    `sampled_every`-th one (0: none)."""
    out = []
    for i, c in enumerate(ctxs):
        sampled = sampled_every and i % sampled_every == 0
        out.append(Request(i, i, c, new_tokens, Sampling(1.0, seed=seed + i) if sampled else Sampling()))
    return out


def documents(
    answers: Iterator[Finished], decode: Callable[[list[int]], str], done: Callable[[int], None]
) -> list[str]:
    """Each request's context and continuation as text, in request order (`done` hears the count so far)."""
    got: dict[int, str] = {}
    for a in answers:
        got[a.request.index] = decode([*a.request.prompt, *a.tokens])
        done(len(got))
    return [got[i] for i in sorted(got)]
