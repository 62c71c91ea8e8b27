"""Continuous batching: admit, run rounds, preempt when the pool runs dry, finish (docs/architecture.md). A preempted
sequence is recomputed from its tokens later: nothing it emitted is lost or redrawn."""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import cast

import torch

from .. import defaults as D
from ..stats import Stats
from .pool import PagePool
from .proposers import BatchProposer, MTPGuess
from .request import Finished, Request
from .runner import TargetRunner, decode_round, prefill, tree_round
from .sequence import Seq
from .stops import StopPrinter


@dataclass
class Emitted:
    """Tokens a sequence just gained (`Engine.events`): a generation streams them."""

    request: Request
    tokens: list[int]
    stats: Stats  # the sequence's own, updated in place as it runs


@dataclass
class Progress:
    done: int  # requests answered
    tokens: int  # tokens generated, over all requests
    elapsed_s: float
    acceptance: float  # guesses kept / guesses offered, over all requests so far
    running: int  # sequences decoding now


_END = object()  # `_pull`: the source ran out


def round_ahead(k: int, tree: tuple[int, int] | None) -> int:
    """Positions a round may write past a sequence's cache: [last, k guesses or a tree's entries], and one more."""
    return k + 2 if tree is None else max(k, tree[0], (k - 1) * tree[1]) + 2


def load_k(k: int, greedy: bool, batch: int, auto: bool, proposer: str) -> int:
    """k, capped under load for greedy requests when k was not given (`D.load_cap`). Sampled requests
    keep theirs: their text must depend on their seed alone, not on what else is running."""
    return min(k, D.load_cap(proposer, batch)) if auto and greedy else k


