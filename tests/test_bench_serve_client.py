"""`bench --serve --url`: what the client reads is checked. A server that streams a wrong type, garbage, without end
or without `data: [DONE]` ends the bench with one error line and exit 1, in seconds; "identical" only where the
texts were compared. The servers here are stand-ins: a thread that answers each request with a scripted body."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import Family
from typer.testing import CliRunner

from smallem_cli.bench import serve as S
from smallem_cli.cli.app import app

pytest.importorskip("httpx")

N = 4  # tokens an answer asks for


def event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


GOOD = [event({"choices": [{"text": "ab"}]}), event({"choices": [{"text": "cd"}], "usage": {"completion_tokens": N}})]
DONE = b"data: [DONE]\n\n"


def forever(chunk: bytes) -> Iterator[bytes]:
    while True:
        yield chunk


class Stub(ThreadingHTTPServer):
    daemon_threads = True
    body: object = ()  # what POST /v1/completions streams: bytes chunks (an iterator may never end)
    status = 200
    pause = 0.0  # seconds before the body


class Handler(BaseHTTPRequestHandler):
    server: Stub

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._send(200, [json.dumps({"data": [{"id": "stub"}]}).encode()])
        else:
            self._send(404, [b"not here"])

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        time.sleep(self.server.pause)
        self._send(self.server.status, self.server.body)

    def _send(self, status: int, chunks: object) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            for c in chunks:  # type: ignore[attr-defined]
                self.wfile.write(c)
        except (BrokenPipeError, ConnectionResetError):  # the client stopped reading: what is asked of it
            pass


@pytest.fixture
def stub() -> Iterator[Stub]:
    server = Stub(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def bench(family: Family, stub: Stub, tmp_path: Path) -> tuple[object, float]:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"tokens": [5, 6, 7, 8]}) + "\n")
    argv = ["bench", "--serve", "--url", f"http://127.0.0.1:{stub.server_address[1]}", "--target", str(family.target),
            "--prompts", str(prompts), "-n", str(N), "--clients", "1", "--requests-per-client", "2",
            "--modes", "greedy", "--json"]  # fmt: skip
    t0 = time.monotonic()
    res = CliRunner().invoke(app, argv)
    return res, time.monotonic() - t0


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ([event({"choices": [{"text": 5}]}), DONE], '"text" is not a string: 5'),
        (forever(b"garbage garbage garbage\n"), "no server-sent event"),
        (forever(b"x" * 65536), "more than 8 MiB"),  # no line ends, ever
        (forever(b": a comment\n"), "more than 8 MiB"),
        (forever(event({"choices": [{"text": "a"}]})), f"more than {N + S.EXTRA_EVENTS} events"),
        (GOOD, "without `data: [DONE]`"),
        ([b"data: {oops\n\n", DONE], "not JSON"),
        ([event([1, 2]), DONE], "not a JSON object"),
        ([event({"choices": {"text": "a"}}), DONE], '"choices" that are not a list'),
        ([event({"choices": [], "usage": {"completion_tokens": "4"}}), DONE], "completion_tokens"),
        ([event({"choices": [], "usage": {"completion_tokens": 10**6}}), DONE], "completion_tokens"),
        ([event({"error": {"message": "boom"}}), DONE], "streamed an error"),
        ([b"data: \xff\xfe\n\n", DONE], "not UTF-8"),
        ([DONE], "no text and no token count"),
        ([event({"choices": [{}]}), DONE], "no text and no token count"),
    ],
)
def test_what_the_server_streams_is_checked(
    family: Family, stub: Stub, tmp_path: Path, body: object, words: str
) -> None:
    stub.body = body
    res, took = bench(family, stub, tmp_path)
    assert res.exit_code == 1, (res.exit_code, res.stderr, res.exception)  # type: ignore[attr-defined]
    err = res.stderr  # type: ignore[attr-defined]
    assert err.startswith("error:") and err.count("\n") == 1 and words in err, err
    assert "identical" not in res.stdout and took < 20  # type: ignore[attr-defined]


def test_an_error_status_with_an_endless_body(family: Family, stub: Stub, tmp_path: Path) -> None:
    stub.status, stub.body = 500, forever(b"x" * 4096)
    res, took = bench(family, stub, tmp_path)
    assert res.exit_code == 1 and res.stderr.count("\n") == 1 and "answered 500" in res.stderr, res.stderr
    assert took < 20


def test_an_answer_that_never_ends_in_time(
    family: Family, stub: Stub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(S, "ANSWER_S", 0.5)
    stub.body, stub.pause = [*GOOD, DONE], 3.0
    res, took = bench(family, stub, tmp_path)
    assert res.exit_code == 1 and res.stderr.count("\n") == 1 and "more than 0 s" in res.stderr, res.stderr
    assert took < 3


def test_a_well_formed_stream_is_measured_and_compared(family: Family, stub: Stub, tmp_path: Path) -> None:
    """The control: the same checks pass a stream as OpenAI's servers send it (comments and ids included)."""
    stub.body = [b": keep-alive\n\nid: 1\n", *GOOD, b"data:" + DONE[5:]]
    res, _ = bench(family, stub, tmp_path)
    assert res.exit_code == 0, (res.stderr, res.exception)
    (row,) = json.loads(res.stdout)["serve_rows"]
    assert (row["requests"], row["tokens"], row["identical"]) == (2, 2 * N, "2/2")
