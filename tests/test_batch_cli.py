"""`smallem batch`'s front end: request lines in, one JSON answer line out per line.

The engine here is a fake one (it answers out of order, or is interrupted) put in place of
`engine.build.build`; the last tests run the real engine.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import Result
from conftest import FAMILY_CFG, Family
from test_cli import refused
from typer.testing import CliRunner

from smallem_cli import defaults as D
from smallem_cli.cli import batch as cli_batch
from smallem_cli.cli import batch_io as B
from smallem_cli.cli.app import app
from smallem_cli.engine import build as engine_build
from smallem_cli.engine.request import Finished, Request
from smallem_cli.errors import UsageError
from smallem_cli.spec.sampling import Sampling

REPO = Path(__file__).resolve().parent.parent
CTX = 64  # the context parse_line's tests give


def encode(text: str) -> list[int]:
    """One id a character: the prompt's length is its token count."""
    return [ord(c) % 300 for c in text]


SMALL = B.Defaults(max_new_tokens=8)


def parse(line: str, lineno: int = 1, defaults: B.Defaults = SMALL, k: int = 0) -> Request | B.Rejected:
    return B.parse_line(line, lineno, defaults, encode, CTX, k)


def rejected(line: str, lineno: int = 1) -> B.Rejected:
    item = parse(line, lineno)
    assert isinstance(item, B.Rejected), item
    assert item.index == lineno - 1
    return item


# --- parsing ---------------------------------------------------------------------------------
def test_plain_text_takes_the_defaults() -> None:
    defaults = B.Defaults(max_new_tokens=7, temperature=0.5, top_k=5, top_p=0.9, seed=3)
    req = parse("  In the beginning ", 4, defaults)
    assert req == Request(3, 4, tuple(encode("  In the beginning ")), 7, Sampling(0.5, 5, 0.9, 3), ())
    defaults = B.Defaults(max_new_tokens=7, temperature=0.5, min_p=0.1, repetition_penalty=1.3)
    req = parse("hi", 1, defaults)
    assert isinstance(req, Request) and req.sampling == Sampling(0.5, min_p=0.1, repetition_penalty=1.3)


def test_a_plain_line_is_the_prompt_as_is() -> None:
    """Quotes, brackets, a JSON string or array: text, unless the line opens a JSON object."""
    for line in ['"quoted"', "[1, 2]", "a {b} c", "null"]:
        req = parse(line)
        assert isinstance(req, Request) and req.prompt == tuple(encode(line))


def test_json_request_with_every_field() -> None:
    line = json.dumps(
        {
            "id": "a-1",
            "prompt": "The fox",
            "max_new_tokens": 9,
            "temperature": 1,
            "top_k": 40,
            "top_p": 0.95,
            "min_p": 0.05,
            "repetition_penalty": 2,
            "seed": 2**63 - 1,
            "stop": ["\n", "."],
        }
    )
    req = parse(line, 2)
    sampling = Sampling(1.0, 40, 0.95, 2**63 - 1, min_p=0.05, repetition_penalty=2.0)
    assert req == Request(1, "a-1", tuple(encode("The fox")), 9, sampling, ("\n", "."))
    assert isinstance(req, Request) and type(req.sampling.temperature) is float
    assert type(req.sampling.repetition_penalty) is float


@pytest.mark.parametrize(
    ("fields", "min_p", "penalty"),
    [
        ({"min_p": 0}, 0.0, 1.0),
        ({"min_p": 0.999}, 0.999, 1.0),
        ({"min_p": None}, None, 1.0),  # null: off
        ({"repetition_penalty": 0.5}, None, 0.5),  # below 1 is allowed: it favours repeats
        ({"repetition_penalty": 1}, None, 1.0),  # 1: off
        ({"repetition_penalty": 1.2, "min_p": 0.1, "temperature": 0}, 0.1, 1.2),  # greedy keeps them
    ],
)
def test_min_p_and_repetition_penalty_fields(fields: dict, min_p: float | None, penalty: float) -> None:
    req = parse(json.dumps({"prompt": "hi", **fields}))
    assert isinstance(req, Request)
    assert (req.sampling.min_p, req.sampling.repetition_penalty) == (min_p, penalty)
    assert req.sampling.penalized == (penalty != 1.0)


