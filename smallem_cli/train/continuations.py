"""The target's own text: its continuations of training contexts, a corpus to fit proposers on.

In a generation a proposer drafts from the prompt and the target's own text (the bench's prompts too are held-out text
continued by the target), not the corpus's. So contexts drawn from the training split are continued by the target
(greedy, or at T = 1 for one in `sampled_every`) on the batch engine; distillation on them still matches the target's
whole distribution at every position (sequence-level distillation). A document is a context and its continuation; the
validation split is the source corpus's own, copied."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from ..engine.request import Finished, Request
from ..spec.sampling import Sampling


def contexts(ids: np.ndarray, n: int, length: int, seed: int, eot: int | None) -> list[tuple[int, ...]]:
    """n windows of `length` tokens of `ids`, each within one document (no `eot` in it; None: the tokenizer has none,
    so the documents run together), drawn by a generator of `seed`: the same arguments give the same windows."""
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


# A chat model's proposer meets user instructions and the model's answers, not running text: its
# contexts are instructions composed from these (a task on a topic), through the model's template.
TASKS = (
    "Explain {} to a beginner.", "Write a short paragraph about {}.", "Give three facts about {}, one per line.",
    "What are the advantages and drawbacks of {}?", "Write a short poem about {}.",
    "How would you explain {} to a ten-year-old?", "Summarize the history of {} in a few sentences.",
    "List five questions people often ask about {}.", "Write a very short story that involves {}.",
    "Give me practical advice about {}.", "Write a friendly email to a colleague about {}.",
    "What are common misconceptions about {}?",
)  # fmt: skip
TOPICS = (
    "photosynthesis", "the moon", "volcanoes", "the water cycle", "black holes", "honey bees", "the human heart",
    "vaccines", "electricity", "magnets", "climate change", "recycling", "the internet", "passwords",
    "machine learning", "spreadsheets", "budgeting", "saving for retirement", "job interviews", "public speaking",
    "learning a language", "playing the guitar", "chess", "football", "running a marathon", "yoga", "sleep",
    "drinking water", "healthy breakfasts", "baking bread", "making coffee", "growing tomatoes", "houseplants",
    "adopting a dog", "cats", "birds in winter", "the ocean", "coral reefs", "rainforests", "deserts",
    "mountains", "rivers", "ancient Egypt", "the Roman Empire", "the printing press", "the industrial revolution",
    "airplanes", "trains", "electric cars", "bicycles", "city parks", "libraries", "museums", "friendship",
    "time management", "remote work", "writing a résumé", "first aid", "earthquakes", "solar panels",
    "wind turbines", "the periodic table", "prime numbers", "fractions", "probability", "maps", "the weather",
    "rainbows", "snowflakes", "stars", "Mars", "the solar system", "dinosaurs", "fossils", "the Olympic Games",
    "music theory", "painting", "photography", "movies", "poetry",
)  # fmt: skip


MAX_INSTRUCTIONS = len(TASKS) * len(TOPICS)


def instructions(n: int, seed: int) -> list[str]:
    """n distinct instructions of TASKS x TOPICS, drawn by a generator of `seed`."""
    grid = [task.format(topic) for task in TASKS for topic in TOPICS]
    if n > len(grid):
        raise ValueError(f"--chat composes at most {len(grid)} instructions, asked for {n}")
    return [grid[i] for i in np.random.default_rng(seed).permutation(len(grid))[:n]]


def requests(ctxs: list[tuple[int, ...]], new_tokens: int, sampled_every: int, seed: int) -> list[Request]:
    """A request per context, greedy; every `sampled_every`-th (0: none) at T = 1, seeded by seed + its index."""
    out = []
    for i, c in enumerate(ctxs):
        sampled = sampled_every and i % sampled_every == 0
        out.append(Request(i, i, c, new_tokens, Sampling(1.0, seed=seed + i) if sampled else Sampling()))
    return out


def documents(answers: Iterator[Finished], decode: Callable[[list[int]], str],
              done: Callable[[int], None]) -> list[str]:  # fmt: skip
    """Each request's context and continuation as text, in request order (`done` hears the count so far)."""
    got: dict[int, str] = {}
    for a in answers:
        got[a.request.index] = decode([*a.request.prompt, *a.tokens])
        done(len(got))
    return [got[i] for i in sorted(got)]
