"""`smallem batch`'s limits: a huge line, a huge --max-batch, duplicate ids, Ctrl-C with --ordered.

Each test checks what the user sees: the exit code, one line on stderr, the answers on stdout.
"""

from __future__ import annotations

import io
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import Family
from test_batch_cli import FakeEngine, answers, batch
from test_cli import refused
from typer.testing import CliRunner

from smallem_cli import defaults as D
from smallem_cli.backends.engines import Backend
from smallem_cli.cli import batch as cli_batch
from smallem_cli.cli import batch_io as B
from smallem_cli.cli.app import app
from smallem_cli.engine import build as engine_build
from smallem_cli.engine import config
from smallem_cli.engine.build import build
from smallem_cli.engine.config import EngineConfig, round_ahead
from smallem_cli.engine.family import load_proposer, load_target
from smallem_cli.engine.request import Request
from smallem_cli.errors import UsageError
from smallem_cli.kv.pool import pages_for

REPO = Path(__file__).resolve().parent.parent
CTX = 64
SMALL = B.Defaults(max_new_tokens=8)


def encode(text: str) -> list[int]:
    return [ord(c) % 300 for c in text]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeEngine:
    engine = FakeEngine()
    monkeypatch.setattr(engine_build, "build", engine.build)
    return engine


# --- a line's length ----------------------------------------------------------------------------------
def test_the_line_limit_follows_the_context() -> None:
    assert B.max_line_bytes(1024) == D.MAX_LINE_BYTES == 1 << 20  # the shipped context: 1 MiB
    assert B.max_line_bytes(1 << 17) == (1 << 17) * D.LINE_BYTES_PER_TOKEN  # a long context: more


class Reader(io.BytesIO):
    """A binary input that remembers the largest piece handed out, and refuses a whole-line read."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.largest = 0

    def readline(self, size: int | None = -1) -> bytes:
        got = super().readline(size)
        self.largest = max(self.largest, len(got))
        return got

    def __iter__(self):  # type: ignore[override]
        raise AssertionError("a line read whole, however long")


def test_a_long_line_is_never_read_whole() -> None:
    huge = b"x" * 3_000_000
    data = b"one\n" + huge + b"\n" + b'{"id": "j", "prompt": "two"}\n' + huge  # the last line: no newline
    src = Reader(data)
    items = list(B.parse_lines(src, SMALL, encode, CTX, max_bytes=1000))
    assert [type(i).__name__ for i in items] == ["Request", "Rejected", "Request", "Rejected"]
    assert items[1] == B.Rejected(1, 2, "line too long: over 1000 bytes")
    assert items[3] == B.Rejected(3, 4, "line too long: over 1000 bytes")
    assert isinstance(items[2], Request) and items[2].id == "j" and items[2].prompt == tuple(encode("two"))
    assert src.largest <= max(1001, B._DROP_CHUNK)  # bounded, whatever the line's length


def test_the_limit_is_the_bytes_before_the_newline() -> None:
    source = io.BytesIO(b"12345678\n123456789\n1234567\r\n12345678")
    items = list(B.parse_lines(source, SMALL, encode, CTX, max_bytes=8))
    assert [isinstance(i, Request) for i in items] == [True, False, True, True]
    last = io.BytesIO(b"123456789")
    assert list(B.parse_lines(last, SMALL, encode, CTX, max_bytes=8)) == [
        B.Rejected(0, 1, "line too long: over 8 bytes")
    ]


FAKE_RUN = """
import os, pathlib, sys, time
from types import SimpleNamespace
from smallem_cli.engine import build
from smallem_cli.engine.request import Finished

HOLD = int(os.environ.get("FAKE_HOLD", "0"))  # >0: answer every line but the first, then wait

def run(requests, progress=None):
    held = []
    for r in requests:
        if HOLD and r.index == 0:
            held.append(r)
            continue
        yield Finished(r, "x", [1, 2, 3], {})
        if HOLD and r.index + 1 == HOLD:
            pathlib.Path(os.environ["FAKE_MARK"]).touch()
            time.sleep(60)
    for r in held:
        yield Finished(r, "x", [1, 2, 3], {})

build.build = lambda c: SimpleNamespace(run=run, max_batch=c.max_batch, context=c.target.cfg.max_seq_len)
from smallem_cli.cli import main
sys.argv[0] = "smallem"
main()
"""
CAP = 2 << 30  # a fake run takes under 1 GiB of address space; tokenizing a 50 MB line took 10 GB


def smallem_batch(family: Family, path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`smallem batch PATH` in a process of its own, its engine a fake one, its address space capped."""
    argv = [sys.executable, "-c", FAKE_RUN, "batch", str(path), "--target", str(family.target), *args]

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))

    env = os.environ | {"PYTHONPATH": str(REPO)} | (env or {})
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, preexec_fn=cap)