def test_json_fields_default_to_the_options() -> None:
    defaults = B.Defaults(max_new_tokens=7, temperature=0.5, top_k=5, top_p=0.9, seed=3, stop=("x",))
    req = parse('{"prompt": "hi", "stop": "END", "id": 12}', 5, defaults)
    assert req == Request(4, 12, tuple(encode("hi")), 7, Sampling(0.5, 5, 0.9, 3), ("END",))
    req = parse('  {"prompt": "hi", "top_k": null, "top_p": null}', 5, defaults)
    assert isinstance(req, Request) and req.sampling == Sampling(0.5, None, None, 3) and req.stop == ("x",)
    req = parse('{"prompt": "hi", "temperature": 0}', 1, defaults)
    assert isinstance(req, Request) and req.sampling.greedy
    defaults = B.Defaults(max_new_tokens=7, temperature=0.5, min_p=0.1, repetition_penalty=1.3)
    req = parse('{"prompt": "hi"}', 1, defaults)
    assert isinstance(req, Request) and req.sampling == Sampling(0.5, min_p=0.1, repetition_penalty=1.3)
    req = parse('{"prompt": "hi", "min_p": null, "repetition_penalty": 1}', 1, defaults)
    assert isinstance(req, Request) and req.sampling == Sampling(0.5)
    req = parse('{"prompt": "hi", "min_p": 0.2}', 1, defaults)  # one field given, the other the option's
    assert isinstance(req, Request) and req.sampling == Sampling(0.5, min_p=0.2, repetition_penalty=1.3)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "hi"', "invalid JSON object"),
        ('{"prompt": "hi"} more', "invalid JSON object"),
        ("{not json}", "invalid JSON object"),
        ("{" * 100_000, "invalid JSON object"),
        ('{"prompt": "hi", "max_tokens": 5}', r'unknown field "max_tokens" \(fields: id, prompt, max_new_tokens'),
        ('{"seed": 3}', 'no prompt: a JSON request needs a "prompt" string'),
        ('{"prompt": "a", "messages": []}', 'gives "prompt" or "messages", not both'),
        ('{"messages": [{"role": "user"}]}', 'message 1: its "role" and "content" must be strings'),
        ('{"prompt": 5}', "prompt must be a string, got 5"),
        ('{"prompt": ["hi"]}', r'prompt must be a string, got \["hi"\]'),
        ('{"prompt": "hi", "max_new_tokens": 0}', "max_new_tokens must be >= 1, got 0"),
        ('{"prompt": "hi", "max_new_tokens": "5"}', 'max_new_tokens must be an integer, got "5"'),
        ('{"prompt": "hi", "max_new_tokens": 5.0}', "max_new_tokens must be an integer, got 5.0"),
        ('{"prompt": "hi", "max_new_tokens": true}', "max_new_tokens must be an integer, got true"),
        ('{"prompt": "hi", "temperature": -1}', r"temperature must be >= 0, got -1\.0"),
        ('{"prompt": "hi", "temperature": NaN}', "temperature must be >= 0, got nan"),
        ('{"prompt": "hi", "temperature": Infinity}', "temperature must be >= 0 and finite, got inf"),
        ('{"prompt": "hi", "temperature": 1e999}', "temperature must be >= 0 and finite, got inf"),
        ('{"prompt": "hi", "temperature": 1' + "0" * 400 + "}", "temperature is out of range"),
        ('{"prompt": "hi", "temperature": 0.0005}', r"temperature 0\.0005 is too small"),
        ('{"prompt": "hi", "temperature": "hot"}', 'temperature must be a number, got "hot"'),
        ('{"prompt": "hi", "top_k": 0}', "top_k must be >= 1, got 0"),
        ('{"prompt": "hi", "top_k": 1.5}', "top_k must be an integer, got 1.5"),
        ('{"prompt": "hi", "top_p": 0}', r"top_p must be in \(0, 1\], got 0\.0"),
        ('{"prompt": "hi", "top_p": 1.5}', r"top_p must be in \(0, 1\], got 1\.5"),
        ('{"prompt": "hi", "top_p": "0.9"}', 'top_p must be a number, got "0.9"'),
        ('{"prompt": "hi", "min_p": 1}', r"^min_p must be in \[0, 1\), got 1\.0$"),
        ('{"prompt": "hi", "min_p": -0.1}', r"^min_p must be in \[0, 1\), got -0\.1$"),
        ('{"prompt": "hi", "min_p": NaN}', r"^min_p must be in \[0, 1\), got nan$"),
        ('{"prompt": "hi", "min_p": "0.1"}', '^min_p must be a number, got "0.1"$'),
        ('{"prompt": "hi", "min_p": false}', "^min_p must be a number, got false$"),
        (
            '{"prompt": "hi", "repetition_penalty": 0}',
            r"^repetition_penalty must be between 0\.001 and 1000 \(1 = off\), got 0\.0$",
        ),
        ('{"prompt": "hi", "repetition_penalty": -1.5}', r"^repetition_penalty must be between .*, got -1\.5$"),
        (
            '{"prompt": "hi", "repetition_penalty": Infinity}',
            r"^repetition_penalty must be between .*, got inf$",
        ),
        ('{"prompt": "hi", "repetition_penalty": NaN}', r"^repetition_penalty must be between .*, got nan$"),
        ('{"prompt": "hi", "repetition_penalty": null}', "^repetition_penalty must be a number, got null$"),
        ('{"prompt": "hi", "repetition_penalty": "1.2"}', '^repetition_penalty must be a number, got "1.2"$'),
        ('{"prompt": "hi", "repetition_penalty": true}', "^repetition_penalty must be a number, got true$"),
        ('{"prompt": "hi", "repetition_penalty": 1' + "0" * 400 + "}", "^repetition_penalty is out of range"),
        ('{"prompt": "hi", "min_p": 0.1, "temperature": 0, "repetition_penalty": 0}', "^repetition_penalty must"),
        ('{"prompt": "hi", "seed": -1}', r"^seed must be between 0 and 2\^63-1, got -1"),
        ('{"prompt": "hi", "seed": 9223372036854775808}', r"seed must be between 0 and 2\^63-1"),
        ('{"prompt": "hi", "seed": 1.0}', "seed must be an integer, got 1.0"),
        ('{"prompt": "hi", "stop": 5}', "stop must be a string or a list of strings, got 5"),
        ('{"prompt": "hi", "stop": ["a", 1]}', "stop must be a string or a list of strings"),
        ('{"prompt": "hi", "stop": ""}', "stop strings must not be empty"),
        ('{"prompt": "hi", "stop": null}', "stop must be a string or a list of strings, got null"),
        ('{"prompt": "hi", "id": null}', "id must be a string or an integer, got null"),
        ('{"prompt": "hi", "id": true}', "id must be a string or an integer, got true"),
        ('{"prompt": "hi", "id": [1]}', r"id must be a string or an integer, got \[1\]"),
        ('{"prompt": "a\\ud800b"}', r"prompt is not valid Unicode \(a lone surrogate at character 1\)"),
        ('{"prompt": "hi", "stop": ["' + "s" * 100 + '", 1]}', r'strings, got \["s{35}\.\.\.$'),
        ('{"prompt": ""}', "empty prompt"),
        ('{"prompt": " \\n\\t"}', "empty prompt"),
        ("", "empty prompt"),
        ("   \t", "empty prompt"),
        ("x" * 60, r"^prompt \(60 tokens\) \+ max_new_tokens 8 \+ k\+1 exceeds the model's context of 64 tokens$"),
    ],
)
def test_bad_lines_are_rejected(line: str, message: str) -> None:
    item = rejected(line, 7)
    assert re.search(message, item.error), item.error
    assert item.id == 7 and "\n" not in item.error


