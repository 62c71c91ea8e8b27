"""A GGUF file's tokenizer as a `tokenizers.Tokenizer`, from its metadata alone, encoding as llama.cpp does. Two kinds:
`gpt2`, byte-level BPE with its merges listed; and `llama`, SentencePiece (tokens with scores, `▁` for a space, byte
tokens `<0x41>`), whose merges are not listed: llama.cpp merges the adjacent pair whose joined text is the token of
the highest score, leftmost first, and spells whatever stays outside the vocabulary as byte tokens. Ordering every
split of every token by that token's score gives `tokenizers`' BPE the same choices, but for one: where two splits
of one token overlap in the text, llama.cpp takes the leftmost, BPE the lower rank. In both kinds control and
user-defined tokens are matched in the raw text before anything else, leftmost-longest (llama.cpp: the longest first,
anywhere; the same wherever no two of them overlap in the text)."""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from .gguf_file import GGUFReadError, Meta

CONTROL, USER, UNUSED = 3, 4, 5  # llama.cpp's token types (1 normal, 2 unknown, 6 byte)
UNKNOWN = 2
PRE = {"gpt2": "gpt2", "gpt-2": "gpt2", "smollm": "smollm", "qwen2": "qwen2"}  # tokenizer.ggml.pre -> how text is split
# llama.cpp's (and Qwen's tokenizer.json's) split for `qwen2`: digits one by one, letters with one sign before them
QWEN2_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
SPACE = "\u2581"  # SentencePiece's visible space
KINDS = ("gpt2", "llama")
# llama.cpp's defaults for a SentencePiece file whose metadata leaves them out
_SPM_IDS = {"bos": 1, "eos": 2}
_SPM_ADD = {"bos": True, "eos": False}


def tokenizer(meta: Meta, tokens: list[str], ids: dict[str, int]) -> Tokenizer:
    """tokenizer.ggml.* -> a `tokenizers` object that encodes as llama.cpp does with special tokens parsed: control
    tokens special (decoded as nothing), user-defined ones plain, BOS / EOS added where the file says llama.cpp adds
    them. `ids`: the file's bos/eos token ids, checked by the caller. GGUFReadError where it cannot be built."""
    path = meta.path
    kind = meta.text("tokenizer.ggml.model")
    if kind not in KINDS:
        raise GGUFReadError(
            f"{path}: tokenizer.ggml.model {kind!r}: only gpt2 (byte-level BPE) and llama (SentencePiece) are read"
        )
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    if not isinstance(types, list) or len(types) != len(tokens) or not all(isinstance(t, int) for t in types):
        raise GGUFReadError(f"{path}: tokenizer.ggml.token_type does not list one type per token")
    try:
        if kind == "gpt2":
            tok = _byte_level(meta, tokens, types)
            _add_tokens(tok, meta, tokens, types, (CONTROL,))
            _ends(tok, meta, ids, {})
        else:
            tokens = [text or f"[EMPTY_{i}]" for i, text in enumerate(tokens)]  # llama.cpp's name for an empty one
            tok = _sentencepiece(meta, tokens, types)
            _add_tokens(tok, meta, tokens, types, (CONTROL, UNKNOWN))  # llama.cpp parses <unk> as it does control
            _ends(tok, meta, _SPM_IDS | ids, _SPM_ADD)
    except GGUFReadError:
        raise
    except Exception as e:  # tokenizers raises bare Exceptions on a bad vocabulary or merge
        raise GGUFReadError(f"{path}: its tokenizer cannot be built: {str(e).splitlines()[0][:200]}") from None
    return tok


