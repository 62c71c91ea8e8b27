"""`generate`'s sampling options beyond temperature, top-k and top-p: --min-p, --repetition-penalty
and --stop. Exactness of the first two is tested in test_verify (chi-square) and test_generate
(greedy identity); here, stop strings (the cutting helper, then end to end) and the command line.
"""

from __future__ import annotations

import io
import random

import pytest
from conftest import Family
from test_cli import as_json, generate, ok, refused

from smallem_cli.defaults import TOKENIZER as SHIPPED_TOKENIZER
from smallem_cli.engine.stops import StopCutter, StopPrinter, partial_tail, stop_index
from smallem_cli.model.tokenizer import load_tokenizer

# ----------------------------------------------------------------------------- stop_index


def test_stop_index_finds_the_earliest_stop() -> None:
    assert stop_index("and the end. And then", ["And", "end"]) == 8
    assert stop_index("and the end", ["END"]) is None  # case matters
    assert stop_index("abcabc", ["bc"], start=2) == 4
    assert stop_index("abc", []) is None
    assert stop_index("abc", [""]) is None  # an empty stop string is no stop string


def test_partial_tail_is_the_longest_start_of_a_stop() -> None:
    assert partial_tail("the wor", ["world"]) == 3
    assert partial_tail("the wor", ["word", "r"]) == 3  # "r" alone is whole, "wor" starts "word"
    assert partial_tail("xyz", ["world"]) == 0
    assert partial_tail("a world", ["world"]) == 0  # a whole stop is found, not held back
    assert partial_tail("aaa", ["aaab"]) == 3
    assert partial_tail("ab", ["abc", "bcd"]) == 2
    assert partial_tail("", ["abc"]) == 0


# ----------------------------------------------------------------------------- StopCutter


def feed(chunks: list[str], stops: list[str]) -> tuple[str, bool, list[int]]:
    """Feed text chunk by chunk as a generation would: -> (what was printed, stopped, each cut)."""
    cutter, text, printed, cuts = StopCutter(stops), "", "", []
    for chunk in chunks:
        text += chunk
        end = cutter.cut(text)
        cuts.append(end)
        assert end >= len(printed)  # nothing printed is taken back
        printed = text[:end]
        if cutter.stopped is not None:
            return printed, True, cuts
    end = cutter.cut(text, final=True)
    return text[:end], False, [*cuts, end]


def test_a_stop_split_across_chunks_is_held_back_then_cut() -> None:
    printed, stopped, cuts = feed(["Hello, Wo", "rld and more"], ["World"])
    assert stopped and printed == "Hello, "
    assert cuts == [7, 7]  # "Wo" held back at the first chunk: it could begin "World"


def test_a_held_back_tail_that_is_no_stop_comes_out() -> None:
    printed, stopped, cuts = feed(["Hello, Wo", "ndrous"], ["World"])
    assert not stopped and printed == "Hello, Wondrous"
    assert cuts == [7, 15, 15]
    printed, stopped, cuts = feed(["end: Wor"], ["World"])  # held back until the end, then printed
    assert not stopped and printed == "end: Wor" and cuts == [5, 8]


def test_a_stop_in_one_chunk_and_the_earliest_of_several() -> None:
    assert feed(["one two three"], ["three", "two"])[:2] == ("one ", True)
    assert feed(["a", "b", "c", "d"], ["bcd", "cd"])[:2] == ("a", True)  # bcd begins first
    assert feed(["x", "\n", "\n", "y"], ["\n\n"])[:2] == ("x", True)
    assert feed(["abc"], [])[:2] == ("abc", False)


def test_cutting_matches_a_cut_of_the_whole_text() -> None:
    """Random texts in random chunks: the printed text is the whole text cut before its first stop."""
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        bounds = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if text else []
        chunks = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
        at = stop_index(text, stops)
        printed, stopped, _ = feed(chunks, stops)
        assert (printed, stopped) == ((text, False) if at is None else (text[:at], True)), (text, stops, chunks)


# ---------------------------------------------------------------------------- StopPrinter