def test_a_rejected_line_keeps_its_own_id() -> None:
    assert rejected('{"id": "q9", "prompt": "hi", "top_k": 0}', 3).id == "q9"
    assert rejected('{"id": "m", "prompt": "hi", "min_p": 2}', 3) == B.Rejected(
        2, "m", "min_p must be in [0, 1), got 2.0"
    )
    assert rejected('{"id": 0, "prompt": ""}', 3).id == 0
    assert rejected('{"id": 1.5, "prompt": "hi"}', 3).id == 3  # a bad id: the line number


def test_context_edge() -> None:
    """prompt + max_new_tokens + k + 1 may reach the context exactly, not pass it."""
    for k in (0, 4):
        n = CTX - 10 - k - 1
        assert isinstance(parse(json.dumps({"prompt": "x" * 10, "max_new_tokens": n}), k=k), Request)
        item = parse(json.dumps({"prompt": "x" * 10, "max_new_tokens": n + 1}), k=k)
        assert isinstance(item, B.Rejected) and "exceeds the model's context of 64 tokens" in item.error


def test_a_prompt_with_no_tokens_is_empty() -> None:
    item = B.parse_line("hello", 1, B.Defaults(), lambda text: [], CTX)
    assert isinstance(item, B.Rejected) and item.error == "empty prompt"


