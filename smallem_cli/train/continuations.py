"""The target's own text: its continuations of training contexts, a corpus to fit proposers on.

Why: a proposer guesses where the target's text goes next. In a generation every context it
guesses from is the prompt followed by what the target emitted (a wrong guess never stays in
it), so the text it meets is the target's, greedy or sampled, not the corpus's; the bench's
prompts, too, are 32 tokens of held-out text followed by the target's own continuation. So
the proposers are fitted on the same kind of text: contexts drawn from the training split,
each continued by the target (greedy, or sampled at T = 1 for one context in
`sampled_every`), through the batch engine. Distillation on it (`smallem train mtp` or
`train draft --distill`, `--data` at this corpus) still matches the target's whole
distribution at every position, as on the corpus (sequence-level distillation, one form of
training a student on the text its teacher writes).

A document of the corpus is a context and its continuation; the validation split is the
source corpus's own (held-out text, as `smallem eval` reads), copied.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from ..engine.request import Finished, Request
from ..spec.sampling import Sampling


def contexts(ids: np.ndarray, n: int, length: int, seed: int, eot: int) -> list[tuple[int, ...]]:
    """n windows of `length` tokens of `ids` (a token file), none holding the end-of-text
    marker (a context within one document), drawn with a seeded generator: the same n, length
    and seed give the same windows."""
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
        if not (w == eot).any():
            out.append(tuple(int(t) for t in w))
    return out


def requests(ctxs: list[tuple[int, ...]], new_tokens: int, sampled_every: int, seed: int) -> list[Request]:
    """A request per context: greedy, or sampled at T = 1 for every `sampled_every`-th one
    (0: none), each sampled request seeded by seed + its index."""
    return [
        Request(
            i,
            i,
            c,
            new_tokens,
            Sampling(1.0, seed=seed + i) if sampled_every and i % sampled_every == 0 else Sampling(),
        )
        for i, c in enumerate(ctxs)
    ]


def documents(
    answers: Iterator[Finished], decode: Callable[[list[int]], str], done: Callable[[int], None] | None = None
) -> list[str]:
    """Each request's context and continuation as text, in request order (`done` hears how many
    answers came so far)."""
    got: dict[int, str] = {}
    for a in answers:
        got[a.request.index] = decode([*a.request.prompt, *a.tokens])
        if done is not None:
            done(len(got))
    return [got[i] for i in sorted(got)]
