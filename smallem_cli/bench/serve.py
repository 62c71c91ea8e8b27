"""`smallem bench --serve --clients 1,8,32`: a server measured as its users see it. C clients, each a loop of
streamed requests (answers of exactly max_tokens: `ignore_eos`), keep C requests in flight; per row: requests/s,
tokens/s, time to first token and the gaps between streamed chunks (p50, p99). A server already running (`--url`),
or `smallem serve` started for each proposer on a free port, and `vllm serve` beside them (`--peer vllm`)."""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from ..interop.vllm_peer import stop
from ..options import shown
from .run import right_table

if TYPE_CHECKING:  # the `serve` extra: imported where a bench runs, not to parse the command
    import httpx

START_S = 600  # a server's start (its native build the first time) at most
# What a server may send for one streamed answer, at most: one that streams without end (or garbage) is an error,
# never an answer. Events: a chunk per token at most (OpenAI's servers), the usage and a few empty ones besides.
ANSWER_S = 600.0
ANSWER_BYTES = 8 << 20
EXTRA_EVENTS = 16
SMALL_BYTES = 1 << 20  # /v1/models, /metrics and an error's body: read this much at most
PLAIN = {"Accept-Encoding": "identity"}  # the bytes counted are the bytes sent: no compressed body to expand
RUN = "import sys; sys.argv[0] = 'smallem'; from smallem_cli.cli import main; main()"


@dataclass
class ServeRow:
    server: str  # the proposer, or the URL
    mode: str
    clients: int
    requests: int
    tokens: int
    wall_s: float
    requests_per_s: float
    tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float  # between streamed chunks (a chunk: a round's verified tokens)
    itl_p99_s: float
    acceptance: float | None  # from the server's /metrics, where it has smallem's
    identical: str  # greedy: answers equal to the first row's of the same prompt


@dataclass
class _Answer:
    prompt: int
    text: str
    tokens: int
    ttft_s: float
    gaps: list[float]


class ServerError(RuntimeError):
    """The server did not start, or answered a request with an error: one line."""


@contextmanager
def started(args: list[str]) -> Iterator[str]:
    """`smallem serve ARGS --port 0` in a process of its own -> its URL; SIGTERM at the end (`stop`)."""
    argv = [sys.executable, "-c", RUN, "serve", "--port", "0", "-q", *args]
    p = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    assert p.stderr is not None
    try:
        lines, deadline = [], time.monotonic() + START_S
        while (line := p.stderr.readline()) and time.monotonic() < deadline:
            lines.append(line)
            if m := re.search(r"on (http://\S+) ", line):
                break
        else:
            raise ServerError(f"smallem serve did not start: {''.join(lines[-3:]).strip() or 'no output'}")
        yield m.group(1)
    finally:
        stop(p)


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[round(q * (len(s) - 1))] if s else 0.0


async def _data(r: httpx.Response, max_events: int) -> AsyncIterator[str]:
    """The `data:` fields of a server-sent event stream, up to `data: [DONE]`; ServerError for a line that is no
    event field, a stream past ANSWER_BYTES or `max_events`, or one that ends without [DONE]."""
    buf, seen, events = bytearray(), 0, 0
    async for chunk in r.aiter_raw():
        seen += len(chunk)
        if seen > ANSWER_BYTES:
            raise ServerError(f"the server streamed more than {ANSWER_BYTES >> 20} MiB for one answer")
        buf += chunk
        if b"\n" not in chunk:
            continue
        *lines, rest = buf.split(b"\n")
        buf = bytearray(rest)
        for raw in lines:
            try:
                line = raw.removesuffix(b"\r").decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("utf-8", "replace")
                raise ServerError(f"the server streamed bytes that are not UTF-8: {shown(text)}") from None
            field, colon, value = line.partition(":")
            if not line or field == "" or (field in ("event", "id", "retry") and colon):  # a comment is ": ..."
                continue
            if field != "data" or not colon:
                raise ServerError(f"the server streamed a line that is no server-sent event: {shown(line)}")
            value = value.removeprefix(" ")
            if value == "[DONE]":
                return
            if (events := events + 1) > max_events:
                raise ServerError(f"the server streamed more than {max_events} events for one answer")
            yield value
    raise ServerError("the server's stream ended without `data: [DONE]`")