def test_parse_lines_one_item_a_line() -> None:
    raw = io.BytesIO(b'plain\r\n\n{"prompt": "caf\xc3\xa9"}\nbad \xff byte\n   \nlast without newline')
    items = list(B.parse_lines(raw, B.Defaults(max_new_tokens=4), encode, CTX))
    assert [i.index for i in items] == [0, 1, 2, 3, 4, 5]
    assert isinstance(items[0], Request) and items[0].prompt == tuple(encode("plain"))  # \r\n dropped
    assert items[1] == B.Rejected(1, 2, "empty prompt")  # an empty line in the middle is a request
    assert isinstance(items[2], Request) and items[2].prompt == tuple(encode("café"))
    assert items[3] == B.Rejected(3, 4, "not valid UTF-8 (byte 4)")
    assert items[4] == B.Rejected(4, 5, "empty prompt")
    assert isinstance(items[5], Request) and items[5].prompt == tuple(encode("last without newline"))
    assert len(list(B.parse_lines(io.BytesIO(b"a\nb\n"), B.Defaults(max_new_tokens=4), encode, CTX))) == 2
    assert list(B.parse_lines(io.BytesIO(b""), B.Defaults(), encode, CTX)) == []


def test_a_unicode_line_separator_stays_in_its_line() -> None:
    raw = io.BytesIO("one\u2028two\x0bthree\x85four\n".encode())
    (item,) = B.parse_lines(raw, B.Defaults(max_new_tokens=4), encode, CTX)
    assert isinstance(item, Request) and item.prompt == tuple(encode("one\u2028two\x0bthree\x85four"))


# --- writing -------------------------------------------------------------------------------------
def fin(index: int, rid: str | int | None = None) -> Finished:
    req = Request(index, index + 1 if rid is None else rid, (1, 2), 3)
    return Finished(req, f"text {index}", [5, 6, 7], {"new_tokens": 3})


def test_answers() -> None:
    assert B.answer(fin(0, "x")) == {"id": "x", "text": "text 0", "tokens": [5, 6, 7], "stats": {"new_tokens": 3}}


def test_ordered_writer_holds_answers_until_their_turn() -> None:
    out = io.StringIO()
    w = B.Writer(out, ordered=True)
    w.put(2, {"id": 3})
    w.put(1, {"id": 2})
    assert out.getvalue() == "" and len(w.waiting) == 2
    w.put(0, {"id": 1})
    assert [json.loads(x)["id"] for x in out.getvalue().splitlines()] == [1, 2, 3] and len(w.waiting) == 0
    w.put(5, {"id": 6})
    w.put(4, {"id": 5})
    with pytest.raises(ValueError, match="a second answer to input line 5"):
        w.put(4, {"id": 5})
    with pytest.raises(ValueError, match="a second answer to input line 1"):
        w.put(0, {"id": 1})
    w.close()  # line 4's answer never came: what is held still goes out, in order
    assert [json.loads(x)["id"] for x in out.getvalue().splitlines()] == [1, 2, 3, 5, 6]


def test_line_writer_writes_as_answers_come() -> None:
    out = io.StringIO()
    w = B.Writer(out)
    w.put(2, {"id": 3, "text": "caf\u00e9\n"})
    w.put(0, {"id": 1})
    assert out.getvalue() == '{"id": 3, "text": "caf\\u00e9\\n"}\n{"id": 1}\n'


class Pipe(io.StringIO):
    """A stdout whose reader goes away after `lines` lines: each write is kept, then a flush fails."""

    def __init__(self, lines: int) -> None:
        super().__init__()
        self.left = lines
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)

    def flush(self) -> None:
        if self.left == 0:
            raise BrokenPipeError(32, "Broken pipe")
        self.left -= 1


def test_a_broken_pipe_is_output_closed() -> None:
    out = Pipe(lines=2)
    w = B.Writer(out, ordered=True)
    w.put(0, {"id": 1})
    w.put(1, {"id": 2})
    with pytest.raises(B.OutputClosed):
        w.put(2, {"id": 3})
    assert out.writes == ['{"id": 1}\n', '{"id": 2}\n', '{"id": 3}\n']  # one write a line


