"""Continuous batching: admit, run rounds, preempt when the pool runs dry, finish (docs/architecture.md). A preempted
sequence is recomputed from its tokens later: nothing it emitted is lost or redrawn."""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import cast

import torch

from .. import defaults
from ..kv.pool import PagePool
from ..stats import Stats
from .config import EngineConfig, PoolPlan, round_ahead
from .proposers import Proposer
from .request import Finished, Request
from .round import decode_round, tree_round
from .sequence import Seq
from .stops import StopPrinter
from .target import TargetRunner, prefill
from .tree_proposer import TreeProposer


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
    acceptance: float  # draft tokens accepted / drafted, over all requests so far
    running: int  # sequences decoding now


OnProgress = Callable[[Progress], None]


@dataclass
class _Run:  # one `events` call: its sequences, decoding and waiting, and its counters
    chunks: bool  # whether each sequence's new tokens are yielded as they come (`Emitted`)
    progress: OnProgress | None
    running: list[Seq] = field(default_factory=list)
    waiting: deque[Seq] = field(default_factory=deque)
    done: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    t0: float = field(default_factory=time.perf_counter)


_END = object()  # `_pull`: the source ran out


def load_k(k: int, greedy: bool, batch: int, auto: bool, proposer: str) -> int:
    """k, capped under load for greedy requests when not given: a sampled text must depend on its seed alone."""
    return min(k, defaults.load_cap(proposer, batch)) if auto and greedy else k


