"""The HTTP side of `smallem serve` (Starlette): OpenAI's routes, /health and /metrics. A few threads read a request
(`openai.read_job`: JSON, the template, the tokenizer), the engine (`Worker`, on another thread) answers it, and its
handler awaits the events: the loop never runs a pass, nor a template. A client that goes away cancels its request;
nothing a request holds can take the server down. Every error, Starlette's too, is an OpenAI error object."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..engine.request import Finished
from . import openai as api
from .worker import Ticket, Worker

MAX_BODY_BYTES = 8 << 20  # a request's body at most: a prompt longer than any context is refused before it is read
# the bodies held at once, read or waiting for a thread, all connections together: the memory they take is bounded
MAX_BODIES_BYTES = 32 * MAX_BODY_BYTES
# threads that read requests (`openai.read_job`): JSON, a template (its sandbox waited on), the tokenizer (which lets
# go of the GIL); few, so that the memory the requests being tokenized take at once stays bounded
READ_THREADS = 2


def create_app(worker: Worker, served: api.Served, api_key: str | None = None) -> ASGIApp:
    arrival = itertools.count()  # Request.index
    readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="smallem-read")
    bodies = _Bodies(MAX_BODIES_BYTES)

    async def complete(http: HttpRequest) -> Response:
        chat = http.url.path.endswith("/chat/completions")
        loop = asyncio.get_running_loop()
        try:
            raw = await bodies.read(http)
            try:
                job = await loop.run_in_executor(readers, api.read_job, raw, served, chat, next(arrival))
            finally:
                bodies.give(len(raw))
            ticket = Ticket(job.request, job.stream, loop)
            worker.submit(ticket)
        except api.ApiError as e:  # (the worker's refusals too: a full queue, a server shutting down)
            return _error(e)
        except ClientDisconnect:  # gone before its body came: nobody reads an answer, nothing to log
            return Response(status_code=499)
        if job.stream:
            return StreamingResponse(_stream(ticket, job), media_type="text/event-stream")
        return await _whole(http, ticket, job)

    async def _whole(http: HttpRequest, ticket: Ticket, job: api.Job) -> Response:
        answer = asyncio.ensure_future(ticket.events.get())  # the answer or an error: a whole answer gets no text
        gone = asyncio.ensure_future(_disconnected(http))
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not answer.done():  # the client went away (or the server is stopping it)
                answer.cancel()
                worker.cancel(ticket)
        if not answer.done() or answer.cancelled():
            return Response(status_code=499)  # nobody reads it
        end = answer.result()
        if isinstance(end, api.ApiError):
            return _error(end)
        assert isinstance(end, Finished)
        return JSONResponse(api.whole(job, served.model, end))

    async def _stream(ticket: Ticket, job: api.Job) -> AsyncIterator[str]:
        """Server-sent events; closed early (the client went away), the request is cancelled. The chunks that
        wait when the loop comes round go out as one (under load: fewer, larger writes)."""
        finished = False
        try:
            if job.chat:
                yield api.chunk(job, served.model, None)
            while not finished:
                events = [await ticket.events.get()]
                while not ticket.events.empty():
                    events.append(ticket.events.get_nowait())
                text = "".join(e for e in events if isinstance(e, str))
                out = [api.chunk(job, served.model, text)] if text else []
                if not isinstance(end := events[-1], str):
                    finished = True
                    if isinstance(end, api.ApiError):
                        out.append(api.event(end.body()))
                    else:
                        out.append(api.chunk(job, served.model, "" if job.chat else None, end.reason))
                        if job.include_usage:
                            out.append(api.usage_chunk(job, served.model, end))
                        out.append(api.event("[DONE]"))
                if out:
                    yield "".join(out)
        finally:
            if not finished:
                worker.cancel(ticket)

    async def models(http: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [api.model_card(served)]})

    async def model(http: HttpRequest) -> Response:
        if (name := http.path_params["name"]) != served.model:
            why = f"unknown model {name!r}: this server has {served.model!r}"
            return _error(api.ApiError(404, why, "model", "model_not_found"))
        return JSONResponse(api.model_card(served))

    async def health(http: HttpRequest) -> Response:
        if worker.closing or worker.stopped.is_set():
            return JSONResponse({"status": "stopping"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(http: HttpRequest) -> Response:
        return PlainTextResponse(prometheus(worker), media_type="text/plain; version=0.0.4")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        readers.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(worker.close)  # the HTTP side drained: the engine ends what is left

    routes = [
        Route("/v1/completions", complete, methods=["POST"]),
        Route("/v1/chat/completions", complete, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    errors = dict.fromkeys((HTTPException, Exception), _error_object)
    return _Edge(Starlette(routes=routes, lifespan=lifespan, exception_handlers=errors), api_key)


class _Bodies:
    """The bytes of the bodies held at once, all connections together: `read` takes them, its caller `give`s back."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held = limit, 0

    async def read(self, http: HttpRequest) -> bytes:
        """The body, refused (413) past MAX_BODY_BYTES without reading the rest, or (503) past `limit`."""
        too_large = f"the body is larger than {MAX_BODY_BYTES >> 20} MiB"
        if (size := http.headers.get("content-length", "")).isdigit() and int(size) > MAX_BODY_BYTES:
            raise api.ApiError(413, too_large)
        chunks, n = [], 0
        try:
            async for part in http.stream():
                if self.held + len(part) > self.limit:
                    raise api.ApiError(503, "the server is reading too many large requests at once: retry later")
                self.held += len(part)
                n += len(part)
                if n > MAX_BODY_BYTES:
                    raise api.ApiError(413, too_large)
                chunks.append(part)
        except BaseException:
            self.give(n)
            raise
        return b"".join(chunks)

    def give(self, n: int) -> None:
        self.held -= n


