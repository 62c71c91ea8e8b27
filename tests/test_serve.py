"""`smallem serve` as its clients see it: a real server process on 127.0.0.1, talked to over HTTP with httpx.
Answers equal `smallem generate`'s; streams add up to them; bad requests get 4xx and leave it alive; a client
that goes away gives its pages back; a full queue answers 429; SIGTERM drains it and it exits 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Family
from test_chat import hf_dir  # noqa: F401  (the fixture)
from test_cli import as_json
from typer.testing import CliRunner

from smallem_cli.cli.app import app

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
REPO = Path(__file__).resolve().parents[1]
RUN = "import sys; sys.argv[0] = 'smallem'; from smallem_cli.cli import main; main()"
WAIT_S = 120  # a server's start (the native build is cached by then) or an answer, at most


class Server:
    def __init__(self, target: Path, *args: str, files: int | None = None) -> None:
        """`files`: the server's open-file limit, soft and hard (else this process's)."""
        run = (
            RUN
            if files is None
            else f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, {(files, files)}); {RUN}"
        )
        argv = [sys.executable, "-c", run, "serve", "--target", str(target), "--port", "0", "-q", *args]
        env = os.environ | {"PYTHONPATH": str(REPO)}
        self.p = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
        assert self.p.stderr is not None
        self.log: list[str] = []
        deadline = time.monotonic() + WAIT_S
        while (line := self.p.stderr.readline()) and time.monotonic() < deadline:
            self.log.append(line)
            if m := re.search(r"on (http://\S+) ", line):
                self.url = m.group(1)
                break
        else:
            self.p.kill()
            raise AssertionError(f"the server did not start: {''.join(self.log)}")
        threading.Thread(target=lambda: self.log.extend(self.p.stderr), daemon=True).start()  # type: ignore[arg-type]
        self.http = httpx.Client(base_url=self.url, timeout=WAIT_S)

    def post(self, path: str, body: object, **kw: object) -> httpx.Response:
        return self.http.post(path, content=body if isinstance(body, bytes) else json.dumps(body), **kw)

    def stream(self, path: str, body: dict) -> tuple[str, list[dict]]:
        """A streamed answer -> its text, and every event's body."""
        with self.http.stream("POST", path, json=body | {"stream": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            data = [line.removeprefix("data: ") for line in r.iter_lines() if line]
        assert data and data.pop() == "[DONE]"  # the last one
        events = [json.loads(d) for d in data]
        text = "".join(c.get("text") or c.get("delta", {}).get("content") or "" for e in events for c in e["choices"])
        return text, events

    def metrics(self) -> dict[str, float]:
        text = self.http.get("/metrics").text
        return {m[0]: float(m[1]) for m in re.findall(r"^smallem_(\w+) (\S+)$", text, re.M)}

    def stop(self) -> int:
        self.p.send_signal(signal.SIGTERM)
        return self.p.wait(WAIT_S)

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


SHIPPED = REPO / "checkpoints" / "target.safetensors"  # a real model: its answers run long, as a load's do


@pytest.fixture
def served() -> Iterator[Server]:
    s = Server(SHIPPED, "--proposer", "ngram+mtp")
    yield s
    s.close()


def generate(target: Path, prompt: str, *args: str, proposer: str = "ngram+mtp") -> dict:
    argv = ["generate", prompt, "--target", str(target), "--proposer", proposer, "--json", *args]
    return as_json(CliRunner().invoke(app, argv))


def error_of(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and all(w in error["message"] for w in words), error


def test_answers_are_generates_whole_or_streamed(served: Server) -> None:
    """Greedy, with and without a stop string: the same text and tokens as `smallem generate`, whole and streamed;
    usage counts them, and the statistics ride along. Sampled: its seed alone decides its text."""
    ref = generate(SHIPPED, "In the beginning", "-n", "40")
    body = {"prompt": "In the beginning", "max_tokens": 40}
    r = served.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["object"] == "text_completion" and got["choices"][0]["text"] == ref["text"]
    n = len(ref["tokens"])
    assert got["usage"] == {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n} and n
    finish = "length" if n == 40 else "stop"  # the model's end token may come first
    assert got["choices"][0]["finish_reason"] == finish and got["smallem"]["new_tokens"] == n
    text, events = served.stream("/v1/completions", body)
    assert text == ref["text"] and events[-1]["choices"][0]["finish_reason"] == finish
    long = served.post("/v1/completions", body | {"ignore_eos": True}).json()  # past the end token
    assert long["usage"]["completion_tokens"] == 40 and long["choices"][0]["text"].startswith(ref["text"])
    stop = ref["text"][10:14]
    cut = generate(SHIPPED, "In the beginning", "-n", "40", "--stop", stop)
    assert served.post("/v1/completions", body | {"stop": [stop]}).json()["choices"][0]["text"] == cut["text"]
    text, events = served.stream("/v1/completions", body | {"stop": stop, "stream_options": {"include_usage": True}})
    assert text == cut["text"] and events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["usage"]["completion_tokens"] == len(cut["tokens"])
    sampled = [body | {"temperature": 0.9, "seed": seed} for seed in (1, 1, 2)]
    texts = [served.post("/v1/completions", b).json()["choices"][0]["text"] for b in sampled]
    assert texts[0] == texts[1] == served.stream("/v1/completions", sampled[0])[0] != texts[2]


def test_chat_uses_the_template(family: Family, hf_dir: Path) -> None:  # noqa: F811
    ref = generate(hf_dir, "In the beginning", "--system", "Answer", "-n", "24", proposer="ngram")
    s = Server(hf_dir, "--proposer", "ngram")
    try:
        messages = [{"role": "system", "content": "Answer"}, {"role": "user", "content": "In the beginning"}]
        body = {"messages": messages, "max_tokens": 24, "model": "hf"}
        got = s.post("/v1/chat/completions", body).json()
        assert got["object"] == "chat.completion" and got["choices"][0]["message"]["content"] == ref["text"]
        text, events = s.stream("/v1/chat/completions", body)
        assert text == ref["text"] and events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all(e["object"] == "chat.completion.chunk" for e in events)
    finally:
        s.close()


def test_bad_requests_get_4xx_and_the_server_lives(served: Server) -> None:
    error_of(served.post("/v1/completions", b"{not json"), 400, "not valid JSON")
    error_of(served.post("/v1/completions", b"\xff\xfe"), 400, "not valid JSON")
    error_of(served.post("/v1/completions", [1, 2]), 400, "JSON object")
    error_of(served.post("/v1/completions", {"prompt": "x", "model": "gpt-4"}), 400, "unknown model")
    error_of(served.post("/v1/completions", {"prompt": "x", "temperature": -1}), 400, "temperature")
    error_of(served.post("/v1/completions", {"prompt": "x", "top_p": 2}), 400, "top_p")
    error_of(served.post("/v1/completions", {"prompt": "x", "max_tokens": 0}), 400, "max_tokens")
    error_of(served.post("/v1/completions", {"prompt": "x", "max_tokens": "9"}), 400, "max_tokens")
    error_of(served.post("/v1/completions", {"prompt": "x", "n": 2}), 400, "n 2 is not supported")
    error_of(served.post("/v1/completions", {"prompt": "x", "stop": ""}), 400, "stop")
    error_of(served.post("/v1/completions", {"prompt": "x", "stop": ["a"] * 17}), 400, "at most 16 strings")
    error_of(served.post("/v1/completions", {"prompt": "x", "stream": "yes"}), 400, "stream")
    error_of(served.post("/v1/completions", {"prompt": ["a", "b"]}), 400, "one prompt a request")
    error_of(served.post("/v1/completions", {"prompt": [1, 10**9]}), 400, "token ids")
    error_of(served.post("/v1/completions", {"prompt": "a " * 5000}), 400, "context")
    error_of(served.post("/v1/completions", {"prompt": "   "}), 400, "empty prompt")
    error_of(served.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}), 400, "template")
    error_of(served.post("/v1/chat/completions", {"messages": "hi"}), 400, "messages")
    assert served.http.get("/v1/completions").status_code == 405 and served.http.get("/nowhere").status_code == 404
    assert served.http.get("/health").json() == {"status": "ok"}
    assert served.post("/v1/completions", {"prompt": "And", "max_tokens": 3}).status_code == 200
    assert served.http.get("/v1/models").json()["data"][0]["id"] == "target.safetensors"


def test_a_client_that_goes_away_gives_its_pages_back(served: Server) -> None:
    for stream in (True, False):
        try:
            body = {"prompt": "And", "max_tokens": 900, "stream": stream, "ignore_eos": True}
            with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=0.5) as r:
                for _ in r.iter_bytes():
                    break
        except httpx.ReadTimeout:  # the whole answer: not there in half a second
            pass
    deadline = time.monotonic() + 30
    while (m := served.metrics())["requests_cancelled_total"] < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert m["requests_cancelled_total"] == 2 and m["requests_finished_total"] == 0
    assert m["kv_pages_free"] == m["kv_pages_total"] > 0 and m["requests_running"] == 0


