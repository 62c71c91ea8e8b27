"""`smallem batch`'s input and output: a request a line (plain text, or a JSON object of `FIELDS` whose
fields left out take the options), and exactly one JSON answer line per line, an error included (a blank
line, a repeated id, a line over `max_line_bytes`, never held whole). Each answer is one write and a flush."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, replace
from typing import BinaryIO, TextIO

from .. import options
from ..defaults import LINE_BYTES_PER_TOKEN, MAX_LINE_BYTES, MAX_NEW_TOKENS, SEED, TEMPERATURE
from ..engine.request import Finished, Request
from ..errors import BadField, UsageError
from ..options import READERS
from ..spec.sampling import Sampling

Encode = Callable[[str | list[dict[str, str]]], Sequence[int]]  # a text, or a conversation (its template's) -> ids
Record = dict[str, object]


@dataclass(frozen=True)
class Defaults:
    """What a request leaves out: the command line's options."""

    max_new_tokens: int = MAX_NEW_TOKENS
    temperature: float = TEMPERATURE
    top_k: int | None = None
    top_p: float | None = None
    seed: int = SEED
    stop: tuple[str, ...] = ()
    min_p: float | None = None
    repetition_penalty: float = 1.0


@dataclass(frozen=True)
class Rejected:
    """A line that is no valid request: answered with its error, never given to the engine."""

    index: int  # position in the input, 0-based, as Request.index
    id: str | int  # the line's own id where it gave a valid one, else its line number
    error: str


FIELDS = ("id", "prompt", *READERS, "messages")
_OFF = ("top_k", "top_p", "min_p")  # `null` turns these off


def parse_line(
    line: str, lineno: int, defaults: Defaults, encode: Encode, max_len: int, k: int = 0
) -> Request | Rejected:
    """One input line (`lineno` 1-based) -> a checked Request whose prompt, max_new_tokens and a pass of k
    draft tokens fit in max_len, or why it is none."""
    index, rid = lineno - 1, lineno
    prompt, opts = line, defaults
    try:
        if line.lstrip().startswith("{"):
            obj = options.json_value(line)
            if not isinstance(obj, dict):  # (a line opening with `{` is an object or no JSON at all)
                return Rejected(index, rid, "invalid JSON object")
            if "id" in obj:  # a bad id is answered under the line's number
                if type(obj["id"]) not in (str, int):
                    raise BadField(f"id must be a string or an integer, got {options.shown(obj['id'])}")
                rid = obj["id"]
            if unknown := sorted(set(obj) - set(FIELDS)):
                raise BadField(f"unknown field {options.shown(unknown[0])} (fields: {', '.join(FIELDS)})")
            if "prompt" in obj and "messages" in obj:
                raise BadField('a JSON request gives "prompt" or "messages", not both')
            if "messages" in obj:  # a conversation, through the target's chat template
                prompt = options.conversation(obj["messages"])
            elif "prompt" not in obj:
                raise BadField('no prompt: a JSON request needs a "prompt" string (or "messages")')
            elif not isinstance(prompt := obj["prompt"], str):
                raise BadField(f"prompt must be a string, got {options.shown(prompt)}")
            given = {
                n: None if obj[n] is None and n in _OFF else read(n, obj[n]) for n, read in READERS.items() if n in obj
            }
            opts = replace(defaults, **given)  # the fields given override the options'
        sampling = Sampling(opts.temperature, opts.top_k, opts.top_p, opts.seed, opts.min_p, opts.repetition_penalty)
        options.check_sampling(**asdict(sampling), max_new_tokens=opts.max_new_tokens)
        for text in [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]:
            if isinstance(prompt, str) and not text.strip():
                raise BadField("empty prompt")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:  # JSON's "\ud800": no text a tokenizer takes
                raise BadField(f"prompt is not valid Unicode (a lone surrogate at character {e.start})") from None
        ids = tuple(encode(prompt))
        if not ids:
            raise BadField("empty prompt")
        options.check_context(len(ids), opts.max_new_tokens, k, max_len)
    except BadField as e:
        return Rejected(index, rid, str(e))
    except UsageError as e:
        return Rejected(index, rid, options.field_message(e))
    return Request(index, rid, ids, opts.max_new_tokens, sampling, opts.stop)


def max_line_bytes(max_len: int) -> int:
    """A request line's bytes (before its `\\n`) at most, for a target of context max_len."""
    return max(MAX_LINE_BYTES, max_len * LINE_BYTES_PER_TOKEN)


