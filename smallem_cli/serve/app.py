"""The HTTP side of `smallem serve` (Starlette): OpenAI's routes, /health and /metrics. A handler reads the body, has
a small pool of threads turn it into a request (JSON, the chat template, the tokenizer: `openai.read_job`), hands
that to the engine (`Worker`, on another thread) and awaits its events: the loop never runs a pass, nor a template.
A client that goes away cancels its request; nothing a request holds can take the server down. Every error is an
OpenAI error object, Starlette's own (404, 405, 500) too."""

from __future__ import annotations

import asyncio
import hmac
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..engine.request import Request
from . import openai as api
from .worker import Chunk, Done, Failed, Refused, Ticket, Worker

MAX_BODY_BYTES = 8 << 20  # a request's body at most: a prompt longer than any context is refused before it is read
# the bodies held at once, read or waiting for a thread, all connections together: the memory they take is bounded
MAX_BODIES_BYTES = 32 * MAX_BODY_BYTES
# threads that read requests (`openai.read_job`): JSON, a template (its sandbox waited on), the tokenizer (which lets
# go of the GIL); few, so that the memory the requests being tokenized take at once stays bounded
READ_THREADS = 2


def create_app(worker: Worker, served: api.Served, api_key: str | None = None) -> ASGIApp:
    arrival = itertools.count()  # Request.index
    readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="smallem-read")
    bodies = _Bytes(MAX_BODIES_BYTES)

    async def completions(http: HttpRequest) -> Response:
        return await _complete(http, chat=False)

    async def chat_completions(http: HttpRequest) -> Response:
        return await _complete(http, chat=True)

    async def _complete(http: HttpRequest, chat: bool) -> Response:
        held = 0
        try:
            raw = await _body(http, bodies)
            held = len(raw)
            job = await asyncio.get_running_loop().run_in_executor(readers, api.read_job, raw, served, chat)
            bodies.give(held)
            held = 0
            rid = api.new_id(chat)
            request = Request(
                next(arrival), rid, job.ids, job.max_new_tokens, job.sampling, job.stop, ignore_eos=job.ignore_eos
            )
            ticket = Ticket(request, job.stream, asyncio.get_running_loop())
            worker.submit(ticket)
        except api.ApiError as e:
            return _error(e)
        except Refused as e:
            return _error(api.ApiError(e.status, str(e)))
        except ClientDisconnect:  # gone before its body came: nobody reads an answer, nothing to log
            return Response(status_code=499)
        finally:
            bodies.give(held)
        if job.stream:
            return StreamingResponse(_stream(ticket, job, rid), media_type="text/event-stream")
        return await _whole(http, ticket, job, rid)

    async def _whole(http: HttpRequest, ticket: Ticket, job: api.Job, rid: str) -> Response:
        answer = asyncio.ensure_future(_last(ticket))
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
        if isinstance(end, Failed):
            return _error(api.ApiError(500, end.message))
        return JSONResponse(api.whole(rid, job, served.model, end.text, len(end.tokens), end.finish_reason, end.stats))

    async def _stream(ticket: Ticket, job: api.Job, rid: str) -> AsyncIterator[str]:
        """Server-sent events; closed early (the client went away), the request is cancelled. The chunks that
        wait when the loop comes round go out as one (under load: fewer, larger writes)."""
        finished = False
        try:
            if job.chat:
                yield api.chunk(rid, job, served.model, None)
            while not finished:
                events = [await ticket.events.get()]
                while not ticket.events.empty():
                    events.append(ticket.events.get_nowait())
                out = [api.chunk(rid, job, served.model, text)] if (text := _text(events)) else []
                if (end := events[-1]) and not isinstance(end, Chunk):
                    finished = True
                    if isinstance(end, Failed):
                        out.append(api.event(api.ApiError(500, end.message).body()))
                    else:
                        out.append(api.chunk(rid, job, served.model, "" if job.chat else None, end.finish_reason))
                        if job.include_usage:
                            out.append(api.usage_chunk(rid, job, served.model, len(end.tokens), end.stats))
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
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    errors = {HTTPException: _http_error, Exception: _server_error}
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=errors)  # type: ignore[arg-type]
    if api_key is not None:
        app.add_middleware(_BearerKey, key=api_key)  # type: ignore[arg-type]
    return _Edge(app)