def _event(data: str, max_tokens: int) -> tuple[str, int | None]:
    """A streamed completion event (its JSON) -> its text, and its usage's completion tokens (None: none told)."""
    try:
        event = json.loads(data)
    except (ValueError, RecursionError):
        raise ServerError(f"the server streamed an event that is not JSON: {shown(data)}") from None
    if not isinstance(event, dict):
        raise ServerError(f"the server streamed an event that is not a JSON object: {shown(event)}")
    if "error" in event:
        raise ServerError(f"the server streamed an error: {shown(event['error'], 200)}")
    choices = event.get("choices", [])
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise ServerError(f'the server streamed "choices" that are not a list of objects: {shown(choices)}')
    texts = [c.get("text", "") for c in choices]
    if bad := [t for t in texts if not isinstance(t, str)]:
        raise ServerError(f'the server streamed a choice whose "text" is not a string: {shown(bad[0])}')
    if (usage := event.get("usage")) is None:
        return "".join(texts), None
    n = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if type(n) is not int or not 0 <= n <= max_tokens:
        raise ServerError(
            f'the server streamed a "usage" whose completion_tokens is not a count of 0..{max_tokens}: {shown(usage)}'
        )
    return "".join(texts), n


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, object], prompt: int) -> _Answer:
    """One streamed request, every event checked (`_data`, `_event`), ANSWER_S at most; ServerError for any fault."""
    try:
        return await asyncio.wait_for(_streamed(client, url, body, prompt), ANSWER_S)
    except asyncio.TimeoutError:
        raise ServerError(f"one streamed answer took more than {ANSWER_S:.0f} s") from None


async def _streamed(client: httpx.AsyncClient, url: str, body: dict[str, object], prompt: int) -> _Answer:
    max_tokens = body["max_tokens"]
    assert isinstance(max_tokens, int)
    t0 = time.perf_counter()
    stamps, parts, tokens = [], [], None  # when each chunk of text came, and what it said
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            head = b""
            async for chunk in r.aiter_raw():  # the start of the error's body: the rest is not awaited
                if len(head := head + chunk) >= 200:
                    break
            raise ServerError(f"the server answered {r.status_code}: {head[:200].decode('utf-8', 'replace')}")
        async for data in _data(r, max_tokens + EXTRA_EVENTS):
            text, told = _event(data, max_tokens)
            tokens = told if told is not None else tokens
            if text:
                stamps.append(time.perf_counter())
                parts.append(text)
    if not parts and not tokens:  # nothing to time, nor to compare
        raise ServerError("the server streamed an answer with no text and no token count")
    gaps = [b - a for a, b in pairwise(stamps)]
    return _Answer(prompt, "".join(parts), tokens or 0, stamps[0] - t0 if stamps else 0.0, gaps)


async def _load(url: str, model: str | None, prompts: list[list[int]], clients: int, requests: int,
                body: dict[str, object]) -> tuple[float, list[_Answer]]:  # fmt: skip
    """`clients` loops share `requests` requests (prompts in turn) -> (wall seconds, answers)."""
    import httpx

    todo = iter(range(requests))
    answers: list[_Answer] = []
    extra = {"model": model} if model else {}

    async def loop(client: httpx.AsyncClient) -> None:
        for i in todo:
            p = i % len(prompts)
            answers.append(await _one(client, url, body | extra | {"prompt": prompts[p]}, p))

    limits = httpx.Limits(max_connections=clients + 4)
    timeout = httpx.Timeout(ANSWER_S, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=PLAIN) as client:
        await _one(client, url, body | extra | {"prompt": prompts[0], "max_tokens": 4}, 0)  # warm
        t0 = time.perf_counter()
        await asyncio.gather(*(loop(client) for _ in range(clients)))
        return time.perf_counter() - t0, answers


def _small_get(url: str, timeout: float) -> tuple[int, bytes]:
    """A GET's status and its body, SMALL_BYTES at most (the rest is not awaited)."""
    import httpx

    got = b""
    with httpx.stream("GET", url, timeout=timeout, headers=PLAIN) as r:
        for chunk in r.iter_raw():
            if len(got := got + chunk) > SMALL_BYTES:
                break
    return r.status_code, got[: SMALL_BYTES + 1]


def served_model(url: str) -> str:
    """The first model a server lists (/v1/models)."""
    import httpx

    try:
        status, body = _small_get(url + "/v1/models", 30)
        name = json.loads(body)["data"][0]["id"] if status == 200 and len(body) <= SMALL_BYTES else None
    except (httpx.HTTPError, ValueError, RecursionError, KeyError, IndexError, TypeError) as e:
        raise ServerError(f"{url}/v1/models: no model listed ({type(e).__name__}: {e})") from None
    if not isinstance(name, str) or not name:
        raise ServerError(f"{url}/v1/models: no model listed (answered {status}): give --model")
    return name


def acceptance(url: str) -> tuple[int, int] | None:
    """(accepted, proposed) draft tokens from a smallem server's /metrics; None from another server."""
    import httpx

    try:
        status, body = _small_get(url + "/metrics", 10)
    except httpx.HTTPError:
        return None
    text = body.decode("utf-8", "replace") if status == 200 else ""
    got = dict(re.findall(r"^smallem_(accepted_tokens_total|draft_tokens_total) (\d+)", text, re.M))
    return (int(got["accepted_tokens_total"]), int(got["draft_tokens_total"])) if len(got) == 2 else None