def test_ctrl_c_waits_for_the_line_end() -> None:
    before = signal.getsignal(signal.SIGINT)
    wrote = []
    with pytest.raises(KeyboardInterrupt):
        with cli_batch.whole_line():
            os.kill(os.getpid(), signal.SIGINT)
            wrote.append("line")  # still runs: the Ctrl-C waits
    assert wrote == ["line"]
    with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C does not wait
        with cli_batch.whole_line():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            wrote.append("never")
    assert wrote == ["line"]
    assert signal.getsignal(signal.SIGINT) is before  # put back


# --- the command, with a fake engine ---------------------------------------------------------------
class FakeEngine:
    """Pulls `window` requests, then answers them last first; `interrupt_after` answers, a Ctrl-C."""

    def __init__(self, window: int = 3, interrupt_after: int | None = None) -> None:
        self.window, self.interrupt_after = window, interrupt_after
        self.requests: list[Request] = []
        self.config: Any = None

    def build(self, config: Any) -> FakeEngine:
        """`engine.build.build`: what the command asked for is kept, nothing is allocated."""
        self.config, self.max_batch, self.context = config, config.max_batch, config.target.cfg.max_seq_len
        return self

    def _answer(self, req: Request) -> Finished:
        tokens = list(range(1, min(req.max_new_tokens, 3) + 1))
        return Finished(req, self.config.decode(tokens), tokens, {"new_tokens": len(tokens)})

    def run(self, requests: Iterable[Request], progress: Callable[[Any], None] | None = None) -> Iterator[Finished]:
        held: list[Request] = []
        answered = 0

        def flush() -> Iterator[Finished]:
            nonlocal answered
            while held:
                if answered == self.interrupt_after:
                    raise KeyboardInterrupt
                answered += 1
                yield self._answer(held.pop())
                if progress is not None:
                    progress(SimpleNamespace(done=answered, tokens=3 * answered, elapsed_s=0.5, acceptance=0.75))

        for req in requests:
            self.requests.append(req)
            held.append(req)
            if len(held) == self.window:
                yield from flush()
        yield from flush()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeEngine:
    engine = FakeEngine()
    monkeypatch.setattr(engine_build, "build", engine.build)
    return engine


def batch(family: Family, *args: str, input: str | bytes | None = None) -> Result:
    return CliRunner().invoke(app, ["batch", *args, "--target", str(family.target)], input=input)


def answers(result: Result) -> list[dict]:
    assert result.exit_code == 0, (result.exit_code, result.stderr, result.exception)
    assert result.stdout.endswith("\n")
    return [json.loads(line) for line in result.stdout.splitlines()]


LINES = [
    "In the beginning",  # 1
    '{"id": "b", "prompt": "The quick brown fox", "max_new_tokens": 2}',  # 2
    "",  # 3: an empty request
    '{"prompt": "x", "top_p": 2}',  # 4
    "Speculative decoding",  # 5
    "{broken",  # 6
    '{"prompt": "last", "temperature": 0.7, "seed": 5, "stop": "."}',  # 7
]


def test_each_line_one_answer_as_they_finish(family: Family, fake: FakeEngine) -> None:
    res = batch(family, "-q", input="\n".join(LINES) + "\n")
    out = answers(res)
    assert res.stderr == ""  # --quiet
    assert len(out) == len(LINES)
    assert sorted(map(str, (a["id"] for a in out))) == sorted(["1", "b", "3", "4", "5", "6", "7"])
    # the engine's order: it pulled 1, b, 5 (the bad lines answered as they were read), answered them last first
    assert [a["id"] for a in out] == [3, 4, 5, "b", 1, 6, 7]
    by_id = {a["id"]: a for a in out}
    assert by_id[3] == {"id": 3, "error": "empty prompt"}
    assert by_id[4]["error"] == "top_p must be in (0, 1], got 2.0"
    assert by_id[6] == {"id": 6, "error": "invalid JSON object"}
    assert by_id["b"]["tokens"] == [1, 2] and set(by_id["b"]) == {"id", "text", "tokens", "stats"}
    assert by_id[1]["tokens"] == [1, 2, 3] and by_id[1]["stats"] == {"new_tokens": 3}
    assert [r.id for r in fake.requests] == [1, "b", 5, 7]
    assert fake.requests[3].sampling == Sampling(0.7, None, None, 5) and fake.requests[3].stop == (".",)