def test_a_50_mb_line_is_refused_and_the_others_answered(family: Family, tmp_path: Path) -> None:
    path = tmp_path / "huge.txt"
    with path.open("wb") as f:
        f.write(b"first\n")
        f.write(b'{"id": "huge", "prompt": "' + b"a" * 50_000_000 + b'"}\n')
        f.write(b"last\n")
    p = smallem_batch(family, path)
    assert p.stdout is not None and p.stderr is not None
    first = p.stdout.readline()
    t0 = time.monotonic()
    second = p.stdout.readline()  # the huge line's answer: its bytes skipped, not parsed
    took = time.monotonic() - t0
    rest, err = p.stdout.read(), p.stderr.read()  # (communicate would miss what readline buffered)
    assert p.wait(timeout=120) == 0, err.decode()[-2000:]
    out = [json.loads(line) for line in [first, second, *rest.splitlines()]]
    assert out == [
        {"id": 1, "text": "x", "tokens": [1, 2, 3], "stats": {}},
        {"id": 2, "error": f"line too long: over {D.MAX_LINE_BYTES} bytes"},
        {"id": 3, "text": "x", "tokens": [1, 2, 3], "stats": {}},
    ]
    assert err.decode().startswith("3 requests (1 rejected)") and err.count(b"\n") == 1
    assert took < 10


# --- ids ------------------------------------------------------------------------------------------
def test_a_repeated_id_is_an_error() -> None:
    lines = [
        b'{"id": "a", "prompt": "one"}',  # 1
        b'{"id": "a", "prompt": "two"}',  # 2: "a" again
        b'{"id": 5, "prompt": "three"}',  # 3: takes 5, the number of line 5
        b'{"id": "3", "prompt": "four"}',  # 4: "3" is not 3
        b"five",  # 5: its number, 5, is line 3's id
        b'{"id": 1, "prompt": "six"}',  # 6: line 1 gave "a": 1 is free
        b'{"id": 4, "prompt": "seven"}',  # 7: line 4 gave "3": 4 is free
        b'{"id": 8, "prompt": "eight"}',  # 8: its own number
        b'{"id": 8, "prompt": ""}',  # 9: 8 again (and an empty prompt)
        b'{"id": 6, "prompt": "ten"}',  # 10: line 6 gave 1, so 6 is free
        b"{broken",  # 11: answered as 11
        b'{"id": 11, "prompt": "x"}',  # 12: 11 is line 11's
    ]
    items = list(B.parse_lines(io.BytesIO(b"\n".join(lines)), SMALL, encode, CTX))
    errors = {i.index + 1: i.error for i in items if isinstance(i, B.Rejected)}
    assert errors == {
        2: 'duplicate id "a": line 1 has it too',
        5: "duplicate id 5: line 3 has it too",
        9: "duplicate id 8: line 8 has it too",
        11: "invalid JSON object",
        12: "duplicate id 11: line 11 has it too",
    }
    assert [i.id for i in items] == ["a", "a", 5, "3", 5, 1, 4, 8, 8, 6, 11, 11]


def test_the_command_answers_a_repeated_id_with_an_error(family: Family, fake: FakeEngine) -> None:
    lines = ['{"id": "x", "prompt": "one"}', "two", '{"id": "x", "prompt": "three"}']
    out = answers(batch(family, "--ordered", "-q", input="\n".join(lines)))
    assert out[2] == {"id": "x", "error": 'duplicate id "x": line 1 has it too'}
    assert [r.id for r in fake.requests] == ["x", 2]


# --- Ctrl-C with --ordered ------------------------------------------------------------------------------
def test_ordered_ctrl_c_writes_the_held_answers_in_order(family: Family, fake: FakeEngine) -> None:
    """The fake engine answers 3 and 2, then a Ctrl-C: line 1 never got its answer."""
    fake.interrupt_after = 2
    res = batch(family, "--ordered", input="one\ntwo\nthree\nfour\n")
    assert res.exit_code == 130 and res.stderr == "interrupted\n"
    assert [json.loads(line)["id"] for line in res.stdout.splitlines()] == [2, 3]


def test_a_ctrl_c_at_the_end_of_a_write_writes_no_line_twice() -> None:
    """whole_line raises a Ctrl-C held during a write at the write's end: the answer is out, and
    the held answers written after it must not hold it still."""
    calls = 0

    class Interrupt:
        def __enter__(self) -> None:
            nonlocal calls
            calls += 1

        def __exit__(self, *exc: object) -> None:
            if calls == 2:
                raise KeyboardInterrupt

    out = io.StringIO()
    w = B.Writer(out, Interrupt, ordered=True)
    w.put(2, {"id": 3})
    w.put(0, {"id": 1})
    with pytest.raises(KeyboardInterrupt):
        w.put(1, {"id": 2})  # 2 goes out, the Ctrl-C comes at its end; 3 is still held
    cli_batch.write_held(w, B.OutputClosed)
    assert [json.loads(x)["id"] for x in out.getvalue().splitlines()] == [1, 2, 3]
    assert len(w.waiting) == 0


