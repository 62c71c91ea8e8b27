"""A SentencePiece (llama.cpp `llama`) tokenizer built from a GGUF file's metadata alone.

A tiny vocabulary written by the `gguf` package's writer, checked by hand: merges in the order of the merged
token's score (not of the position), leftmost first between equals, byte fallback for a character outside the
vocabulary, control and user-defined tokens matched whole, BOS and the space prefix as the metadata says; and the
same file tokenized by llama.cpp where llama-cpp-python is installed. Where `make gemma3` has fetched Gemma 3 270M,
its tokenizer against llama.cpp's on varied strings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from smallem_cli.interop.gguf_file import GGUFReadError, Meta, open_gguf
from smallem_cli.interop.gguf_vocab import tokenizer

GEMMA3 = Path(__file__).resolve().parent.parent / "models" / "gemma-3-270m-q4_k_m.gguf"
SPECIAL = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2), ("<start_of_turn>", 3), ("\n", 4), ("  ", 4)]
BYTES = [(f"<0x{b:02X}>", 6) for b in range(256)]
# normal tokens and their scores: a higher score merges first
NORMAL = {
    "▁": -1, "a": -2, "b": -3, "c": -4, "x": -5, "y": -6, "z": -7, "h": -8, "e": -9, "l": -10, "o": -11,
    "ab": -20, "bc": -30, "xy": -40, "yz": -15, "aa": -16, "he": -17, "ll": -18, "hell": -19, "hello": -21,
    "▁hello": -22, "▁a": -23, "▁x": -24,
}  # fmt: skip
TOKENS = [t for t, _ in SPECIAL] + [t for t, _ in BYTES] + list(NORMAL)
ID = {t: i for i, t in enumerate(TOKENS)}
STRINGS = ["", "abc", "xyz", "aaa", "hello", " hello", "hello hello", "é", "aé😀b", "<start_of_turn>ab<eos>",
           "a\nb", "a  b", "   ", "cab xyz\n\n", "<bos>", "<unk>x", "\t", "<0x41>", "▁a"]  # fmt: skip


def need() -> Any:
    return pytest.importorskip("gguf", reason="gguf is not installed (the gguf extra)")


def write(path: Path, *, model: str = "llama", bos: bool = True, prefix: bool = False, drop_byte: bool = False) -> Path:
    gguf = need()
    tokens = [t for t in TOKENS if not (drop_byte and t == "<0x41>")]
    types = dict(SPECIAL + BYTES)
    w = gguf.GGUFWriter(str(path), "llama")
    try:  # llama.cpp's hyperparameters for a vocabulary-only load, and the vocabulary
        w.add_context_length(64)
        w.add_embedding_length(8)
        w.add_block_count(1)
        w.add_feed_forward_length(16)
        w.add_head_count(2)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_tokenizer_model(model)
        w.add_token_list(tokens)
        w.add_token_scores([float(NORMAL.get(t, -1000 if t in dict(SPECIAL) else 0)) for t in tokens])
        w.add_token_types([types.get(t, 1) for t in tokens])
        w.add_bos_token_id(ID["<bos>"])
        w.add_eos_token_id(ID["<eos>"])
        w.add_unk_token_id(ID["<unk>"])
        w.add_add_bos_token(bos)
        w.add_add_eos_token(False)
        w.add_add_space_prefix(prefix)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    return path


def load(path: Path) -> Any:
    meta = Meta(open_gguf(path))
    tokens = meta.strings("tokenizer.ggml.tokens")
    ids = {n: v for n in ("bos", "eos") if (v := meta.get(f"tokenizer.ggml.{n}_token_id")) is not None}
    return tokenizer(meta, tokens, ids)


def ids(*tokens: str) -> list[int]:
    return [ID[t] for t in tokens]


def test_merges_by_score_bytes_and_special_tokens(tmp_path: Path) -> None:
    tok = load(write(tmp_path / "spm.gguf"))
    enc = lambda s: tok.encode(s).ids[1:]  # noqa: E731  after the BOS
    assert tok.encode("abc").ids[0] == ID["<bos>"]
    assert enc("abc") == ids("ab", "c")  # ab outscores bc
    assert enc("xyz") == ids("x", "yz")  # yz outscores xy, though xy comes first
    assert enc("aaa") == ids("aa", "a")  # equal scores: the leftmost pair
    assert enc("hello") == ids("hello")  # he, ll, hell, hello
    assert enc(" hello") == ids("▁hello")
    assert enc("hello hello") == ids("hello", "▁hello")
    assert enc("é") == ids("<0xC3>", "<0xA9>")  # not in the vocabulary: its UTF-8 bytes
    assert enc("aé") == ids("a", "<0xC3>", "<0xA9>")
    assert enc("<start_of_turn>ab<eos>") == ids("<start_of_turn>", "ab", "<eos>")  # not spelled out in bytes
    assert enc("a\nb") == ids("a", "\n", "b")  # user-defined: matched before the spaces become ▁
    assert enc("a  b") == ids("a", "  ", "b")
    assert enc("a b") == ids("a", "▁", "b")
    for s in ("abc", "hello hello", "aé😀b", "cab xyz\n\n", "a  b", "\t"):
        assert tok.decode(tok.encode(s).ids) == s
    assert tok.decode(tok.encode("<start_of_turn>ab").ids) == "ab"  # control tokens decode as nothing


def test_bos_and_space_prefix_as_the_file_says(tmp_path: Path) -> None:
    tok = load(write(tmp_path / "plain.gguf", bos=False))
    assert tok.encode("abc").ids == ids("ab", "c")
    tok = load(write(tmp_path / "prefix.gguf", bos=False, prefix=True))
    assert tok.encode("abc").ids == ids("▁", "ab", "c")  # ab outscores ▁a
    assert tok.encode("xyz").ids == ids("▁x", "yz")
    assert tok.encode("<eos>hello").ids == ids("<eos>", "▁hello")  # again after a special token, as llama.cpp
    assert tok.decode(tok.encode("abc hello").ids) == "abc hello"


@pytest.mark.parametrize(
    ("edit", "message"),
    [({"model": "bert"}, "tokenizer.ggml.model 'bert'"), ({"drop_byte": True}, "no byte token <0x41>")],
)
def test_refusals_are_one_line(tmp_path: Path, edit: dict[str, Any], message: str) -> None:
    with pytest.raises(GGUFReadError, match=message) as e:
        load(write(tmp_path / "bad.gguf", **edit))
    assert "\n" not in str(e.value)


def llama_vocab(path: Path) -> Any:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the llamacpp extra)")
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


@pytest.mark.parametrize("prefix", [False, True])
def test_tiny_vocabulary_as_llama_cpp(tmp_path: Path, prefix: bool) -> None:
    path = write(tmp_path / "spm.gguf", prefix=prefix)
    tok, ref = load(path), llama_vocab(path)
    for s in STRINGS:
        assert tok.encode(s).ids == ref.tokenize(s.encode(), add_bos=True, special=True), s


GEMMA_STRINGS = [
    "", " ", "  ", "\n", "\n\n\n", "\t\t", "Hello world", " Hello", "Hello ", "hello   world  ",
    "The quick brown fox jumps over the lazy dog.", "And God said, Let there be light: and there was light.",
    "café naïve résumé façade", "Ångström Øresund straße", "日本語のテキストです。", "中文文本，包括标点符号！",
    "한국어 텍스트입니다", "Привет, мир!", "Γειά σου Κόσμε", "مرحبا بالعالم", "नमस्ते दुनिया", "สวัสดีชาวโลก",
    "😀😃 emoji 🎉", "👨‍👩‍👧‍👦 family", "𠜎𠜱𠝹 rare CJK", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "e\u0301 combining", "\u00a0nbsp\u200bzw",
    "def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    "SELECT * FROM users WHERE id = 42;", "<div class=\"x\"><b>bold</b></div>", "<table><tr><td>1</td></tr></table>",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "a<mask>b", "1234567890", "3.14159265358979",
    "1,000,000 and 2024-12-06", "∀x∈ℝ, ∃y: x<y ≤ ∞", "line1\r\nline2\r\n", "~!@#$%^&*()_+`-=[]{}|;':\",./<>?",
    "▁ a literal metaspace ▁▁", "http://example.com/path?q=1&r=2#frag", "aaaaaaaaaaaaaaaaaaaaaaaa", " " * 40,
    "\n" * 40, "end.\n\n\nNew paragraph.", "\x00\x01 control", "ﬁ ligature", "混合 mixed 言語 text 123",
]  # fmt: skip


@pytest.mark.skipif(not GEMMA3.exists(), reason="models/gemma-3-270m-q4_k_m.gguf is absent: `make gemma3` fetches it")
def test_gemma3_as_llama_cpp() -> None:
    need()
    tok, ref = load(GEMMA3), llama_vocab(GEMMA3)
    for s in GEMMA_STRINGS:
        got = tok.encode(s).ids
        assert got == ref.tokenize(s.encode(), add_bos=True, special=True), s
        if not any(t in s for t in ("▁", "<start_of_turn>", "<mask>")):  # ▁ reads back as a space; control: nothing
            assert tok.decode(got) == s