class Engine:
    def __init__(
        self, config: EngineConfig, plan: PoolPlan, target: TargetRunner, proposer: Proposer,
        trees: TreeProposer | None, grow: Callable[[int], bool] | None,
    ) -> None:  # fmt: skip
        """Made by `build.build`; grow(n) makes the pool and its slabs n pages large (False: the memory is short)."""
        self.t, self.proposer, self.trees, self.grow = target, proposer, trees, grow
        self.max_batch, self.max_pages, self.context = plan.max_batch, plan.max_pages, plan.context
        self.k, self.k_sample, self.auto_k = config.k_for(True), config.k_for(False), config.k is None
        self.end_ids, self.decode, self.backend = frozenset(config.end_ids), config.decode, config.backend.label
        self.tree = config.proposer.tree  # with k, the positions a round may write (`round_ahead`)
        self._uid = self.rounds = self.preemptions = 0
        self.sessions: dict[int, Seq] = {}  # a conversation's sequence between its requests, pages held
        self.cancels: queue.SimpleQueue[str | int] = queue.SimpleQueue()  # ids to end at the next round (`cancel`)
        self.live: tuple[list[Seq], deque[Seq]] = ([], deque())  # a run's sequences decoding and waiting

    def cancel(self, request_id: str | int) -> None:
        """End a request between rounds, from any thread: its pages go back, its Finished has what it had. An id
        not in the run when the round comes (finished, or not yet taken from the source) is let go."""
        self.cancels.put(request_id)

    @property
    def pool(self) -> PagePool:
        return self.t.pool

    def k_of(self, greedy: bool) -> int:
        """Draft tokens a round for a greedy or a sampled request (before any cap under load)."""
        return self.k if greedy else self.k_sample

    def sequence(self, req: Request) -> Seq:
        """The sequence that decodes `req` (a conversation's takes its session's cache over)."""
        k = self.k_of(req.sampling.greedy)
        gen = torch.Generator(device=self.t.slab.device).manual_seed(req.sampling.seed)
        st = Stats(self.proposer.name, k, backend=self.backend)
        if req.stop and self.decode is None:
            raise ValueError("stop strings need the engine to decode text (decode=...)")
        stops = StopPrinter(self.decode, None, req.stop) if req.stop and self.decode else None
        prior = self.sessions.pop(req.session, None) if req.session is not None else None
        if prior is None:
            self._uid += 1
        uid = self._uid if prior is None else prior.uid
        s = Seq(req, uid, gen, req.sampling.warp(), st, k, list(req.prompt), stops=stops)
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
        within = emitted[:budget]
        s.tokens.extend(within)
        done = end is not None or len(within) >= budget  # max_new_tokens reached
        # as `smallem generate` cuts them: the text ends before the stop string, the tokens with it
        if s.stops is not None and (s.stops.push(within, final=done) or done):
            s.tokens[len(s.req.prompt) :] = s.stops.ids
            return self._finish(s, "stop" if end is not None or s.stops.stopped else "length", s.stops.text)
        return self._finish(s, "length" if end is None else "stop") if done else None

    def _let_go(self, s: Seq) -> None:
        """Its pages go back, but a conversation's; its proposer state goes (`target.prefill` restarts it)."""
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
        left = list(running)
        i = 0
        while i < len(left):
            s = left[i]
            need = s.cached + round_ahead(s.k, self.tree)
            if (short := self.pool.need(s.uid, need)) == 0:  # most rounds need no new page at all
                i += 1
                continue
            if short > len(self.pool.free):
                self._grow(short - len(self.pool.free))
                while self.pool.need(s.uid, need) > len(self.pool.free) and left[-1] is not s:
                    self._preempt(left.pop(), waiting)
                if self.pool.need(s.uid, need) > len(self.pool.free):  # alone and still short
                    self._preempt(left.pop(), waiting)
                    continue
            self.pool.reserve(s.uid, need)
            i += 1
        return left

    def run(self, requests: Iterable[Request], progress: OnProgress | None = None) -> Iterator[Finished]:
        """Answers as their requests end; stopped early, every sequence's pages and proposer state go back."""
        return cast(Iterator[Finished], self.events(requests, progress, chunks=False))  # no `Emitted` then

    def events(
        self, requests: Iterable[Request | None], progress: OnProgress | None = None, chunks: bool = True
    ) -> Iterator[Finished | Emitted]:
        """As `run`, and (`chunks`) each sequence's new tokens as soon as verified (`Emitted`, before its `Finished`).
        A live source (a server's) yields None for "nothing now": it must block instead while nothing is in flight."""
        source, run, exhausted = iter(requests), _Run(chunks, progress), False
        self.live = (run.running, run.waiting)
        try:
            with torch.inference_mode():
                while True:
                    exhausted = exhausted or self._pull(source, run.running, run.waiting)
                    yield from self._cancel(run)
                    if not run.running and not run.waiting:
                        if exhausted:
                            break
                        continue  # a live source had nothing now
                    yield from self._prefill(run)
                    yield from self._decode(run)
        except GeneratorExit:  # the consumer stopped at a yield, between rounds: conversations keep their cache
            for s in [*run.running, *run.waiting]:
                if s.req.session is not None and s.uid in self.pool.tables:
                    (run.running.remove if s in run.running else run.waiting.remove)(s)
                    self._let_go(s)
            raise
        finally:
            for s in [*run.running, *run.waiting]:
                if s.uid in self.pool.tables:
                    self.pool.release(s.uid)
                self.proposer.drop(s)
        held = sum(len(self.pool.tables[s.uid]) for s in self.sessions.values())
        assert self.pool.used() == held, f"{self.pool.used() - held} pages not returned after the run"
        self.pool.check()

    def _cancel(self, run: _Run) -> Iterator[Finished]:
        """The requests cancelled since the last round (another thread's: `cancel`) end now."""
        ids: set[str | int] = set()
        while not self.cancels.empty():
            ids.add(self.cancels.get_nowait())
        for s in [s for s in [*run.running, *run.waiting] if s.req.id in ids]:
            (run.running.remove if s in run.running else run.waiting.remove)(s)
            run.done += 1
            yield self._finish(s, "cancelled")

    def _prefill(self, run: _Run) -> Iterator[Finished | Emitted]:
        """The waiting sequences the pool has room for join the running ones, prefilled: their first tokens."""
        for group in _groups(self._admit(run.running, run.waiting), defaults.PREFILL_TOKENS):
            run.running.extend(group)  # from here on, a stop drops them with the others
            firsts = prefill(self.t, self.proposer, group)
            for s, first in zip(group, firsts, strict=True):
                if first is None:  # recomputed after a preemption
                    continue
                s.stats.passes += 1
                s.stats.prefill_s = time.perf_counter() - s.submitted_s
                yield from self._emit(run, s, [first])

    def _decode(self, run: _Run) -> Iterator[Finished | Emitted]:
        """One round over the running sequences, k by the load and their pages reserved (the newest may be
        preempted), and what it emitted."""
        greedy = load_k(self.k, True, len(run.running), self.auto_k, self.proposer.name)
        for s in run.running:
            s.k = greedy if s.warp is None else self.k_sample
        run.running[:] = self._reserve(run.running, run.waiting)
        if not run.running:
            return
        if self.trees is not None:
            results = tree_round(self.t, self.trees, run.running)
        else:
            results = decode_round(self.t, self.proposer, run.running)
        self.rounds += 1
        for s, r in zip(list(run.running), results, strict=True):
            run.drafted, run.accepted = run.drafted + r.drafted, run.accepted + r.accepted
            yield from self._emit(run, s, r.tokens)
        if run.progress is not None:
            rate = run.accepted / run.drafted if run.drafted else 0.0
            run.progress(Progress(run.done, run.tokens, time.perf_counter() - run.t0, rate, len(run.running)))

    def _emit(self, run: _Run, s: Seq, emitted: list[int]) -> Iterator[Finished | Emitted]:
        """Add what a pass emitted for `s`; its new tokens (with `chunks`), then its answer if done."""
        before = s.n_generated
        fin = self._ended(s, emitted)
        run.tokens += (len(fin.tokens) if fin is not None else s.n_generated) - before
        if run.chunks:
            yield Emitted(s.req, (fin.tokens if fin is not None else s.generated)[before:], self._live(s))
        if fin is not None:
            run.running.remove(s)
            run.done += 1
            yield fin

    def _pull(self, source: Iterator[Request | None], running: list[Seq], waiting: deque[Seq]) -> bool:
        """Requests from `source` wait their turn, up to max_batch sequences in all -> whether it ran out."""
        while len(running) + len(waiting) < self.max_batch:
            if (req := next(source, _END)) is _END:
                return True
            if req is None:  # a live source: nothing now
                return False
            waiting.append(self.sequence(cast(Request, req)))
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