def test_many_clients_at_once_get_the_answers_they_get_alone(served: Server) -> None:
    """12 concurrent clients, greedy and sampled, streamed and whole: a greedy answer is `generate`'s, a sampled
    one is what the same request gets alone."""
    prompts = ["In the beginning", "And God said", "The LORD is", "Blessed are"]
    jobs = [(p, t, s) for p in prompts for t, s in ((0.0, False), (0.9, True), (0.0, True))]

    def body(prompt: str, temperature: float) -> dict:
        return {"prompt": prompt, "max_tokens": 30, "temperature": temperature, "seed": 3}

    refs = {(p, 0.0): generate(SHIPPED, p, "-n", "30")["text"] for p in prompts}
    refs |= {(p, 0.9): served.post("/v1/completions", body(p, 0.9)).json()["choices"][0]["text"] for p in prompts}
    got: dict[int, str] = {}

    def client(i: int, prompt: str, temperature: float, stream: bool) -> None:
        b = body(prompt, temperature)
        got[i] = served.stream("/v1/completions", b)[0] if stream else served.post("/v1/completions", b).json()[
            "choices"][0]["text"]  # fmt: skip

    threads = [threading.Thread(target=client, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert {i: got.get(i) for i in range(len(jobs))} == {i: refs[p, t] for i, (p, t, _) in enumerate(jobs)}
    m = served.metrics()
    assert m["requests_finished_total"] == len(jobs) + len(prompts) and m["kv_pages_free"] == m["kv_pages_total"]


def test_a_full_queue_answers_429() -> None:
    s = Server(SHIPPED, "--max-batch", "1", "--max-queue", "1", "--proposer", "none")
    try:
        statuses: list[int] = []

        def client() -> None:
            body = {"prompt": "And", "max_tokens": 300, "ignore_eos": True}
            statuses.append(s.post("/v1/completions", body).status_code)

        threads = [threading.Thread(target=client) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert 429 in statuses and 200 in statuses and set(statuses) == {200, 429}, statuses
        assert s.metrics()["requests_refused_total"] == statuses.count(429)
    finally:
        s.close()


def test_an_api_key_is_asked_for(family: Family) -> None:
    s = Server(family.target, "--api-key", "sesame", "--proposer", "none")
    try:
        body = {"prompt": "And", "max_tokens": 2}
        error_of(s.post("/v1/completions", body), 401, "API key")
        error_of(s.post("/v1/completions", body, headers={"Authorization": "Bearer nope"}), 401, "API key")
        assert s.post("/v1/completions", body, headers={"Authorization": "Bearer sesame"}).status_code == 200
        assert s.http.get("/health").status_code == 200  # a liveness probe needs no key
    finally:
        s.close()


def test_sigterm_finishes_the_answers_in_flight_then_exits_0(served: Server) -> None:
    result: list[tuple[str, list[dict]]] = []
    body = {"prompt": "And", "max_tokens": 400, "ignore_eos": True}
    t = threading.Thread(target=lambda: result.append(served.stream("/v1/completions", body)))
    t.start()
    deadline = time.monotonic() + WAIT_S
    while served.metrics()["requests_running"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert served.stop() == 0, "".join(served.log)
    t.join(WAIT_S)
    assert result and result[0][1][-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert "Traceback" not in "".join(served.log)


def test_a_stream_rate_sends_a_streams_tokens_together() -> None:
    """--stream-rate 1: one event a second, shared by the streams; the first tokens go out at once, the rest at
    the whole seconds of the server's clock and at the end, and they add up to the whole answer."""
    s = Server(SHIPPED, "--proposer", "none", "--stream-rate", "1")
    try:
        body = {"prompt": "And", "max_tokens": 200, "ignore_eos": True}
        whole = s.post("/v1/completions", body).json()["choices"][0]["text"]
        t0 = time.monotonic()
        text, events = s.stream("/v1/completions", body)
        chunks = [c["text"] for e in events for c in e["choices"] if c["text"]]
        assert text == whole and 2 <= len(chunks) <= 3 + time.monotonic() - t0, chunks
    finally:
        s.close()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--port", "70000"], "--port"),
        (["--max-queue", "0"], "--max-queue"),
        (["--drain", "0"], "--drain"),
        (["--stream-rate", "-1"], "--stream-rate"),
        (["--max-connections", "0"], "--max-connections"),
        (["--max-connections", str(10**9)], "open-file limit"),
        (["--header-timeout", "0"], "--header-timeout"),
        (["--body-timeout", "inf"], "--body-timeout"),
    ],
)
def test_bad_options_are_one_line(family: Family, args: list[str], words: str) -> None:
    r = CliRunner().invoke(app, ["serve", "--target", str(family.target), *args])
    assert r.exit_code == 2 and r.stderr.startswith("error:") and r.stderr.count("\n") == 1 and words in r.stderr


def test_bench_serve_measures_a_server_it_starts_or_is_given(served: Server) -> None:
    """`bench --serve`: its own servers (the target alone, then the proposer), or one at --url; greedy answers
    identical across servers and client counts; every row's requests all answered, with their tokens."""
    argv = ["bench", "--serve", "--clients", "1,3", "--requests-per-client", "2", "-n", "12", "--json"]
    got = as_json(
        CliRunner().invoke(app, [*argv, "--target", str(SHIPPED), "--proposers", "ngram", "--modes", "greedy"])
    )
    rows = got["serve_rows"]
    assert [(r["server"], r["clients"], r["requests"]) for r in rows] == [("none", 1, 2), ("none", 3, 6),
                                                                          ("ngram", 1, 2), ("ngram", 3, 6)]  # fmt: skip
    assert all(r["tokens"] == 12 * r["requests"] and r["identical"] == f"{r['requests']}/{r['requests']}" for r in rows)
    assert all(r["tokens_per_s"] > 0 and 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] for r in rows)
    assert rows[0]["acceptance"] is None and rows[2]["acceptance"] is not None  # (none proposes nothing)
    at = as_json(CliRunner().invoke(app, [*argv, "--url", served.url, "--modes", "greedy,sample"]))["serve_rows"]
    assert [(r["server"], r["mode"]) for r in at] == [(served.url, m) for m in ("greedy", "greedy", "sample", "sample")]
    assert all(r["requests"] == 2 * r["clients"] and r["tokens"] == 12 * r["requests"] for r in at)
    r = CliRunner().invoke(app, [*argv, "--url", "http://127.0.0.1:9"])  # nothing listens there
    assert r.exit_code == 1 and r.stderr.startswith("error:") and r.stderr.count("\n") == 1, r.stderr


def test_bench_serve_peer_vllm_rows_on_a_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench --serve --peer vllm`: the target exported as an HF folder and served beside ours at the same client
    counts; here `vllm serve` is stood in for by `smallem serve` on that folder (the real one: `make vllm-venv`)."""
    from contextlib import contextmanager

    from smallem_cli.bench import serve as S
    from smallem_cli.interop import vllm_peer as V

    served: list[Path] = []

    @contextmanager
    def serving(python: Path, target: Path, spec: object, env: dict, log: Path) -> Iterator[str]:
        assert spec is None and (target / "config.json").is_file() and env["VLLM_TARGET_DEVICE"] == "cpu"
        served.append(target)
        with S.started(["--target", str(target), "--proposer", "none", "--model-name", str(target)]) as url:
            yield url

    monkeypatch.setenv(V.PYTHON_ENV, sys.executable)
    monkeypatch.setattr(V, "serving", serving)
    argv = ["bench", "--serve", "--clients", "1,2", "--requests-per-client", "1", "-n", "8", "--json", "--peer", "vllm"]
    rows = as_json(CliRunner().invoke(app, [*argv, "--target", str(SHIPPED), "--proposers", "ngram", "--modes",
                                            "greedy"]))["serve_rows"]  # fmt: skip
    assert [(r["server"], r["clients"]) for r in rows] == [
        (s, c) for s in ("none", "ngram", "vllm serve") for c in (1, 2)
    ]
    assert len(served) == 1 and all(r["identical"] == f"{r['requests']}/{r['requests']}" for r in rows)
    r = CliRunner().invoke(app, [*argv[:-2], "--peer", "hf", "--target", str(SHIPPED)])
    assert r.exit_code == 2 and "--peer vllm" in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.parametrize("shared", [False, True])
def test_the_suffix_lookup_reads_other_requests_only_when_shared(shared: bool) -> None:
    """The same request twice to `--proposer suffix`: with --suffix-shared the second drafts from the first's
    answer, nearly every draft token accepted; without, its own text alone, far fewer. Both answers are the same."""
    s = Server(SHIPPED, "--proposer", "suffix", *(["--suffix-shared"] if shared else []))
    try:
        body = {"prompt": "And God said", "max_tokens": 64, "temperature": 0}
        first = s.post("/v1/completions", body).json()["choices"][0]["text"]
        before = s.metrics()
        second = s.post("/v1/completions", body).json()["choices"][0]["text"]
        after = s.metrics()
    finally:
        s.close()
    assert first == second
    accepted = after["accepted_tokens_total"] - before["accepted_tokens_total"]
    assert (accepted >= 48) if shared else (accepted < 48), accepted
