"""What the user typed, checked: each bad value becomes one clear `UsageError` line."""

from __future__ import annotations

import importlib.util
import sys

from . import defaults as D


class UsageError(Exception):
    """Bad input: reported as one line on stderr, exit 2."""


def parse_ks(text: str) -> list[int]:
    """'2', '1,3,5' or '1..6' -> sorted k values."""
    try:
        if ".." in text:
            lo, hi = text.split("..")
            ks = list(range(int(lo), int(hi) + 1))
        else:
            ks = [int(x) for x in text.split(",")]
    except ValueError:
        raise UsageError(f"bad k list {text!r}: use 2, 1,3,5 or 1..6") from None
    if not ks or not all(1 <= k <= D.MAX_K for k in ks):
        raise UsageError(f"k values must be between 1 and {D.MAX_K}: {text!r}")
    return sorted(set(ks))


def read_prompt(prompt: str | None) -> str:
    """The prompt argument, or stdin for `-` or for no argument on a pipe."""
    if prompt is not None and prompt != "-":
        return prompt
    if prompt is None and sys.stdin.isatty():
        raise UsageError("no prompt: give one as an argument, or pipe it on stdin")
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"stdin is not valid UTF-8 (byte {e.start})") from None


def check_sampling(k: int, temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not 1 <= k <= D.MAX_K:
        raise UsageError(f"k must be between 1 and {D.MAX_K}, got {k}")
    if not temperature >= 0:
        raise UsageError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise UsageError(f"top-k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise UsageError(f"top-p must be in (0, 1], got {top_p}")


def check_vocab(proposer_vocab: int | None) -> None:
    if proposer_vocab is not None and proposer_vocab < 0:
        raise UsageError(f"--proposer-vocab must be >= 0, got {proposer_vocab}")


def check_bench(modes: str, repeats: int, max_new: int, peer: str | None, plot: bool, costs: bool) -> list[str]:
    """`bench`'s options -> its modes. Optional extras are checked before minutes of timing."""
    mode_list = [m for m in modes.split(",") if m]
    if not set(mode_list) <= {"greedy", "sample"} or not mode_list:
        raise UsageError(f"modes must be greedy and/or sample, got {modes!r}")
    if repeats < 1 or max_new < 1:
        raise UsageError("--repeats and --max-new-tokens must be >= 1")
    if costs and (peer or plot):
        raise UsageError("--costs times no generations: --peer and --plot do not apply")
    if peer not in (None, "hf"):
        raise UsageError(f"unknown peer {peer!r}: only 'hf' is supported")
    if peer and importlib.util.find_spec("transformers") is None:
        raise UsageError("--peer hf needs transformers: pip install 'smallem[hf]'")
    if plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib: pip install 'smallem[plot]'")
    return mode_list