def measure(url: str, server: str, model: str | None, prompts: list[list[int]], clients: list[int],
            per_client: int, max_tokens: int, modes: dict[str, dict[str, object]],
            reference: dict[int, str]) -> list[ServeRow]:  # fmt: skip
    """One server's rows: each mode (its sampling fields) at each client count."""
    import httpx

    rows = []
    for mode, sampling in modes.items():
        for c in clients:
            body = {"max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}} | sampling  # fmt: skip
            before = acceptance(url)
            try:
                wall, answers = asyncio.run(_load(url, model, prompts, c, c * per_client, body))
            except httpx.HTTPError as e:
                raise ServerError(f"{url}: {type(e).__name__}: {e}") from None
            after = acceptance(url)
            rate = None
            if before and after and after[1] > before[1]:
                rate = (after[0] - before[0]) / (after[1] - before[1])
            same = "-"
            if mode == "greedy":
                for a in answers:
                    reference.setdefault(a.prompt, a.text)
                same = f"{sum(reference[a.prompt] == a.text for a in answers)}/{len(answers)}"
            ttft = [a.ttft_s for a in answers]
            gaps = [g for a in answers for g in a.gaps]
            tokens = sum(a.tokens for a in answers)
            rows.append(ServeRow(
                server, mode, c, len(answers), tokens, wall, len(answers) / wall, tokens / wall,
                statistics.median(ttft), percentile(ttft, 0.99), percentile(gaps, 0.5), percentile(gaps, 0.99),
                rate, same,
            ))  # fmt: skip
    return rows


def table(rows: list[ServeRow], max_tokens: int) -> Table:
    title = f"served: streamed requests of {max_tokens} tokens, C clients each keeping one in flight"
    cols = ("server", "mode", "clients", "requests", "req/s", "tok/s", "TTFT p50 ms", "TTFT p99 ms")
    t = right_table(title, (*cols, "ITL p50 ms", "ITL p99 ms", "acceptance", "identical"), "server")
    for r in rows:
        t.add_row(
            r.server, r.mode, str(r.clients), str(r.requests), f"{r.requests_per_s:.2f}", f"{r.tokens_per_s:.1f}",
            f"{1e3 * r.ttft_p50_s:.0f}", f"{1e3 * r.ttft_p99_s:.0f}", f"{1e3 * r.itl_p50_s:.1f}",
            f"{1e3 * r.itl_p99_s:.1f}", "-" if r.acceptance is None else f"{r.acceptance:.2f}", r.identical,
        )  # fmt: skip
    return t


@contextmanager
def vllm_served(checkpoint: Path, tokenizer: Path, threads: int) -> Iterator[tuple[str, str]]:
    """`vllm serve` (its venv: `make vllm-venv`) on the target exported as an HF folder -> (its URL, its model)."""
    from ..interop import vllm_peer
    from ..interop.hf import export_hf

    python = vllm_peer.find_python()
    with tempfile.TemporaryDirectory(prefix="smallem-vllm-") as tmp:
        hf = Path(tmp) / "target"
        export_hf(checkpoint, hf, tokenizer)
        with vllm_peer.serving(python, hf, None, vllm_peer.vllm_env(python, threads), Path(tmp) / "serve.log") as url:
            yield url, str(hf)


def from_cli(target: str, names: list[str], url: str | None, model: str | None, prompts: list[list[int]],
             clients: list[int], per_client: int, max_tokens: int, modes: dict[str, dict[str, object]],
             serve_args: list[str], vllm: tuple[Path, Path, int] | None = None) -> list[ServeRow]:  # fmt: skip
    """`smallem bench --serve`: the server at `url`, else `smallem serve` with the target alone, then each proposer,
    then (`vllm`: the checkpoint, its tokenizer, threads) `vllm serve` on the same weights."""
    reference: dict[int, str] = {}
    if url is not None:
        url = url.rstrip("/")
        return measure(url, url, model or served_model(url), prompts, clients, per_client, max_tokens, modes, reference)
    rows = []
    for name in dict.fromkeys(["none", *names]):
        args = ["--target", target, "--proposer", name, "--max-batch", str(max(clients)), *serve_args]
        with started(args) as at:
            rows += measure(at, name, None, prompts, clients, per_client, max_tokens, modes, reference)
    if vllm is not None:
        with vllm_served(*vllm) as (at, served):
            rows += measure(at, "vllm serve", served, prompts, clients, per_client, max_tokens, modes, reference)
    return rows