def _byte_level(meta: Meta, tokens: list[str], types: list[int]) -> Tokenizer:
    """llama.cpp's `gpt2`: GPT-2's byte-level BPE, its text split as tokenizer.ggml.pre names; unused tokens left
    out."""
    path = meta.path
    pre = meta.text("tokenizer.ggml.pre") or "default"
    if pre not in PRE:
        raise GGUFReadError(f"{path}: tokenizer.ggml.pre {pre!r}: only {', '.join(PRE)} are read")
    merges = meta.strings("tokenizer.ggml.merges")
    vocab: dict[str, int] = {}
    for i, (text, t) in enumerate(zip(tokens, types, strict=True)):
        if t != UNUSED:
            vocab.setdefault(text, i)  # added tokens too: `add_tokens` then keeps their ids
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges]))  # type: ignore[arg-type]
    split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=PRE[pre] != "qwen2")
    if PRE[pre] == "smollm":  # digits one by one, then the byte-level split
        split = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), split])
    elif PRE[pre] == "qwen2":  # its own split, then bytes as they are
        split = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), "isolated"), split])
    tok.pre_tokenizer = split
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(meta: Meta, tokens: list[str], types: list[int]) -> Tokenizer:
    """llama.cpp's `llama`: SentencePiece BPE with byte fallback, a space written `▁` (and one put before the text
    where tokenizer.ggml.add_space_prefix says so, llama.cpp's default), the text never split before merging."""
    path = meta.path
    scores = meta.get("tokenizer.ggml.scores", [0.0] * len(tokens))
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise GGUFReadError(f"{path}: tokenizer.ggml.scores does not list one score per token")
    if not all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in scores):
        raise GGUFReadError(f"{path}: tokenizer.ggml.scores holds a value that is not a number")
    vocab = {text: i for i, text in enumerate(tokens)}  # as llama.cpp's: a text listed twice means its last id
    absent = [b for b in range(256) if f"<0x{b:02X}>" not in vocab]
    if absent:
        raise GGUFReadError(f"{path}: no byte token <0x{absent[0]:02X}>: SentencePiece files need all 256 of them")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=spm_merges(vocab, scores), byte_fallback=True))
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True) is True
    # llama.cpp puts the space before each stretch of text between special tokens, as Prepend does here
    steps = [normalizers.Prepend(SPACE)] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if prefix else []  # after Fuse: the text's first space only
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok


def spm_merges(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of every token into two tokens, the splits of higher-scored tokens first (llama.cpp merges by
    the score of the token made), ties by id, then by where the split falls."""
    ranked = []
    for text, i in vocab.items():
        for k in range(1, len(text)):
            left, right = text[:k], text[k:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, k, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_tokens(tok: Tokenizer, meta: Meta, tokens: list[str], types: list[int], specials: tuple[int, ...]) -> None:
    """Control (and `specials`) and user-defined tokens as added tokens, matched in the raw text, each with its id."""
    pairs = enumerate(zip(tokens, types, strict=True))
    added = [(i, text, t in specials) for i, (text, t) in pairs if t in specials or t == USER]
    tok.add_tokens([AddedToken(text, special=special, normalized=False) for _, text, special in added])
    for i, text, _ in added:  # every one is in the model's vocabulary, so it keeps its id unless listed twice
        if (j := tok.token_to_id(text)) != i:
            raise GGUFReadError(f"{meta.path}: token {text!r} is listed twice (ids {j} and {i})")


def _ends(tok: Tokenizer, meta: Meta, ids: dict[str, int], defaults: dict[str, bool]) -> None:
    """BOS before and EOS after the text where tokenizer.ggml.add_bos_token / add_eos_token (or `defaults`) say so."""
    ends = {}
    for w in ("bos", "eos"):
        add: Any = meta.get(f"tokenizer.ggml.add_{w}_token", defaults.get(w, False))
        if add is True and w in ids:
            ends[w] = ids[w]
    texts = {w: tok.id_to_token(i) for w, i in ends.items()}
    if None in texts.values():
        raise GGUFReadError(f"{meta.path}: tokenizer.ggml.add_*_token names a token that is not in its list")
    if ends:
        single = [texts[w] for w in ("bos",) if w in ends] + ["$A"] + [texts[w] for w in ("eos",) if w in ends]
        specials = [(texts[w], i) for w, i in ends.items()]
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