async def _disconnected(http: HttpRequest) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _error(e: api.ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _error_object(http: HttpRequest, e: Exception) -> Response:
    """Starlette's own errors (an unknown route, a wrong method) and the server's faults (logged) as error objects."""
    if not isinstance(e, HTTPException):
        return _error(api.ApiError(500, f"the server failed: {type(e).__name__}"))
    where = f"{http.method} {http.url.path}"
    why = {404: f"no route for {where}", 405: f"{where}: the method is not allowed"}.get(e.status_code, e.detail)
    return _error(api.ApiError(e.status_code, why), e.headers)  # (a 405's Allow header kept)


class _Edge:
    """What each request meets first. A trailing slash is dropped: `/v1/completions/` is `/v1/completions` (not
    Starlette's redirect, which a POST does not follow). With --api-key, /v1/ routes answer 401 to a request without
    `Authorization: Bearer <key>`. An answer cancelled by the end of a drain (SIGTERM's --drain seconds passed) ends
    as an error object, or a stream's error event, not as a traceback in the log."""

    def __init__(self, app: ASGIApp, key: str | None) -> None:
        self.app, self.key = app, None if key is None else f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if len(path := scope["path"]) > 1 and path.endswith("/"):
            scope = dict(scope, path=path.rstrip("/") or "/")
        if self.key is not None and scope["path"].startswith("/v1/"):
            if not hmac.compare_digest(dict(scope["headers"]).get(b"authorization", b""), self.key):
                refusal = _error(api.ApiError(401, "a valid API key is needed: Authorization: Bearer <key>"))
                await refusal(scope, receive, send)
                return
        started: list[bytes] = []  # the response's content type, once it started

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                started.append(dict(message.get("headers", [])).get(b"content-type", b""))
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            end = api.ApiError(503, "the server is stopping: the answer was cancelled")
            with contextlib.suppress(asyncio.CancelledError, OSError, RuntimeError):  # the connection may be gone too
                if not started:
                    await _error(end)(scope, receive, send)
                elif started[0].startswith(b"text/event-stream"):
                    await send({"type": "http.response.body", "body": api.event(end.body()).encode()})


def prometheus(worker: Worker) -> str:
    c, pool = worker.counters, worker.engine.pool
    running, waiting = worker.engine.live
    rate = c.accepted / c.proposed if c.proposed else 0.0
    rows = [
        ("requests_running", "gauge", "requests decoding now", len(running)),
        ("requests_waiting", "gauge", "requests queued for a place in the batch", len(waiting) + worker.queued),
        ("requests_finished_total", "counter", "requests answered", c.finished),
        ("requests_cancelled_total", "counter", "requests whose client went away", c.cancelled),
        ("requests_failed_total", "counter", "requests the engine failed", c.failed),
        ("requests_refused_total", "counter", "requests refused with 429 (queue full)", c.refused),
        ("prompt_tokens_total", "counter", "prompt tokens prefilled", c.prompt_tokens),
        ("generation_tokens_total", "counter", "tokens generated", c.generated_tokens),
        ("target_passes_total", "counter", "target passes (prefills and verification rounds)", c.passes),
        ("draft_tokens_total", "counter", "draft tokens proposed (finished requests)", c.proposed),
        ("accepted_tokens_total", "counter", "draft tokens accepted (finished requests)", c.accepted),
        ("acceptance_rate", "gauge", "accepted / proposed draft tokens", round(rate, 4)),
        ("kv_pages_free", "gauge", "free pages of the KV cache pool", len(pool.free)),
        ("kv_pages_total", "gauge", "pages of the KV cache pool", pool.n_pages),
    ]
    out = []
    for name, kind, about, value in rows:
        out += [f"# HELP smallem_{name} {about}", f"# TYPE smallem_{name} {kind}", f"smallem_{name} {value}"]
    return "\n".join(out) + "\n"
