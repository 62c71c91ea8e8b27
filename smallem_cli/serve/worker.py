"""The engine's loop, on the main thread while the HTTP loop runs on another, so that neither waits on the other:
requests join the running batch as they arrive (`Engine.events` over a live source), each one's text goes back to
its asyncio task as it is verified (a few rounds' at a time under load: `stream_rate`), a request whose client went
away is cancelled between rounds, and its pages go back at once. (The main thread: OpenMP teams started from a second
thread oversubscribe the cores, and libgomp then stops spinning between a pass's regions: the passes ran far slower.)"""

from __future__ import annotations

import asyncio
import io
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..engine.request import Finished, Request
from ..engine.scheduler import Emitted, Engine
from ..engine.stops import StopPrinter
from ..errors import one_line
from .openai import ApiError

# new text, never taken back (a tail that could begin a stop string is held); the answer; or the engine's failure (500)
Event = str | Finished | ApiError


@dataclass
class Ticket:
    """One request on its way: what the engine thread posts back to the request's task."""

    request: Request
    stream: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    printer: StopPrinter | None = None  # streaming: the text so far, cut as the engine cuts it
    buffer: io.StringIO = field(default_factory=io.StringIO)  # streaming: the printer's text not yet posted
    gone: bool = False  # its client went away
    held: list[int] = field(default_factory=list)  # streaming: tokens verified, not yet pushed to `printer`
    due: float = 0.0  # streaming: when its next event may go out (time.monotonic)


@dataclass
class Counters:
    """What /metrics tells, counted on the engine thread."""

    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    refused: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    proposed: int = 0
    accepted: int = 0
    passes: int = 0


class Worker:
    """`stream_rate`: server-sent events a second, at most, shared by the requests in flight (0: every round's). An
    event costs the server and its client about as much CPU as decoding a token, so under load a stream's tokens go
    out together every `requests / stream_rate` s (the first at once): a bounded share of engine time at any load."""

    def __init__(self, engine: Engine, decode: Callable[[list[int]], str], max_queue: int, stream_rate: float) -> None:
        self.engine, self.decode, self.max_queue = engine, decode, max_queue
        self.interval = 1.0 / stream_rate if stream_rate > 0 else 0.0  # a stream's events apart, times the requests
        self.inbox: queue.Queue[Ticket | None] = queue.Queue()
        self.tickets: dict[str | int, Ticket] = {}  # handed to the engine, not yet finished (engine thread only)
        self.queued = 0  # submitted, not yet handed to the engine
        self.counters = Counters()
        self.lock = threading.Lock()
        self.closing = False
        self.stopped = threading.Event()  # `run` has returned
        self.outbox: list[tuple[Ticket, Event]] = []  # events for the HTTP loop's tasks (`_post`)
        self.waking = False  # a `_deliver` is scheduled on the HTTP loop

    # the HTTP loop's side
    def submit(self, ticket: Ticket) -> None:
        with self.lock:
            if self.closing:
                raise ApiError(503, "the server is shutting down")
            if self.queued >= self.max_queue:
                self.counters.refused += 1
                raise ApiError(429, f"the queue is full ({self.max_queue} requests waiting): retry later")
            self.queued += 1
            ticket.printer = StopPrinter(self.decode, ticket.buffer, ticket.request.stop) if ticket.stream else None
            self.inbox.put(ticket)  # (under the lock: never after `close`'s end mark)

    def cancel(self, ticket: Ticket) -> None:
        """Its client went away: a request still queued is skipped, one decoding ends at the next round."""
        ticket.gone = True
        self.engine.cancel(ticket.request.id)

    def close(self, timeout: float | None = None) -> None:
        """No new request; those in flight finish, or are cancelled after `timeout` s."""
        with self.lock:
            if not self.closing:
                self.closing = True
                self.inbox.put(None)
        if not self.stopped.wait(timeout):
            for t in list(self.tickets.values()):
                self.engine.cancel(t.request.id)

    # the engine thread's side
    def _feed(self) -> Iterator[Request | None]:
        """The engine's live source: blocks while nothing is in flight, else hands over what is queued now."""
        while True:
            try:
                t = self.inbox.get(block=not self.tickets)
            except queue.Empty:
                yield None
                continue
            if t is None:
                return
            with self.lock:
                self.queued -= 1
            if t.gone:  # cancelled while queued: the engine never sees it
                self.counters.cancelled += 1
                continue
            self.tickets[t.request.id] = t
            self.counters.prompt_tokens += len(t.request.prompt)
            yield t.request

    def run(self) -> None:
        """The engine, until `close`. A fault in a pass fails the requests in flight, not the server."""
        try:
            while not self._run_engine():
                pass
        finally:
            self.stopped.set()

    def _run_engine(self) -> bool:
        """-> True once the inbox closed, False after a fault."""
        try:
            for event in self.engine.events(self._feed()):
                if isinstance(event, Emitted):
                    self._emitted(event)
                else:
                    self._finished(event)
        except Exception as e:  # the engine gave every page back on its way out (`Engine.events`)
            why = f"the engine failed: {type(e).__name__}: {one_line(str(e))}".rstrip(": ")
            for t in self.tickets.values():
                self.counters.failed += 1
                self._post(t, ApiError(500, why))
            self.tickets.clear()
            return False
        return True

    def _emitted(self, e: Emitted) -> None:
        t = self.tickets.get(e.request.id)
        if t is None or not e.tokens:
            return
        self.counters.generated_tokens += len(e.tokens)
        if t.printer is not None:
            t.held += e.tokens
            if (now := time.monotonic()) >= t.due:
                period = len(self.tickets) * self.interval  # every stream's events fall due together: one wake-up
                t.due = (now // period + 1) * period if period else 0.0
                t.printer.push(t.held)
                t.held = []
                self._post_text(t)

    def _finished(self, fin: Finished) -> None:
        t = self.tickets.pop(fin.request.id, None)
        if t is None:
            return
        st = fin.stats
        self.counters.passes += int(st.get("target_passes", 0))  # type: ignore[call-overload]
        if fin.reason == "cancelled":
            self.counters.cancelled += 1
            return
        self.counters.finished += 1
        self.counters.proposed += int(st["proposed"])  # type: ignore[call-overload]
        self.counters.accepted += int(st["accepted"])  # type: ignore[call-overload]
        if t.printer is not None:
            t.printer.push(t.held, final=True)
            self._post_text(t)
        self._post(t, fin)

    def _post_text(self, t: Ticket) -> None:
        if text := t.buffer.getvalue():
            t.buffer.seek(0)
            t.buffer.truncate()
            self._post(t, text)

    def _post(self, t: Ticket, event: Event) -> None:
        """Queue `event` for its task; one wake-up of the HTTP loop takes every event queued by then (a round's
        for every sequence, under load), not one wake-up an event."""
        if t.gone:
            return
        with self.lock:
            self.outbox.append((t, event))
            if self.waking:
                return
            self.waking = True
        try:
            t.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # its loop closed (the server is going down): nothing more to deliver there
            t.gone = True
            with self.lock:
                self.outbox.clear()
                self.waking = False

    def _deliver(self) -> None:
        """On the HTTP loop: the queued events to their tasks."""
        with self.lock:
            events, self.outbox, self.waking = self.outbox, [], False
        for t, event in events:
            t.events.put_nowait(event)
