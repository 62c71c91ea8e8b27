"""Stop strings: the text ends before the first one. One may begin in a round's tokens and end in a
later one's, so a tail that could begin one is held back: nothing printed is ever taken back."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TextIO


def stop_index(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Where the first stop string in text[start:] begins (the earliest of them all), or None."""
    found = [i for s in stops if s and (i := text.find(s, start)) >= 0]
    return min(found) if found else None


def partial_tail(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of text that a stop string starts with (without being all of it)."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


class StopCutter:
    """`cut(text)` of a growing text -> how many characters may be printed: up to its first stop string,
    final (`stopped`) once none can begin before it; until then a tail that could begin one held back."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.found: int | None = None  # the earliest complete stop string so far
        self.stopped: int | None = None  # where the text ends, once certain
        self.safe = 0  # no stop string begins before this index (checked by earlier cuts)

    def cut(self, text: str, final: bool = False) -> int:
        if self.stopped is not None:
            return self.stopped
        at = stop_index(text, self.stops, self.safe)
        if at is not None:
            self.found = at
        open_from = len(text) - (0 if final else partial_tail(text, self.stops))  # one may still begin here
        if at is not None and at <= open_from:
            self.stopped = at
            return at
        self.safe = open_from
        return open_from


DECODE_WINDOW = 4  # tokens decoded again before the new ones (`StopPrinter._decoded`)


class StopPrinter:
    """Tokens in, text out (to `out`, or kept when None), ending before the first stop string. `push`
    is True once the text's end is certain; `ids` are the tokens up to the one that completed it."""

    def __init__(self, decode: Callable[[list[int]], str], out: TextIO | None, stops: Sequence[str] = ()) -> None:
        self.decode, self.out = decode, out
        self.cutter = StopCutter(stops)
        # with nowhere to print and no stop string to look for, nothing needs decoding until the end
        self.live = out is not None or bool(self.cutter.stops)
        self.pushed: list[int] = []
        self.decoded = ""  # the text so far, a split UTF-8 character at its end held back
        self.printed = 0
        self.before = 0  # tokens pushed before the last push
        self.found_after = 0  # tokens pushed before the one in which the stop string was found
        self.stable, self.stable_text = 0, ""  # tokens whose text ends on a whole character, and that text

    @property
    def stopped(self) -> bool:
        return self.cutter.stopped is not None

    def push(self, ids: list[int], final: bool = False) -> bool:
        if not self.stopped:
            self.before = len(self.pushed)
            self.pushed.extend(ids)
            if self.live:
                text = self._decoded()
                self.decoded = text if final else text.rstrip("\ufffd")
                self._show()
            if final:
                self._show(final=True)
        return self.stopped

    def _decoded(self) -> str:
        """decode(pushed) from the tokens since the text last ended on a whole character and a few before (a first
        token may decode apart: sentencepiece drops its space): a whole decode each push is quadratic in the answer."""
        start = max(0, self.stable - DECODE_WINDOW)
        head, tail = self.decode(self.pushed[start : self.stable]), self.decode(self.pushed[start:])
        text = self.stable_text + tail[len(head) :] if tail.startswith(head) else self.decode(self.pushed)
        if not text.endswith("\ufffd"):
            self.stable, self.stable_text = len(self.pushed), text
        return text

    def _show(self, final: bool = False) -> None:
        found = self.cutter.found
        end = self.cutter.cut(self.decoded, final)
        if self.cutter.found != found:  # a stop string, complete in this push's tokens
            self.found_after = self.before
        if self.out is not None and end > self.printed:
            self.out.write(self.decoded[self.printed : end])
            self.out.flush()
        self.printed = max(self.printed, end)

    @property
    def end(self) -> int | None:
        """The stop string's start, once certain, else the earliest one seen complete, else None."""
        return self.cutter.stopped if self.cutter.stopped is not None else self.cutter.found

    @property
    def text(self) -> str:
        end = self.end
        return self.decode(self.pushed) if end is None else self.decoded[:end]

    @property
    def ids(self) -> list[int]:
        ids, at = self.pushed, self.end
        if at is None:
            return ids
        for n in range(self.found_after + 1, len(ids)):  # the first token whose text holds that stop string
            if any(self.decode(ids[:n]).startswith(s, at) for s in self.cutter.stops):
                return ids[:n]
        return ids