def test_a_second_ctrl_c_stops_the_held_answers() -> None:
    class Stop:
        def __enter__(self) -> None:
            pass

        def __exit__(self, *exc: object) -> None:
            raise KeyboardInterrupt

    out = io.StringIO()
    w = B.Writer(out, Stop, ordered=True)
    w.put(2, {"id": 3})
    w.put(3, {"id": 4})
    cli_batch.write_held(w, B.OutputClosed)  # no traceback: the run ends on the Ctrl-C
    assert out.getvalue() == '{"id": 3}\n'


def test_a_real_ctrl_c_with_ordered(family: Family, tmp_path: Path) -> None:
    """Lines 2..9 answered, line 1 not yet, then a SIGINT: 2..9 come out in order, exit 130."""
    path = tmp_path / "lines.txt"
    path.write_text("hello\n" * 20)
    mark = tmp_path / "held"
    p = smallem_batch(family, path, "--ordered", env={"FAKE_HOLD": "9", "FAKE_MARK": str(mark)})
    deadline = time.monotonic() + 60
    while not mark.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mark.exists(), p.communicate(timeout=10)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err.decode()[-2000:]
    assert err.decode() == "interrupted\n"
    assert [json.loads(line)["id"] for line in out.splitlines()] == list(range(2, 10))


# --- --max-batch and the cache ---------------------------------------------------------------------------
def test_fit_batch() -> None:
    per = 17_300_000  # the shipped target's cache for one sequence at the full context
    assert config.fit_batch(16, per, 12_000_000_000) == 16
    assert config.fit_batch(100_000, per, 12_000_000_000) == 693
    assert config.fit_batch(10**18, per, 12_000_000_000) == 693
    with pytest.raises(UsageError, match=r"batch size 100000: its cache would take 1\.7 TB, .* at most 693 sequences"):
        config.fit_batch(100_000, per, 12_000_000_000, strict=True)
    with pytest.raises(
        UsageError, match=r"not enough memory for the batch engine: one sequence's cache takes 17\.3 MB"
    ):
        config.fit_batch(1, per, 10_000_000)
    assert config.cache_budget(torch.device("cpu")) > 0


def test_one_rule_sizes_every_pool(family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    """`config.plan_pool`: a small pool at first (a prompt alone), grown up to max_batch full contexts (a batch);
    where the memory is short, a batch lowered (refused when strict, or when not one sequence fits) and a sequence
    alone given a shorter context (a conversation)."""
    monkeypatch.setattr(config, "FIRST_POSITIONS", 64)  # the test model's context is shorter than the real one
    model = load_target(family.target, torch.device("cpu")).model
    ctx = model.cfg.max_seq_len

    def pages(n: int, positions: int) -> int:
        return n * pages_for(positions + D.MAX_K + 2, D.PAGE_SIZE)

    one = pages(1, ctx) * D.PAGE_SIZE * config.slot_bytes([model])  # a sequence's cache at the full context
    plan = config.plan_pool
    assert plan(EngineConfig(model), 100 * one) == config.PoolPlan(pages(1, 64), pages(1, ctx), 1, ctx)
    assert plan(EngineConfig(model, max_batch=64), 100 * one) == config.PoolPlan(
        pages(D.MAX_BATCH, 64), pages(64, ctx), 64, ctx
    )
    assert plan(EngineConfig(model, max_batch=64), 10 * one).max_batch == 10
    with pytest.raises(UsageError, match=r"batch size 64: .* at most 10 sequences fit"):
        plan(EngineConfig(model, max_batch=64, strict=True), 10 * one)
    with pytest.raises(UsageError, match="not enough memory for the batch engine"):
        plan(EngineConfig(model, max_batch=2), one // 2)
    assert plan(EngineConfig(model), one // 2).context == ctx // 2
    assert plan(EngineConfig(model, max_batch=64, pages=7), 0) == config.PoolPlan(7, 7, 64, ctx)


LINES = "The quick brown fox\nIn the beginning was\nSpeculative decoding guesses\n"


def test_a_huge_max_batch_answers(family: Family) -> None:
    """--max-batch 10**18 with three requests: lowered to what the memory holds, all answered."""
    res = CliRunner().invoke(
        app, ["batch", "--target", str(family.target), "--ordered", "-n", "8", "--max-batch", str(10**18)], input=LINES
    )
    assert [a["id"] for a in answers(res)] == [1, 2, 3]
    note, summary = res.stderr.splitlines()
    assert note.startswith(f"--max-batch {10**18} lowered to ") and summary.startswith("3 requests (0 rejected)")
    quiet = CliRunner().invoke(
        app, ["batch", "--target", str(family.target), "-q", "--max-batch", "100000"], input=LINES
    )
    assert len(answers(quiet)) == 3 and quiet.stderr == ""


def test_no_room_for_one_sequence_is_one_line(family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "free_memory", lambda device: 100_000)
    res = CliRunner().invoke(app, ["batch", "--target", str(family.target)], input=LINES)
    refused(res, r"not enough memory for the batch engine: one sequence's cache takes .*, 50\.0 kB is free for it")
    assert res.exit_code == 2


def test_bench_refuses_a_batch_beyond_the_memory(family: Family, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"tokens": list(range(5, 15)), "text": ""}) + "\n" for _ in range(2)))
    args = ["bench", "--target", str(family.target), "--prompts", str(prompts), "-n", "4", "--proposers", "mtp"]
    res = CliRunner().invoke(app, [*args, "--batch", f"1,{10**18}"])
    refused(res, rf"batch size {10**18}: its cache would take .*: at most \d+ sequences fit")
    assert res.exit_code == 2