_DROP_CHUNK = 1 << 16  # bytes read at a time from the rest of a line too long to keep


def read_lines(source: BinaryIO, limit: int) -> Iterator[bytes | None]:
    """A binary file's lines (`\\n` kept), None for a line of more than `limit` bytes: memory stays bounded."""
    while True:
        raw = source.readline(limit + 1)  # one byte more than a line may have: its `\n`, or too long
        if not raw:
            return
        if len(raw) <= limit or raw.endswith(b"\n"):
            yield raw
            continue
        while raw and not raw.endswith(b"\n"):  # the rest of the line, dropped as it comes
            raw = source.readline(_DROP_CHUNK)
        yield None


def parse_lines(
    source: BinaryIO, defaults: Defaults, encode: Encode, max_len: int, k: int = 0, max_bytes: int | None = None
) -> Iterator[Request | Rejected]:
    """A binary file's lines -> one Request or Rejected each, lazily; max_bytes: a line's limit. To tell a
    repeated id, only the ids lines gave (a line's number is its default id), and which lines, are kept."""
    limit = max_line_bytes(max_len) if max_bytes is None else max_bytes
    given: dict[str | int, int] = {}  # an id a line gave (other than its number) -> the first such line
    renamed: set[int] = set()  # the lines answered under another id than their number
    for lineno, raw in enumerate(read_lines(source, limit), 1):
        item = _parse_raw(raw, lineno, limit, defaults, encode, max_len, k)
        rid = item.id
        if type(rid) is int and rid == lineno:  # its own number: taken only by an earlier line that gave it
            first = given.get(rid)
        else:
            renamed.add(lineno)
            first = given.setdefault(rid, lineno)
            if first == lineno:  # an earlier line may have answered under its number, which this one gives
                first = rid if type(rid) is int and 1 <= rid < lineno and rid not in renamed else None
        if first is not None:
            item = Rejected(item.index, rid, f"duplicate id {options.shown(rid)}: line {first} has it too")
        yield item


def _parse_raw(
    raw: bytes | None, lineno: int, limit: int, defaults: Defaults, encode: Encode, max_len: int, k: int
) -> Request | Rejected:
    if raw is None:  # read_lines dropped it: nothing reads the line
        return Rejected(lineno - 1, lineno, f"line too long: over {limit} bytes")
    try:
        line = raw.removesuffix(b"\n").removesuffix(b"\r").decode("utf-8")
    except UnicodeDecodeError as e:
        return Rejected(lineno - 1, lineno, f"not valid UTF-8 (byte {e.start})")
    return parse_line(line, lineno, defaults, encode, max_len, k)


def answer(fin: Finished) -> Record:
    return {"id": fin.request.id, "text": fin.text, "tokens": list(fin.tokens), "stats": fin.stats}


class OutputClosed(Exception):
    """The reader of the answers went away (a broken pipe): nothing more can be written."""


class Writer:
    """Writes each answer as one JSON line, one write and a flush inside `guard()` (no Ctrl-C mid-line);
    a broken pipe raises OutputClosed. `ordered`: each answer waits until every earlier line's is out."""

    def __init__(
        self, out: TextIO, guard: Callable[[], AbstractContextManager[object]] = nullcontext, ordered: bool = False
    ) -> None:
        self.out, self.guard, self.ordered = out, guard, ordered
        self.next = 0  # ordered: the index whose answer goes out next
        self.waiting: dict[int, Record] = {}

    def put(self, index: int, record: Record) -> None:
        """The answer to input line `index` (0-based)."""
        if not self.ordered:
            self.write(record)
            return
        if index < self.next or index in self.waiting:
            raise ValueError(f"a second answer to input line {index + 1}")
        self.waiting[index] = record
        while self.next in self.waiting:
            record = self.waiting.pop(self.next)
            self.next += 1
            self.write(record)

    def write(self, record: Record) -> None:
        line = json.dumps(record) + "\n"
        try:
            with self.guard():
                self.out.write(line)
                self.out.flush()
        except BrokenPipeError:
            raise OutputClosed from None

    def close(self) -> None:
        """The end of the run: answers still held go out in input order; lines never answered are missing."""
        for index in sorted(self.waiting):
            record = self.waiting.pop(index)
            self.next = index + 1
            self.write(record)
