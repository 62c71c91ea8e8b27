"""What keeps a client from starving `smallem serve` of connections: uvicorn's HTTP/1.1 protocol (httptools), guarded.
A request's line and headers must arrive within `header_timeout` s and MAX_HEAD_BYTES, its body within `body_timeout`
s of its headers, else the client gets a 408 (a 431) and its connection closes. Past `max_connections` open
connections a new one gets a 503 and is closed at once, unlogged. uvicorn's limits cover neither: `timeout_keep_alive`
times a connection idle between requests, `limit_concurrency` counts those whose headers came. The connections, with
an accept round's sockets (the listen backlog), stay below the file limit (`connection_room`): an accept never fails
for want of a descriptor, which asyncio would log again and again. (`trim_heap`: a model's load freed, given back.)"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import json
import os
import resource
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .. import defaults
from .openai import ApiError

MAX_HEAD_BYTES = 64 << 10  # a request's line and headers: a real one is a few hundred bytes
FD_RESERVE = 64  # descriptors kept for what the process opens besides its connections (the template sandbox's pipes)


@dataclass(frozen=True)
class Limits:
    max_connections: int = defaults.SERVE_MAX_CONNECTIONS
    header_timeout: float = defaults.SERVE_HEADER_TIMEOUT
    body_timeout: float = defaults.SERVE_BODY_TIMEOUT


def connection_room(backlog: int = defaults.SERVE_BACKLOG) -> int:
    """Connections this process can hold open: its file limit (the soft one raised to the hard one) less the files
    open now, `backlog` and FD_RESERVE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 10240)  # (macOS: no more than OPEN_MAX)
    with contextlib.suppress(ValueError, OSError):  # not allowed: the soft limit stays
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        soft = want
    open_now = FD_RESERVE  # where no listing tells
    for listing in ("/proc/self/fd", "/dev/fd"):  # Linux, macOS
        with contextlib.suppress(OSError):
            open_now = len(os.listdir(listing))
            break
    return soft - open_now - backlog - FD_RESERVE


def trim_heap() -> None:
    """glibc keeps the memory freed by small allocations for reuse: after a model's load (its tensors converted,
    the copies dropped) over a gigabyte of it, which a server would hold while idle. malloc_trim hands it back."""
    with contextlib.suppress(OSError, AttributeError, TypeError):  # not glibc (macOS, musl): nothing to do
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)


def response(status: int, message: str) -> bytes:
    """A whole HTTP response carrying `message` as an OpenAI error object; the connection closes after it."""
    body = json.dumps(ApiError(status, message).body()).encode()
    head = f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
    return f"{head}content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body


class GuardedHttp(HttpToolsProtocol):
    """uvicorn's protocol with the limits above (`protocol(limits)` makes one that holds them)."""

    limits: ClassVar[Limits] = Limits()
    refusal: ClassVar[bytes] = b""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timer: asyncio.TimerHandle | None = None
        self.head_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self.transport = transport  # closed, never counted among the connections: nothing else happens on it
            transport.write(self.refusal)
            transport.close()
            return
        super().connection_made(transport)
        self._arm(self.limits.header_timeout, "the request line and headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self.transport.is_closing():
            super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        """A request the parser refuses (uvicorn has logged a line): an error object too, then the close."""
        self.transport.write(response(400, msg))
        self.transport.close()

    # the parser's callbacks: what is parsed after a refusal, in the same data, is dropped
    def on_message_begin(self) -> None:
        self.head_bytes = 0
        if self.timer is None:  # the next request on a kept-alive connection
            self._arm(self.limits.header_timeout, "the request line and headers")
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        if self._counted(url):
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._counted(name + value):
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self.transport.is_closing():
            return
        self._disarm()
        super().on_headers_complete()
        if not self.pipeline:  # (a pipelined request's body waits while the one before it is answered)
            self._arm(self.limits.body_timeout, "the body", body=True)

    def on_body(self, body: bytes) -> None:
        if not self.transport.is_closing():
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self.transport.is_closing():
            self._disarm()
            super().on_message_complete()

    def _counted(self, part: bytes) -> bool:
        self.head_bytes += len(part)
        if self.head_bytes > MAX_HEAD_BYTES:
            self._fail(431, f"the request line and headers are larger than {MAX_HEAD_BYTES >> 10} KiB")
        return not self.transport.is_closing()

    def _arm(self, seconds: float, what: str, body: bool = False) -> None:
        self._disarm()
        self.timer = self.loop.call_later(seconds, self._fail, 408, f"{what} did not arrive within {seconds:g} s", body)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _fail(self, status: int, message: str, body: bool = False) -> None:
        """Answer `status` where nothing was answered to this request, nor is being answered on the connection,
        and close it; the request's task, if one runs, sees its client gone (its reads end, its writes go nowhere).
        In its headers, the request has no `cycle` yet: `self.cycle` is the one before (None, or answered)."""
        if self.transport.is_closing():
            return
        cycle = self.cycle
        unanswered = (not cycle.response_started) if body else (cycle is None or cycle.response_complete)
        if unanswered:
            self.transport.write(response(status, message))
        self.transport.close()
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()


def protocol(limits: Limits) -> type[GuardedHttp]:
    """The protocol class uvicorn builds each connection's protocol from (`uvicorn.Config(http=...)`)."""
    refusal = response(503, f"the server has {limits.max_connections} connections open: retry later")
    return type("GuardedHttp", (GuardedHttp,), {"limits": limits, "refusal": refusal})
