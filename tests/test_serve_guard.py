"""`smallem serve` against clients that attack it, as they and its operator see it: half-sent requests time out
(408), connections past the limit (or past what the file limit allows) are refused at once, without a log storm;
a hostile chat template or a prompt of megabytes gets a 400 while /health answers within a second and memory
stays bounded; every error is an OpenAI error object; a client gone mid-body and a drain that runs out log no
traceback."""

from __future__ import annotations

import functools
import json
import re
import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import Family
from test_chat import hf_dir  # noqa: F401  (the fixture)
from test_serve import SHIPPED, WAIT_S, Server, error_of

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")


def rss(pid: int) -> int:
    """A process's resident memory, bytes."""
    return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1)) * 1024  # type: ignore[union-attr]


def during(attack: Callable[[], object], s: Server) -> tuple[object, float, int]:
    """`attack` run on a thread while /health is asked, one request after another, on fresh connections -> what the
    attack returned, the slowest /health (s), and the server's largest RSS growth seen meanwhile (bytes)."""
    idle, got, slowest, grown = rss(s.p.pid), [], 0.0, 0
    t = threading.Thread(target=lambda: got.append(attack()))
    t.start()
    while t.is_alive() or not slowest:
        t0 = time.monotonic()
        assert httpx.get(s.url + "/health", timeout=10).json() == {"status": "ok"}
        slowest, grown = max(slowest, time.monotonic() - t0), max(grown, rss(s.p.pid) - idle)
        time.sleep(0.05)
    t.join()
    return got[0], slowest, grown


def at_once(s: Server, path: str, body: object, clients: int) -> list[httpx.Response]:
    """`clients` requests of `body` at once -> their answers."""
    out: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: out.append(s.post(path, body))) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def connect(s: Server, data: bytes = b"") -> socket.socket:
    host, port = s.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(data)
    return sock


def answer(sock: socket.socket) -> bytes:
    """Everything the server sends before it closes the connection."""
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    sock.close()
    return got


def error_message(raw: bytes, status: int) -> str:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), raw
    return json.loads(body)["error"]["message"]


@pytest.fixture
def small(family: Family) -> Iterator[Server]:
    s = Server(family.target, "--proposer", "none", "--header-timeout", "1", "--body-timeout", "1")
    yield s
    s.close()


def quiet_exit(s: Server, signum: int = signal.SIGTERM) -> tuple[int, str]:
    s.p.send_signal(signum)
    code = s.p.wait(WAIT_S)
    time.sleep(0.2)  # the log's reader thread takes the last lines
    log = "".join(s.log)
    assert "Traceback" not in log and "CancelledError" not in log and "Exception in ASGI" not in log, log
    return code, log