class _Bytes:
    """A budget of bytes shared by the requests on the loop: `take` refuses (503) past it, `give` returns."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held = limit, 0

    def take(self, n: int) -> None:
        if self.held + n > self.limit:
            raise api.ApiError(503, "the server is reading too many large requests at once: retry later")
        self.held += n

    def give(self, n: int) -> None:
        self.held -= n


async def _body(http: HttpRequest, budget: _Bytes) -> bytes:
    """The body, refused (413) past MAX_BODY_BYTES without reading the rest, or (503) past the budget; what it
    holds is taken from `budget`, to be given back by the caller once the body is read into a request."""
    if (size := http.headers.get("content-length", "")).isdigit() and int(size) > MAX_BODY_BYTES:
        raise api.ApiError(413, f"the body is larger than {MAX_BODY_BYTES >> 20} MiB")
    chunks, n = [], 0
    try:
        async for part in http.stream():
            budget.take(len(part))
            n += len(part)
            if n > MAX_BODY_BYTES:
                raise api.ApiError(413, f"the body is larger than {MAX_BODY_BYTES >> 20} MiB")
            chunks.append(part)
    except BaseException:
        budget.give(n)
        raise
    return b"".join(chunks)


def _text(events: list[Chunk | Done | Failed]) -> str:
    return "".join(e.text for e in events if isinstance(e, Chunk))


async def _last(ticket: Ticket) -> Done | Failed:
    while not isinstance(event := await ticket.events.get(), Done | Failed):
        pass
    return event


async def _disconnected(http: HttpRequest) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _error(e: api.ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _http_error(http: HttpRequest, e: Exception) -> Response:
    """Starlette's own errors (an unknown route, a wrong method) as error objects."""
    assert isinstance(e, HTTPException)
    where = f"{http.method} {http.url.path}"
    why = {404: f"no route for {where}", 405: f"{where}: the method is not allowed"}.get(e.status_code, e.detail)
    return _error(api.ApiError(e.status_code, why), e.headers)  # (a 405's Allow header kept)


async def _server_error(http: HttpRequest, e: Exception) -> Response:
    """A fault of the server's own: an error object to the client (the traceback goes to the log, for a bug)."""
    return _error(api.ApiError(500, f"the server failed: {type(e).__name__}"))


class _Edge:
    """What each request meets first. A trailing slash is dropped: `/v1/completions/` is `/v1/completions` (not
    Starlette's redirect, which a POST does not follow). An answer cancelled by the end of a drain (SIGTERM's
    --drain seconds passed) ends as an error object, or a stream's error event, not as a traceback in the log."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if len(path := scope["path"]) > 1 and path.endswith("/"):
            scope = dict(scope, path=path.rstrip("/") or "/")
        started: list[bytes] = []  # the response's content type, once it started

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                started.append(dict(message.get("headers", [])).get(b"content-type", b""))
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            end = api.ApiError(503, "the server is stopping: the answer was cancelled")
            try:
                if not started:
                    await _error(end)(scope, receive, send)
                elif started[0].startswith(b"text/event-stream"):
                    await send({"type": "http.response.body", "body": api.event(end.body()).encode()})
            except (asyncio.CancelledError, OSError, RuntimeError):  # the connection is gone too: nothing to tell
                pass


class _BearerKey:
    """With --api-key: /v1/ routes answer 401 to a request without `Authorization: Bearer <key>`."""

    def __init__(self, app: Callable[..., Awaitable[None]], key: str) -> None:
        self.app, self.key = app, f"Bearer {key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:  # type: ignore[type-arg]
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.key):
                await _error(api.ApiError(401, "a valid API key is needed: Authorization: Bearer <key>"))(
                    scope, receive, send
                )
                return
        await self.app(scope, receive, send)


def prometheus(worker: Worker) -> str:
    """The server's state in Prometheus' text format."""
    c, g = worker.counters, worker.gauges()
    rate = c.accepted / c.proposed if c.proposed else 0.0
    rows = [
        ("requests_running", "gauge", "requests decoding now", g["running"]),
        ("requests_waiting", "gauge", "requests queued for a place in the batch", g["waiting"]),
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
        ("kv_pages_free", "gauge", "free pages of the KV cache pool", g["pages_free"]),
        ("kv_pages_total", "gauge", "pages of the KV cache pool", g["pages_total"]),
    ]
    out = []
    for name, kind, about, value in rows:
        out += [f"# HELP smallem_{name} {about}", f"# TYPE smallem_{name} {kind}", f"smallem_{name} {value}"]
    return "\n".join(out) + "\n"