def test_ordered_answers_keep_the_input_order(family: Family, fake: FakeEngine, tmp_path: Path) -> None:
    path = tmp_path / "requests.txt"
    path.write_text("\n".join(LINES))  # no newline after the last line: it is a line all the same
    out = answers(batch(family, str(path), "--ordered", "-q"))
    assert [a["id"] for a in out] == [1, "b", 3, 4, 5, 6, 7]
    assert ["error" in a for a in out] == [False, False, True, True, False, True, False]


def test_options_are_the_defaults_and_reach_the_engine(family: Family, fake: FakeEngine) -> None:
    args = ["-n", "7", "--temperature", "0.5", "--top-k", "5", "--top-p", "0.9", "--seed", "3", "-q"]
    answers(batch(family, *args, "--max-batch", "4", "-k", "2", "--proposer-vocab", "64", input="one\ntwo\n"))
    assert [r.sampling for r in fake.requests] == [Sampling(0.5, 5, 0.9, 3)] * 2
    assert [r.max_new_tokens for r in fake.requests] == [7, 7]
    c = fake.config
    assert c.proposer.name == D.PROPOSER["sample"] and c.target.embed_tokens.weight.device.type == "cpu"
    assert (c.k, c.max_batch, c.proposer.head.rows.shape[0], tuple(c.end_ids)) == (2, 4, 64, (0,))
    answers(batch(family, "-q", input="one\n"))
    c = fake.config
    assert c.proposer.name == D.PROPOSER["greedy"]
    assert (c.k, c.max_batch, c.proposer.head.ids) == (None, D.MAX_BATCH, None)  # the whole head: 300 < 1024
    assert fake.requests[-1].max_new_tokens == D.MAX_NEW_TOKENS and fake.requests[-1].sampling == Sampling()


def test_min_p_and_repetition_penalty_options_reach_each_request(family: Family, fake: FakeEngine) -> None:
    lines = [
        "plain",
        '{"prompt": "json"}',
        '{"prompt": "own", "min_p": 0.2, "repetition_penalty": 0.8}',
        '{"prompt": "off", "min_p": null, "repetition_penalty": 1}',
        '{"prompt": "bad", "repetition_penalty": 0}',
    ]
    args = ["--temperature", "0.7", "--min-p", "0.05", "--repetition-penalty", "1.3", "--ordered", "-q"]
    out = answers(batch(family, *args, input="\n".join(lines)))
    assert out[4] == {"id": 5, "error": "repetition_penalty must be between 0.001 and 1000 (1 = off), got 0.0"}
    assert [r.id for r in fake.requests] == [1, 2, 3, 4]
    assert [(r.sampling.min_p, r.sampling.repetition_penalty) for r in fake.requests] == [
        (0.05, 1.3),
        (0.05, 1.3),
        (0.2, 0.8),
        (None, 1.0),
    ]
    assert fake.requests[0].sampling == Sampling(0.7, min_p=0.05, repetition_penalty=1.3)
    answers(batch(family, "-q", "--repetition-penalty", "1.1", input="greedy\n"))  # greedy: the penalty stays
    assert fake.requests[-1].sampling == Sampling(repetition_penalty=1.1) and fake.requests[-1].sampling.penalized


def test_the_context_check_leaves_room_for_k(family: Family, fake: FakeEngine) -> None:
    """A request must fit the target's context with its budget and a verify pass (k+1)."""
    n = FAMILY_CFG.max_seq_len - 1 - (4 + 1)  # "x" is one token; k=4 when mtp's default
    lines = [json.dumps({"prompt": "x", "max_new_tokens": n}), json.dumps({"prompt": "x", "max_new_tokens": n + 1})]
    out = answers(batch(family, "--ordered", "-q", "--proposer", "mtp", input="\n".join(lines)))
    assert "error" not in out[0] and "exceeds the model's context of 256 tokens" in out[1]["error"]
    out = answers(batch(family, "--ordered", "-q", "--proposer", "none", input="\n".join(lines)))
    assert "error" not in out[1]  # no guesses: one token's room


def test_the_summary_on_stderr(family: Family, fake: FakeEngine) -> None:
    res = batch(family, input="one\n\ntwo\n")
    assert len(answers(res)) == 3
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("3 requests (1 rejected): 6 tokens in ") and lines[0].endswith("acceptance 0.75")