def test_every_error_is_an_error_object(small: Server) -> None:
    error_of(small.http.get("/nowhere"), 404, "/nowhere")
    r = small.http.get("/v1/completions")
    error_of(r, 405, "GET /v1/completions")
    assert r.headers["allow"] == "POST"
    error_of(small.http.put("/health"), 405)
    assert "Invalid HTTP request" in error_message(answer(connect(small, b"NOT HTTP\r\n\r\n")), 400)
    big = answer(connect(small, b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n{" % (9 << 20)))
    assert "larger than 8 MiB" in error_message(big, 413)  # (and closed after --body-timeout)
    card = small.http.get("/v1/models/target.safetensors").json()
    assert card["id"] == "target.safetensors" and card["object"] == "model" and card["max_model_len"] > 0
    error_of(small.http.get("/v1/models/gpt-4"), 404, "unknown model 'gpt-4'")
    assert small.http.get("/v1/models/").json()["data"] == [card]
    r = small.post("/v1/completions/", {"prompt": "And", "max_tokens": 2})  # a trailing slash: the same route
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_half_sent_requests_time_out_and_others_are_answered_meanwhile(small: Server) -> None:
    """50 connections: a request line and a header but not the blank line after; headers and half a body; nothing
    at all. /health answers within a second all along; each of them gets a 408 after its 1 s, and is closed."""
    kinds = [
        b"GET /health HTTP/1.1\r\nHost: x\r\n",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{",
        b"",
    ]
    t0 = time.monotonic()
    socks = [connect(small, kinds[i % 3]) for i in range(50)]
    answers, slowest, _ = during(lambda: [answer(s) for s in socks], small)
    assert slowest < 1.0 and time.monotonic() - t0 < 5
    assert all("did not arrive within 1 s" in error_message(a, 408) for a in answers)  # type: ignore[union-attr]
    assert small.post("/v1/completions", {"prompt": "And", "max_tokens": 2}).status_code == 200
    assert quiet_exit(small)[0] == 0


def test_connections_past_the_file_limit_are_refused_at_once_and_quietly(family: Family) -> None:
    """An open-file limit of 400 leaves room for some 200 connections: 300 idle ones are opened; those past the
    room get a 503 at once, the server logs nothing, and it answers again once they go."""
    s = Server(family.target, "--proposer", "none", "--header-timeout", "30", files=400)
    try:
        socks = [connect(s) for _ in range(300)]
        t0 = time.monotonic()
        extra = answer(connect(s))
        assert "connections open" in error_message(extra, 503) and time.monotonic() - t0 < 1
        refused = select.select(socks, [], [], 0.5)[0]  # the others are held open: their requests may come
        assert 50 < len(refused) < 300 and all(sock.recv(9) == b"HTTP/1.1 " for sock in refused)
        for sock in socks:
            sock.close()
        deadline = time.monotonic() + 5
        while (r := httpx.get(s.url + "/health", timeout=5)).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.json() == {"status": "ok"}
        code, log = quiet_exit(s)
        assert code == 0 and "out of system resource" not in log and len(log) < 2000, log
    finally:
        s.close()


def test_a_prompt_of_megabytes_is_refused_before_it_is_tokenized(small: Server) -> None:
    """Four 8 MB prompts at once: each a 400 naming the context, /health within a second meanwhile, memory bounded."""
    body = json.dumps({"prompt": "And it came to pass " * 400_000}).encode()

    answers, slowest, grown = during(lambda: at_once(small, "/v1/completions", body, 4), small)
    for r in answers:  # type: ignore[attr-defined]
        error_of(r, 400, "8000000 characters", "context")
    assert slowest < 1.0 and grown < 1 << 30


def test_a_hostile_template_is_a_400_and_the_server_answers_meanwhile(hf_dir: Path) -> None:  # noqa: F811
    """A template that loops without end, writes a gigabyte, or a prompt of 900,000 tokens, for one conversation:
    that request gets a 400 in a few seconds (the sandbox's budget, the context), /health answers within a second
    meanwhile (six at once: tokenizing lets go of the GIL), and other chats are answered."""
    template = (  # ('x' * 10**9 alone would be folded, at compile time: then no conversation renders)
        "{% if messages[-1]['content'] == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}"
        "{% endfor %}{% endfor %}{% endif %}"
        "{% if messages[-1]['content'] == 'big' %}{{ 'x' * (10**9 + messages|length) }}{% endif %}"
        "{% if messages[-1]['content'] == 'wide' %}{{ 'ab ' * (300000 + messages|length) }}{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )
    tc = json.loads((hf_dir / "tokenizer_config.json").read_text())
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(tc | {"chat_template": template}))
    s = Server(hf_dir, "--proposer", "none")
    try:
        for attack, clients, why in (("loop", 1, "template"), ("big", 1, "template"), ("wide", 6, "context")):
            body = {"messages": [{"role": "user", "content": attack}], "max_tokens": 2}
            attack = functools.partial(at_once, s, "/v1/chat/completions", body, clients)
            answers, slowest, grown = during(attack, s)
            for r in answers:  # type: ignore[attr-defined]
                error_of(r, 400, why)
            assert slowest < 1.0 and grown < 2 << 30
        ok = s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "And"}], "max_tokens": 2})
        assert ok.status_code == 200, ok.text
    finally:
        s.close()


def test_a_client_gone_mid_body_and_a_drain_that_runs_out_log_no_traceback() -> None:
    """A client that sends half its body and goes: nothing logged. SIGINT with --drain 1 and answers still
    running: the whole one gets a 503 error object, the stream an error event; exit 130, no traceback."""
    s = Server(SHIPPED, "--proposer", "none", "--max-batch", "1", "--drain", "1")
    try:
        connect(s, b'POST /v1/completions HTTP/1.1\r\nContent-Length: 1000\r\n\r\n{"prompt": ').close()
        body = {"prompt": "And", "max_tokens": 900, "ignore_eos": True}
        events: list[str] = []
        whole: list[httpx.Response] = []

        def stream() -> None:
            with s.http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                events.extend(line for line in r.iter_lines() if line)

        threads = [threading.Thread(target=stream)]
        threads += [threading.Thread(target=lambda: whole.append(s.post("/v1/completions", body))) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(1)  # the first decodes, the others wait for a place (--max-batch 1)
        code, _ = quiet_exit(s, signal.SIGINT)
        for t in threads:
            t.join(WAIT_S)
        assert code == 130
        cut = [r for r in whole if r.status_code != 200]
        assert cut and all(r.status_code == 503 and "cancelled" in r.json()["error"]["message"] for r in cut)
        assert "cancelled" in events[-1] or events[-1] == "data: [DONE]", events[-2:]
    finally:
        s.close()