class Engine:
    def __init__(
        self,
        target: TargetRunner,
        proposer: BatchProposer,
        k: int,
        *,
        auto_k: bool,
        max_batch: int,
        end_ids: Collection[int] = (),
        decode: Callable[[list[int]], str] | None = None,
        k_sample: int | None = None,
        tree: tuple[int, int] | None = None,
        grow: Callable[[int], bool] | None = None,
        max_pages: int = 0,
        backend: str = "eager",
    ) -> None:
        """grow(n): the pool and its slabs made n pages large, False where the memory was not there."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.t, self.proposer, self.max_batch = target, proposer, max_batch
        self.k, self.k_sample, self.auto_k = k, k if k_sample is None else k_sample, auto_k
        self.end_ids, self.decode = frozenset(end_ids), decode
        self.tree = tree  # (guesses per tree, candidates per node); k is their depth
        if tree is not None and not isinstance(proposer, MTPGuess):
            raise ValueError(f"token trees need the MTP module as proposer, not {proposer.name!r}")
        self.grow, self.max_pages, self.backend = grow, max_pages, backend
        self._uid = self.rounds = self.preemptions = 0
        self.sessions: dict[int, Seq] = {}  # a conversation's sequence between its requests, pages held
        self.cancels: queue.SimpleQueue[str | int] = queue.SimpleQueue()  # ids to end at the next round (`cancel`)
        self.live: tuple[list[Seq], deque[Seq]] = ([], deque())  # a run's sequences decoding and waiting

    def cancel(self, request_id: str | int) -> None:
        """End a request between rounds, from any thread: its pages go back, its Finished has what it had. An id
        not in the run when the round comes (finished, or not yet taken from the source) is let go."""
        self.cancels.put(request_id)

    def _cancelled(self) -> set[str | int]:
        ids: set[str | int] = set()
        while not self.cancels.empty():
            ids.add(self.cancels.get_nowait())
        return ids

    def end_session(self, session: int) -> None:
        if (s := self.sessions.pop(session, None)) is not None:
            self.pool.release(s.uid)

    @property
    def pool(self) -> PagePool:
        return self.t.pool

    def _seq(self, req: Request) -> Seq:
        k = self.k if req.sampling.greedy else self.k_sample
        gen = torch.Generator(device=self.t.slab.device).manual_seed(req.sampling.seed)
        st = Stats(self.proposer.name, k, backend=self.backend)
        st.accepted_at, st.guessed = [0] * k, [0] * (k + 1)
        if req.stop and self.decode is None:
            raise ValueError("stop strings need the engine to decode text (decode=...)")
        stops = StopPrinter(self.decode, None, req.stop) if req.stop and self.decode else None
        prior = self.sessions.pop(req.session, None) if req.session is not None else None
        if prior is None:
            self._uid += 1
        uid = self._uid if prior is None else prior.uid
        s = Seq(
            req, uid, gen, req.sampling.warp(), st, k, list(req.prompt), stops=stops, submitted_s=time.perf_counter()
        )
        if prior is not None:
            self._resume(s, prior)
        return s

    def _resume(self, s: Seq, prior: Seq) -> None:
        """`s` takes over its session's cache, rolled back to the longest prefix they share (a cut answer left
        positions past its tokens); its last prompt token is fed again at least: it draws the first new token."""
        held = min(prior.cached, len(prior.tokens), len(s.tokens) - 1)
        n = next((i for i in range(held) if prior.tokens[i] != s.tokens[i]), held)
        self.pool.trim(s.uid, n)
        s.cached = s.stats.reused = n
        s.states = [torch.cat(prior.states)[:n]] if prior.states else None

    def _finish(self, s: Seq, reason: str, text: str | None = None) -> Finished:
        self._let_go(s)
        st = self._live(s)
        stats = st.as_dict() | {"latency_s": round(st.elapsed_s, 4), "preempted": s.preempted}
        if text is None:
            text = self.decode(s.generated) if self.decode is not None else ""
        return Finished(s.req, text, s.generated, stats, reason)

    def _ended(self, s: Seq, emitted: list[int]) -> Finished | None:
        """Add what a round emitted; the answer if the sequence is done (budget, end of text, stop string)."""
        budget = s.req.max_new_tokens - s.n_generated
        ends = () if s.req.ignore_eos else self.end_ids
        end = next((i for i, t in enumerate(emitted[:budget]) if t in ends), None)
        if end is not None:  # the model's end of turn: not emitted
            emitted, s.stats.end_token = emitted[:end], 1
        kept = emitted[:budget]
        s.tokens.extend(kept)
        done = end is not None or len(kept) >= budget  # max_new_tokens reached
        # as `smallem generate` cuts them: the text ends before the stop string, the tokens with it
        if s.stops is not None and (s.stops.push(kept, final=done) or done):
            s.tokens[len(s.req.prompt) :] = s.stops.ids
            return self._finish(s, "stop" if end is not None or s.stops.stopped else "length", s.stops.text)
        return self._finish(s, "length" if end is None else "stop") if done else None

    def _let_go(self, s: Seq) -> None:
        """Its pages go back, but a conversation's; its proposer state goes (`runner.prefill` restarts it)."""
        if s.req.session is not None:
            self.sessions[s.req.session] = s
        elif s.uid in self.pool.tables:  # (a sequence cancelled while waiting holds none)
            self.pool.release(s.uid)
        self.proposer.drop(s)

    def _grow(self, short: int) -> None:
        """`short` more pages wanted: the pool doubles, up to max_pages; a growth refused is not tried again."""
        n = self.pool.n_pages
        if short > 0 and self.grow is not None and n < self.max_pages:
            if not self.grow(min(self.max_pages, max(2 * n, n + short))):
                self.max_pages = n

    def _preempt(self, s: Seq, waiting: deque[Seq]) -> None:
        self.pool.release(s.uid)
        self.proposer.drop(s)
        s.cached, s.preempted, s.states = 0, s.preempted + 1, None
        self.preemptions += 1
        waiting.appendleft(s)

    def _reserve(self, running: list[Seq], waiting: deque[Seq]) -> list[Seq]:
        """Pages for this round, preempting the newest sequences while the pool is short."""
        kept = list(running)
        i = 0
        while i < len(kept):
            s = kept[i]
            need = s.cached + round_ahead(s.k, self.tree)
            if (short := self.pool.need(s.uid, need)) == 0:  # most rounds need no new page at all
                i += 1
                continue
            if short > len(self.pool.free):
                self._grow(short - len(self.pool.free))
                while self.pool.need(s.uid, need) > len(self.pool.free) and kept[-1] is not s:
                    self._preempt(kept.pop(), waiting)
                if self.pool.need(s.uid, need) > len(self.pool.free):  # alone and still short
                    self._preempt(kept.pop(), waiting)
                    continue
            self.pool.reserve(s.uid, need)
            i += 1
        return kept

    def run(
        self, requests: Iterable[Request], progress: Callable[[Progress], None] | None = None
    ) -> Iterator[Finished]:
        """Answers as their requests end; stopped early, every sequence's pages and proposer state go back."""
        return cast(Iterator[Finished], self._events(requests, progress, chunks=False))  # no `Emitted` then

    def events(
        self, requests: Iterable[Request | None], progress: Callable[[Progress], None] | None = None
    ) -> Iterator[Finished | Emitted]:
        """As `run`, and each sequence's new tokens as soon as verified (`Emitted`, before its `Finished`). A live
        source (a server's) yields None for "nothing now": it must block instead while nothing is in flight."""
        return self._events(requests, progress, chunks=True)

    def _events(
        self, requests: Iterable[Request | None], progress: Callable[[Progress], None] | None, chunks: bool
    ) -> Iterator[Finished | Emitted]:
        source = iter(requests)
        waiting: deque[Seq] = deque()
        running: list[Seq] = []
        self.live = (running, waiting)
        done = tokens = proposed = accepted = 0
        t0 = time.perf_counter()
        exhausted = False

        def ended(s: Seq, emitted: list[int]) -> Iterator[Finished | Emitted]:
            """Add what a pass emitted for `s`; its new tokens (with `chunks`), then its answer if done."""
            nonlocal done, tokens
            before = s.n_generated
            fin = self._ended(s, emitted)
            tokens += (len(fin.tokens) if fin is not None else s.n_generated) - before
            if chunks:
                yield Emitted(s.req, (fin.tokens if fin is not None else s.generated)[before:], self._live(s))
            if fin is not None:
                running.remove(s)
                done += 1
                yield fin

        try:
            with torch.inference_mode():
                while True:
                    exhausted = exhausted or self._pull(source, running, waiting)
                    if ids := self._cancelled():  # (another thread's: `cancel`)
                        for s in [s for s in [*running, *waiting] if s.req.id in ids]:
                            (running.remove if s in running else waiting.remove)(s)
                            done += 1
                            yield self._finish(s, "cancelled")
                    if not running and not waiting:
                        if exhausted:
                            break
                        continue  # a live source had nothing now
                    for group in _groups(self._admit(running, waiting), D.PREFILL_TOKENS):
                        running.extend(group)  # from here on, a stop drops them with the others
                        firsts = prefill(self.t, self.proposer, group)
                        for s, first in zip(group, firsts, strict=True):
                            if first is None:  # recomputed after a preemption
                                continue
                            s.stats.passes += 1
                            s.stats.prefill_s = time.perf_counter() - s.submitted_s
                            yield from ended(s, [first])
                    verdicts = self._round(running, waiting) if running else []
                    if not running:
                        continue
                    for s, (m, n, e) in zip(list(running), verdicts, strict=True):
                        proposed, accepted = proposed + m, accepted + n
                        yield from ended(s, e)
                    if progress is not None:
                        rate = accepted / proposed if proposed else 0.0
                        progress(Progress(done, tokens, time.perf_counter() - t0, rate, len(running)))
        except GeneratorExit:  # the consumer stopped at a yield, between rounds: conversations keep their cache
            for s in [s for s in [*running, *waiting] if s.req.session is not None and s.uid in self.pool.tables]:
                (running.remove if s in running else waiting.remove)(s)
                self._let_go(s)
            raise
        finally:
            for s in [*running, *waiting]:
                if s.uid in self.pool.tables:
                    self.pool.release(s.uid)
                self.proposer.drop(s)
        held = sum(len(self.pool.tables[s.uid]) for s in self.sessions.values())
        assert self.pool.used() == held, f"{self.pool.used() - held} pages not returned after the run"
        self.pool.check()

    def _pull(self, source: Iterator[Request | None], running: list[Seq], waiting: deque[Seq]) -> bool:
        """Requests from `source` wait their turn, up to max_batch sequences in all -> whether it ran out."""
        while len(running) + len(waiting) < self.max_batch:
            if (req := next(source, _END)) is _END:
                return True
            if req is None:  # a live source: nothing now
                return False
            waiting.append(self._seq(cast(Request, req)))
        return False

    def _admit(self, running: list[Seq], waiting: deque[Seq]) -> list[Seq]:
        """The waiting sequences, in order, that the pool has the pages of their prompt and first round for."""
        admitted: list[Seq] = []
        while waiting and len(running) + len(admitted) < self.max_batch:
            s = waiting[0]
            need = len(s.tokens) + round_ahead(s.k, self.tree)
            held = s.uid in self.pool.tables  # a conversation's cache
            short = self.pool.need(s.uid, need) if held else self.pool.pages_for(need)
            self._grow(short - len(self.pool.free))
            if short > len(self.pool.free):
                if not running and not admitted:
                    raise RuntimeError(f"the page pool ({self.pool.n_pages} pages) cannot hold one request")
                break
            waiting.popleft()
            if not held:
                self.pool.add(s.uid)
            self.pool.reserve(s.uid, need)
            admitted.append(s)
        return admitted

    def _round(self, running: list[Seq], waiting: deque[Seq]) -> list[tuple[int, int, list[int]]]:
        """k by the load, pages reserved (`running` may shrink), guesses verified -> (m, n, emitted) each."""
        n, name = len(running), self.proposer.name
        greedy, sampled = load_k(self.k, True, n, self.auto_k, name), load_k(self.k_sample, False, n, self.auto_k, name)
        for s in running:
            s.k = greedy if s.warp is None else sampled
        running[:] = self._reserve(running, waiting)
        if not running:
            return []
        if self.tree is not None and isinstance(self.proposer, MTPGuess):
            verdicts = tree_round(self.t, self.proposer, running, *self.tree)
        else:
            verdicts = decode_round(self.t, self.proposer, running)
        self.rounds += 1
        return verdicts

    def _live(self, s: Seq) -> Stats:
        s.stats.new_tokens = s.n_generated
        s.stats.elapsed_s = time.perf_counter() - s.submitted_s
        return s.stats


def _groups(seqs: list[Seq], budget: int) -> Iterator[list[Seq]]:
    """Prefill groups of at most `budget` tokens (one sequence alone may exceed it)."""
    group: list[Seq] = []
    size = 0
    for s in seqs:
        if group and size + len(s.tokens) > budget:
            yield group
            group, size = [], 0
        group.append(s)
        size += len(s.tokens)
    if group:
        yield group
