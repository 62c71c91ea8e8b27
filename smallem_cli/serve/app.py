"""The HTTP side of `smallem serve` (Starlette): OpenAI's routes, /health and /metrics. Every handler only parses,
hands the request to the engine (`Worker`, on another thread) and awaits its events: the loop never runs a pass.
A client that goes away cancels its request; nothing a request holds can take the server down."""

from __future__ import annotations

import asyncio
import hmac
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..engine.request import Request
from . import openai as api
from .worker import Chunk, Done, Failed, Refused, Ticket, Worker

MAX_BODY_BYTES = 8 << 20  # a request's body at most: a prompt longer than any context is refused before it is read


def create_app(worker: Worker, served: api.Served, api_key: str | None = None) -> Starlette:
    arrival = itertools.count()  # Request.index

    async def completions(http: HttpRequest) -> Response:
        return await _complete(http, chat=False)

    async def chat_completions(http: HttpRequest) -> Response:
        return await _complete(http, chat=True)

    async def _complete(http: HttpRequest, chat: bool) -> Response:
        try:
            job = api.parse(api.read_body(await _body(http)), served, chat)
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
        card = {"id": served.model, "object": "model", "created": 0, "owned_by": "smallem"}
        return JSONResponse({"object": "list", "data": [card | {"max_model_len": served.max_len}]})

    async def health(http: HttpRequest) -> Response:
        if worker.closing or worker.stopped.is_set():
            return JSONResponse({"status": "stopping"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(http: HttpRequest) -> Response:
        return PlainTextResponse(prometheus(worker), media_type="text/plain; version=0.0.4")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(worker.close)  # the HTTP side drained: the engine ends what is left

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    if api_key is not None:
        app.add_middleware(_BearerKey, key=api_key)  # type: ignore[arg-type]
    return app


async def _body(http: HttpRequest) -> bytes:
    """The body, refused (413) past MAX_BODY_BYTES without reading the rest."""
    if (size := http.headers.get("content-length", "")).isdigit() and int(size) > MAX_BODY_BYTES:
        raise api.ApiError(413, f"the body is larger than {MAX_BODY_BYTES >> 20} MiB")
    chunks, n = [], 0
    async for part in http.stream():
        n += len(part)
        if n > MAX_BODY_BYTES:
            raise api.ApiError(413, f"the body is larger than {MAX_BODY_BYTES >> 20} MiB")
        chunks.append(part)
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


def _error(e: api.ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


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