@pytest.mark.parametrize(
    ("proposer", "native", "tree"),
    [("ngram+mtp", None, None), ("ngram+mtp", "native", None), ("mtp", "native", (8, 2))],
)
def test_the_cache_grows_as_requests_need_it(
    family: Family, proposer: str, native: str | None, tree: tuple[int, int] | None
) -> None:
    """A --max-batch of 64 starts with the default batch's cache and grows it while short, up to
    what 64 sequences take; the tokens are those of a pool allocated whole up front."""
    if native and (shutil.which("g++") is None or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512")):
        pytest.skip("the native engine needs g++ and an AVX2 CPU")
    tgt = load_target(family.target, torch.device("cpu"))
    reqs = [Request(i, i, tuple(range(5 + i % 7, 12 + i % 7)), 120) for i in range(60)]  # 9 pages each, at the end
    loaded = load_proposer(proposer, tgt, torch.device("cpu"), D.proposer_vocab(True), tree)

    def make(**kw: object) -> engine_build.Engine:
        backend = Backend(native) if native else Backend()
        return build(EngineConfig(tgt.model, loaded, backend, max_batch=64, decode=str, **kw))  # type: ignore[arg-type]

    eng = make()
    assert eng.backend == (native or "eager")  # every model runs the backend asked for
    ctx, ahead = tgt.model.cfg.max_seq_len, round_ahead(D.MAX_K, tree)
    full = 64 * pages_for(ctx + ahead, D.PAGE_SIZE)
    start = D.MAX_BATCH * pages_for(min(ctx, config.FIRST_POSITIONS) + ahead, D.PAGE_SIZE)
    assert eng.pool.n_pages == start and eng.max_pages == full
    grown = {f.request.index: f.tokens for f in eng.run(reqs)}
    assert start < eng.pool.n_pages <= full and eng.preemptions == 0
    module = getattr(eng.proposer, "other", eng.proposer)  # the MTP module's draft tokens, behind the n-gram's or not
    assert eng.t.slab.shape[3] == module.slab.shape[3] == eng.pool.n_pages * D.PAGE_SIZE
    whole = make(pages=full)
    assert {f.request.index: f.tokens for f in whole.run(reqs)} == grown
    assert sorted(grown) == list(range(60)) and all(len(t) == 120 for t in grown.values())


def test_a_growth_the_memory_refuses_keeps_the_pool(family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory taken since the budget was measured: the pool keeps its size, the sequences wait or
    are preempted, and every request is still answered with the target's tokens."""
    tgt = load_target(family.target, torch.device("cpu"))
    reqs = [Request(i, i, tuple(range(5 + i % 7, 12 + i % 7)), 120) for i in range(60)]
    cfg = EngineConfig(tgt.model, load_proposer("ngram+mtp", tgt, torch.device("cpu")), max_batch=64, decode=str)
    eng = build(cfg)
    start, slab = eng.pool.n_pages, eng.t.slab

    def refused(slab: torch.Tensor, slots: int) -> torch.Tensor:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")

    monkeypatch.setattr(engine_build, "_widened", refused)
    got = {f.request.index: f.tokens for f in eng.run(reqs)}
    assert eng.pool.n_pages == eng.max_pages == start and eng.t.slab is slab and eng.preemptions > 0
    monkeypatch.undo()
    whole = build(replace(cfg, pages=64 * pages_for(tgt.model.cfg.max_seq_len + D.MAX_K + 2, D.PAGE_SIZE)))
    assert {f.request.index: f.tokens for f in whole.run(reqs)} == got and len(got) == 60
