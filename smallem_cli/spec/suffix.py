"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): draft tokens copied from the texts this process has written. A
`SuffixCache` holds texts (each a request's prompt and answer, growing while it is written), bounded in tokens, the
oldest evicted first; a sequence's `SuffixLookup` is the n-gram lookup of its own text (`ngram.NgramLookup`) that,
where a text of the cache matches the end of its context for longer, copies what followed there instead. Under
sampling a draft token is a point mass, as the n-gram lookup's: accepted with probability p(x), exactly."""

from __future__ import annotations

from collections import OrderedDict

import torch

from .ngram import NgramLookup

ANCHOR = 4  # a past text is found by the last ANCHOR tokens of the context, then the match extended backwards
LONGEST = 64  # the longest match measured: past it, every candidate is as good
KEEP = 4  # the latest occurrences of an anchor kept: the candidates a lookup extends
SURE = 16  # a match this long is a repeat: its continuation offered as deep as the match, whatever the acceptance


class SuffixCache:
    """Past texts, at most `max_tokens` tokens together, indexed by each ANCHOR tokens that something followed."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"a suffix cache holds at least one token, not {max_tokens}")
        self.max_tokens, self.size, self.next_id = max_tokens, 0, 0
        self.texts: OrderedDict[int, list[int]] = OrderedDict()  # oldest first
        self.at: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # anchor -> (text, index of its last token)

    def add(self, tokens: list[int]) -> int:
        """A text begun -> its id, for `extend`; the oldest texts evicted to make room (of a longer one than the bound,
        its last max_tokens kept)."""
        tid, self.next_id = self.next_id, self.next_id + 1
        self.texts[tid] = []
        self.extend(tid, tokens[-self.max_tokens :])
        return tid

    def extend(self, tid: int, tokens: list[int]) -> None:
        """More of text `tid`, the anchors they give a follower indexed; nothing where it was evicted."""
        while self.texts and self.size + len(tokens) > self.max_tokens:
            self._evict()
        if (text := self.texts.get(tid)) is None:
            return
        start = max(len(text) - 1, ANCHOR - 1)
        text.extend(tokens)
        self.size += len(tokens)
        for end in range(start, len(text) - 1):  # the anchors that now have a follower
            seen = self.at.setdefault(tuple(text[end - ANCHOR + 1 : end + 1]), [])
            seen.append((tid, end))
            if len(seen) > KEEP:
                del seen[0]

    def _evict(self) -> None:
        tid, tokens = self.texts.popitem(last=False)
        self.size -= len(tokens)
        for end in range(ANCHOR - 1, len(tokens) - 1):
            key = tuple(tokens[end - ANCHOR + 1 : end + 1])
            if (seen := self.at.get(key)) is not None:
                seen[:] = [e for e in seen if e[0] != tid]
                if not seen:
                    del self.at[key]

    def match(self, context: list[int], limit: int) -> tuple[int, list[int]]:
        """(how many tokens of the context's end a past text repeats, up to `limit` tokens that followed them there):
        the longest such match, the latest text among equals; (0, []) where none."""
        if len(context) < ANCHOR or limit < 1:
            return 0, []
        best: tuple[int, list[int]] = (0, [])
        for tid, end in reversed(self.at.get(tuple(context[-ANCHOR:]), [])):
            text, n = self.texts[tid], ANCHOR
            while n < LONGEST and n < len(context) and end - n >= 0 and text[end - n] == context[-1 - n]:
                n += 1
            if n > best[0]:
                best = (n, text[end + 1 : end + 1 + limit])
        return best


class SuffixLookup(NgramLookup):
    """One sequence's lookup: its own text's n-grams, or a text of `cache` where that matches for longer; its own text
    written into the cache as it grows, for the sequences after it and beside it."""

    def __init__(self, cache: SuffixCache, vocab_size: int, min_n: int, max_n: int, draft_cost: float = 0.0) -> None:
        super().__init__(vocab_size, min_n, max_n, draft_cost)
        self.cache, self.tid, self.sure = cache, -1, 0  # sure: the length of a repeat's match, else 0

    def start(self, prompt: torch.Tensor, first: torch.Tensor) -> None:
        super().start(prompt, first)
        self.tid = self.cache.add(self.index.tokens)

    def accept(self, emitted: torch.Tensor) -> None:
        super().accept(emitted)
        self.cache.extend(self.tid, emitted.tolist())

    def find(self, k: int) -> list[int]:
        n, own = self.index.match(k)
        m, past = self.cache.match(self.index.tokens, k)
        self.sure = m if m >= SURE else 0
        return past if m > n else own

    def depth(self, k: int) -> int:
        """A repeat's continuation as deep as the match that found it (a longer one is likelier to go on: a
        coincidence of SURE tokens risks a pass of SURE tokens, not of k), else the lookup's own depth."""
        return min(k, self.sure) if self.sure else super().depth(k)
