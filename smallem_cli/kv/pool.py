"""The page pool every sequence of a batch shares, in plain Python (nano-vllm's block manager): a
sequence's position j lives at slot table[j // page_size] * page_size + j % page_size of every slab.
Nothing here touches a tensor: stale K/V past a sequence's length are never read."""

from __future__ import annotations


def pages_for(n_tokens: int, page_size: int) -> int:
    return -(-n_tokens // page_size)


class PoolExhausted(RuntimeError):
    """Not enough free pages for what was asked; nothing was taken."""


class PagePool:
    def __init__(self, n_pages: int, page_size: int) -> None:
        if n_pages < 1 or page_size < 1:
            raise ValueError("a pool needs at least one page of at least one slot")
        self.n_pages, self.page_size = n_pages, page_size
        self.free: list[int] = list(range(n_pages - 1, -1, -1))  # a stack: pop() hands out pages in order
        self.tables: dict[int, list[int]] = {}

    def grow(self, n_pages: int) -> None:
        """The pool made n_pages large; the new pages go under the free ones, handed out last."""
        if n_pages < self.n_pages:
            raise ValueError(f"a pool grows, it does not shrink: {n_pages} pages < {self.n_pages}")
        self.free[:0] = range(n_pages - 1, self.n_pages - 1, -1)
        self.n_pages = n_pages

    def pages_for(self, n_tokens: int) -> int:
        return pages_for(n_tokens, self.page_size)

    def add(self, seq: int) -> None:
        if seq in self.tables:
            raise ValueError(f"sequence {seq} is already in the pool")
        self.tables[seq] = []

    def need(self, seq: int, n_tokens: int) -> int:
        return max(0, self.pages_for(n_tokens) - len(self.tables[seq]))

    def reserve(self, seq: int, n_tokens: int) -> None:
        """Grow `seq`'s table to cover n_tokens positions; PoolExhausted (taking nothing) if it cannot."""
        need = self.need(seq, n_tokens)
        if need > len(self.free):
            raise PoolExhausted(f"{need} pages needed, {len(self.free)} free of {self.n_pages}")
        self.tables[seq].extend(self.free.pop() for _ in range(need))

    def trim(self, seq: int, n_tokens: int) -> None:
        table = self.tables[seq]
        keep = self.pages_for(n_tokens)
        if keep < len(table):
            self.free.extend(reversed(table[keep:]))
            del table[keep:]

    def release(self, seq: int) -> None:
        self.trim(seq, 0)
        del self.tables[seq]

    def slot(self, seq: int, j: int) -> int:
        return self.tables[seq][j // self.page_size] * self.page_size + j % self.page_size

    def used(self) -> int:
        return self.n_pages - len(self.free)

    def check(self) -> None:
        """Every page is free or owned by exactly one sequence: AssertionError otherwise."""
        everything = [p for t in self.tables.values() for p in t] + self.free
        assert len(everything) == self.n_pages, f"{len(everything)} pages accounted for, pool has {self.n_pages}"
        assert sorted(everything) == list(range(self.n_pages)), "a page is lost or owned twice"
