"""A request (one prompt and its settings) and its answer, as the batch engine sees them."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..spec.sampling import Sampling


@dataclass(frozen=True)
class Request:
    """One prompt, already tokenized and checked (non-empty, fits the context with its budget)."""

    index: int  # position in the input: `--ordered` writes answers by it
    id: str | int  # the user's id, or the input line number
    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one
    session: int | None = None  # a conversation: its cache outlives the answer (`Engine._resume`)
    # the model's end tokens are text like any other: answers of max_new_tokens (a load test's)
    ignore_eos: bool = False


@dataclass
class Finished:
    """A request's answer: its text (cut before a stop string), its tokens, its statistics."""

    request: Request
    text: str
    tokens: list[int]
    stats: dict[str, object] = field(default_factory=dict)
    reason: str = "length"  # "stop" (an end token or a stop string), "length" (the budget) or "cancelled"