def test_a_progress_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    screen = io.StringIO()
    monkeypatch.setattr(cli_batch, "err", Console(file=screen, force_terminal=True, width=100))
    shown = cli_batch.Display(show=True)
    shown.progress(SimpleNamespace(done=1, tokens=30, elapsed_s=2.0, acceptance=0.5))
    shown.answer(tokens=30)
    shown.answer(rejected=True)
    shown.stop()
    shown.stop()
    assert "15.0 tok/s, acceptance 0.50" in screen.getvalue() and "batch 2 done" in screen.getvalue()
    assert shown.summary().startswith("2 requests (1 rejected): 30 tokens in ")


def test_ctrl_c_leaves_whole_lines_and_exits_130(family: Family, fake: FakeEngine) -> None:
    fake.interrupt_after = 2
    res = batch(family, input="one\ntwo\nthree\nfour\n")
    assert res.exit_code == 130
    assert res.stderr == "interrupted\n"
    assert res.stdout.endswith("\n")
    assert [json.loads(line)["id"] for line in res.stdout.splitlines()] == [3, 2]


def test_an_empty_input_is_no_error(family: Family, fake: FakeEngine) -> None:
    res = batch(family, "-q", input="")
    assert res.exit_code == 0 and res.stdout == "" and res.stderr == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-n", "0"], r"--max-new-tokens must be >= 1, got 0"),
        (["--max-batch", "0"], r"--max-batch must be >= 1, got 0"),
        (["--temperature", "-1"], r"temperature must be >= 0, got -1\.0"),
        (["--temperature", "0.0001"], r"temperature 0\.0001 is too small"),
        (["--top-p", "2"], r"top-p must be in \(0, 1\], got 2\.0"),
        (["--top-k", "0"], r"top-k must be >= 1, got 0"),
        (["--min-p", "1"], r"--min-p must be in \[0, 1\), got 1\.0"),
        (["--min-p", "-0.5"], r"--min-p must be in \[0, 1\), got -0\.5"),
        (["--min-p", "nan"], r"--min-p must be in \[0, 1\), got nan"),
        (["--repetition-penalty", "0"], r"--repetition-penalty must be between 0\.001 and 1000 \(1 = off\), got 0\.0"),
        (["--repetition-penalty", "inf"], r"--repetition-penalty must be between 0\.001 and 1000 \(1 = off\), got inf"),
        (["--seed", "-1"], r"--seed must be between 0 and 2\^63-1, got -1"),
        (["-k", "99"], r"k must be between 1 and 64, got 99"),
        (["--proposer-vocab", "-1"], r"--proposer-vocab must be >= 0, got -1"),
        (["--threads", "0"], r"--threads must be between 1 and \d+ .*, got 0"),
        (["--device", "tpu"], r"unknown device 'tpu'"),
        (["--engine", "turbo"], r"unknown engine 'turbo'"),
        (["--engine", "compiled"], r"unknown engine 'compiled': use auto, eager, native"),
        (["no-such-file.txt"], r"input file not found: no-such-file\.txt"),
        (["."], r"cannot read \."),
    ],
)
def test_bad_options_are_refused(family: Family, fake: FakeEngine, args: list[str], message: str) -> None:
    res = batch(family, *args, input="hello\n")
    refused(res, message)
    assert res.exit_code == 2 and fake.requests == []


def test_a_missing_target_is_refused(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["batch", "--target", str(tmp_path / "nothing.safetensors")], input="hi\n")
    refused(res, r"checkpoint not found: .*nothing\.safetensors")


def test_no_input_on_a_terminal_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(isatty=lambda: True, buffer=io.BytesIO()))
    with pytest.raises(UsageError, match="no requests: give a FILE, or pipe them on stdin"):
        cli_batch.open_input(None)
    assert cli_batch.open_input("-") is sys.stdin.buffer  # `-` reads a terminal too, line by line


# --- a broken pipe and a Ctrl-C, as a shell gives them ----------------------------------------------
FAKE_RUN = """
import os, sys, time
from types import SimpleNamespace
from smallem_cli.cli import batch as cli_batch
from smallem_cli.engine.request import Finished

def run(requests, progress=None):
    for r in requests:
        time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
        yield Finished(r, "x" * 200, [1, 2, 3], {})

from smallem_cli.engine import build
build.build = lambda c: SimpleNamespace(run=run, max_batch=c.max_batch, context=c.target.cfg.max_seq_len)
from smallem_cli.cli import main
sys.argv[0] = "smallem"
main()
"""