class ByteTokenizer:
    """One token per byte, decoded as UTF-8 with replacement: a character may span tokens."""

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def tokens(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def test_printer_stops_and_keeps_the_tokens_through_the_stop() -> None:
    out = io.StringIO()
    p = StopPrinter(ByteTokenizer().decode, out, ["END"])
    assert not p.push(tokens("abc E"))
    assert out.getvalue() == "abc "  # "E" held back
    assert not p.push(tokens("N"))
    assert p.push(tokens("D and on"))  # the stop is complete: stop generating
    assert p.push(tokens("more")) and p.push([], final=True)  # anything later changes nothing
    assert out.getvalue() == p.text == "abc "
    assert p.ids == tokens("abc END")  # up to the token that completed the stop


def test_printer_waits_for_a_stop_that_began_earlier() -> None:
    """'a' is complete at "bca", but "caa" began before it and may still come: the text ends before
    the earliest stop string whatever the chunks, so the printer waits for the next tokens."""
    for chunks in (["bca", "ac"], ["b", "c", "a", "a"], ["bcaac"]):
        out = io.StringIO()
        p = StopPrinter(ByteTokenizer().decode, out, ["caa", "a"])
        stops = [p.push(tokens(c)) for c in chunks]
        assert stops[-1] and not any(stops[:-1])
        assert out.getvalue() == p.text == "b" and p.ids == tokens("bcaa")
    out = io.StringIO()
    p = StopPrinter(ByteTokenizer().decode, out, ["caa", "a"])
    assert not p.push(tokens("bca")) and p.push(tokens("b"))  # "cab": no "caa", so "a" ends it
    assert p.stopped and out.getvalue() == p.text == "bc" and p.ids == tokens("bca")


def test_printer_without_a_stop_prints_everything() -> None:
    out = io.StringIO()
    p = StopPrinter(ByteTokenizer().decode, out, ["END"])
    for chunk in ("ab", "c E", "N"):
        assert not p.push(tokens(chunk))
    assert out.getvalue() == "abc "
    p.push([], final=True)
    assert out.getvalue() == p.text == "abc EN" and p.ids == tokens("abc EN")
    quiet = StopPrinter(ByteTokenizer().decode, None)  # --json with no stop
    quiet.push(tokens("é!"))
    assert quiet.text == "é!" and quiet.ids == tokens("é!")


def _metaspace_tokenizer() -> object:
    """A sentencepiece-style BPE (Metaspace: a text's first token decodes without its leading space)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    corpus = ["In the beginning God created the heaven and the earth.", "And the earth was without form, é à"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"]))
    return tok


@pytest.mark.parametrize("which", ["shipped", "metaspace"])
def test_printed_text_is_the_whole_decode_however_it_is_pushed(which: str) -> None:
    """The printer decodes only the newest tokens (and a few before them): what it prints, pushed in chunks
    of any size, is the decode of all the tokens at once, split characters and leading spaces included."""
    tok = load_tokenizer(SHIPPED_TOKENIZER) if which == "shipped" else _metaspace_tokenizer()
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.get_vocab_size()) for _ in range(rng.randrange(1, 80))]  # type: ignore[attr-defined]
        out = io.StringIO()
        p = StopPrinter(tok.decode, out)  # type: ignore[attr-defined]
        i = 0
        while i < len(ids):
            n = rng.randrange(1, 6)
            p.push(ids[i : i + n])
            i += n
        p.push([], final=True)
        assert out.getvalue() == p.text == tok.decode(ids)  # type: ignore[attr-defined]


def test_printer_stop_across_a_split_character() -> None:
    """A two-byte character split across pushes: TextStream holds the half back, the stop is found whole."""
    out = io.StringIO()
    p = StopPrinter(ByteTokenizer().decode, out, ["né"])
    b = tokens("a né b")
    assert not p.push(b[:3]) and out.getvalue() == "a "  # "n" held back
    assert not p.push(b[3:4]) and out.getvalue() == "a "  # half of "é"
    assert p.push(b[4:]) and p.text == "a " and out.getvalue() == "a "
    assert p.ids == b[:5]
    out2 = io.StringIO()
    q = StopPrinter(ByteTokenizer().decode, out2, ["nè"])  # another second byte
    for i in range(len(b)):
        assert not q.push(b[i : i + 1])
    q.push([], final=True)
    assert out2.getvalue() == q.text == "a né b"


# ------------------------------------------------------------------------- the command line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--min-p", "1"], r"--min-p must be in \[0, 1\), got 1\.0"),
        (["--min-p", "-0.1"], r"--min-p must be in \[0, 1\), got -0\.1"),
        (["--min-p", "nan"], r"--min-p must be in \[0, 1\), got nan"),
        (["--repetition-penalty", "0"], r"--repetition-penalty must be between 0\.001 and 1000 \(1 = off\), got 0\.0"),
        (["--repetition-penalty", "-1.2"], r"--repetition-penalty must be between 0\.001 and 1000"),
        (["--repetition-penalty", "inf"], r"--repetition-penalty must be between 0\.001 and 1000"),
        (["--repetition-penalty", "nan"], r"--repetition-penalty must be between 0\.001 and 1000"),
        # below the range a logit divided by the penalty overflowed: every token the last id, exit 0
        (["--repetition-penalty", "1e-38"], r"--repetition-penalty must be between 0\.001 and 1000"),
        (["--repetition-penalty", "1e9"], r"--repetition-penalty must be between 0\.001 and 1000"),
        (["--stop", ""], r"--stop needs a string that is not empty"),
        (["--stop", "a", "--stop", ""], r"--stop needs a string that is not empty"),
    ],
)
def test_bad_options_are_refused(family: Family, args: list[str], message: str) -> None:
    refused(generate(family, *args, "-n", "5"), message)
    refused(generate(family, *args, "-n", "5", "--temperature", "0.8"), message)


def run_json(family: Family, *args: str) -> dict:
    return as_json(generate(family, "-n", "40", "--json", "-q", *args))


@pytest.mark.parametrize("proposer", ["mtp", "draft-2l"])
def test_repetition_penalty_greedy_is_the_target_alones(family: Family, proposer: str) -> None:
    plain = run_json(family, "--proposer", "none")
    ref = run_json(family, "--proposer", "none", "--repetition-penalty", "1.5")
    assert ref["tokens"] != plain["tokens"]
    for k in ("1", "4"):
        got = run_json(family, "--proposer", proposer, "-k", k, "--repetition-penalty", "1.5")
        assert got["tokens"] == ref["tokens"] and got["text"] == ref["text"]
        assert got["stats"]["proposer"] == proposer
    # min-p never drops the top token: greedy ignores it
    assert run_json(family, "--proposer", proposer, "--min-p", "0.5")["tokens"] == plain["tokens"]


def test_sampled_options_are_seeded(family: Family) -> None:
    opts = ("--temperature", "0.9", "--min-p", "0.05", "--repetition-penalty", "1.2", "--top-p", "0.95")
    a = run_json(family, *opts, "--seed", "3")
    assert a["tokens"] == run_json(family, *opts, "--seed", "3")["tokens"]
    assert a["tokens"] != run_json(family, *opts, "--seed", "4")["tokens"]


def a_stop_in(text: str) -> tuple[str, int]:
    """A short stop string from the middle of text, and where it first occurs."""
    for i in range(len(text) // 3, len(text) - 3):
        s = text[i : i + 3]
        if "\ufffd" not in s and text.index(s) == i:
            return s, i
    raise AssertionError(f"no stop string to pick in {text!r}")


@pytest.mark.parametrize("proposer", ["none", "mtp"])
def test_stop_string_ends_the_text(family: Family, proposer: str) -> None:
    full = run_json(family, "--proposer", "none")
    stop, at = a_stop_in(full["text"])
    cut = run_json(family, "--proposer", proposer, "--stop", stop)
    assert cut["text"] == full["text"][:at]
    n = len(cut["tokens"])
    assert cut["tokens"] == full["tokens"][:n]  # up to the token that completed the stop string
    assert stop not in decode(family, cut["tokens"][:-1]) and stop in decode(family, cut["tokens"])
    printed = ok(generate(family, "-n", "40", "-q", "--proposer", proposer, "--stop", "zzzq", "--stop", stop))
    assert printed.stdout == full["text"][:at] + "\n"
    never = run_json(family, "--proposer", proposer, "--stop", "\u2603\u2603")  # a stop never generated
    assert never["text"] == full["text"] and never["tokens"] == full["tokens"]


def decode(family: Family, ids: list[int]) -> str:
    return load_tokenizer(family.tokenizer).decode(ids)


def test_stop_string_with_stats_line(family: Family) -> None:
    """The statistics still come, one line on stderr, after a stop string ends the run."""
    full = run_json(family, "--proposer", "none")
    stop, at = a_stop_in(full["text"])
    res = ok(generate(family, "-n", "40", "--stop", stop))
    assert res.stdout == full["text"][:at] + "\n"
    assert res.stderr.count("\n") == 1 and " tokens in " in res.stderr