def smallem_batch(family: Family, path: Path, sleep: float = 0.0) -> subprocess.Popen:
    """`smallem batch PATH` in a process of its own, its engine a fake one answering every `sleep` s."""
    argv = [sys.executable, "-c", FAKE_RUN, "batch", str(path), "--target", str(family.target)]
    env = os.environ | {"PYTHONPATH": str(REPO), "FAKE_SLEEP": str(sleep)}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def test_a_closed_pipe_ends_quietly(family: Family, tmp_path: Path) -> None:
    """`smallem batch f | head -1`: the reader goes after one line; no traceback, exit 141."""
    path = tmp_path / "many.txt"
    path.write_text("hello\n" * 3000)  # far more answers than a pipe holds
    p = smallem_batch(family, path)
    assert p.stdout is not None and p.stderr is not None
    first = json.loads(p.stdout.readline())
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141, err
    assert first["id"] == 1 and err == ""


def test_ctrl_c_in_a_run_exits_130(family: Family, tmp_path: Path) -> None:
    """A real SIGINT in the middle of the answers: whole lines on stdout, one line on stderr."""
    path = tmp_path / "many.txt"
    path.write_text("hello\n" * 3000)
    p = smallem_batch(family, path, sleep=0.002)
    assert p.stdout is not None
    first = p.stdout.readline()
    p.send_signal(signal.SIGINT)
    rest, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert err.decode() == "interrupted\n"
    lines = [first, *rest.splitlines(keepends=True)]
    assert all(line.endswith(b"\n") for line in lines)
    assert [json.loads(line)["id"] for line in lines] == list(range(1, len(lines) + 1))
    assert len(lines) < 3000


# --- end to end, through the real engine -------------------------------------------------------------
def test_the_real_engine_matches_generate(family: Family) -> None:
    prompts = ["The quick brown fox", "In the beginning was", "Speculative decoding guesses"]
    lines = [*prompts[:2], "", json.dumps({"id": "c", "prompt": prompts[2], "max_new_tokens": 5})]
    out = answers(batch(family, "--ordered", "-q", "-n", "12", "--max-batch", "2", input="\n".join(lines)))
    assert [a["id"] for a in out] == [1, 2, 3, "c"] and out[2] == {"id": 3, "error": "empty prompt"}
    for prompt, a, n in zip(prompts, [out[0], out[1], out[3]], [12, 12, 5], strict=True):
        ref = CliRunner().invoke(
            app, ["generate", prompt, "--target", str(family.target), "-n", str(n), "--json", "-q"]
        )
        assert ref.exit_code == 0, ref.stderr
        want = json.loads(ref.stdout)
        assert a["tokens"] == want["tokens"] and a["text"] == want["text"]
        assert a["stats"]["new_tokens"] == len(a["tokens"])


def test_the_native_and_eager_engines_answer_alike(family: Family) -> None:
    """`--engine native` (every pass one C call) and `--engine eager` give the same tokens, and the
    native one serves this family (no line saying it cannot)."""
    lines = "The quick brown fox\nIn the beginning was\nSpeculative decoding guesses\n"
    got = {}
    for e in ("eager", "native"):
        res = batch(family, "--ordered", "-n", "16", "--max-batch", "2", "--engine", e, input=lines)
        assert res.exit_code == 0 and "unavailable" not in res.stderr, res.stderr
        got[e] = [a["tokens"] for a in answers(res)]
    assert got["eager"] == got["native"] and any(got["native"])


def test_the_real_engine_refuses_a_bad_proposer(family: Family) -> None:
    refused(batch(family, "--proposer", "draft-9l", input="hello\n"), r"checkpoint not found: draft-9l")


def test_the_real_engine_cuts_at_a_stop_string(family: Family) -> None:
    (full,) = answers(batch(family, "-q", "-n", "30", "--proposer", "none", input="The quick brown fox\n"))
    stop = full["text"][5:7]
    line = json.dumps({"prompt": "The quick brown fox", "max_new_tokens": 30, "stop": [stop]})
    (cut,) = answers(batch(family, "-q", "--proposer", "none", input=line))
    assert full["text"].startswith(cut["text"]) and stop not in cut["text"]
    assert len(cut["text"]) <= 5
