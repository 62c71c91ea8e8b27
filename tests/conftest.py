"""Shared fixtures: tiny random models, a tiny trained target + MTP pair, a tiny on-disk family.

Every model here is small enough that a 100-token generation takes a few tens of
milliseconds on one thread. Torch runs on one thread: the tests are tiny, and a busy
machine (or CI) with many threads is far slower, not faster.
"""

from __future__ import annotations

import os

# The suite runs the eager engine (--engine auto reads SMALLEM_ENGINE) unless a test asks for the
# native one.
os.environ.setdefault("SMALLEM_ENGINE", "eager")

import copy
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from smallem_cli.config import PRESETS, ModelConfig
from smallem_cli.model import checkpoint
from smallem_cli.model.llama import MTPModule, Transformer
from smallem_cli.train.data import encode_file, train_tokenizer
from smallem_cli.train.loop import TrainSettings, train_model, vocab_rank

torch.set_num_threads(1)

TINY = PRESETS["tiny"]  # vocab 64, width 32, 2 layers, 4 heads / 2 kv heads, context 256
# A draft with the target's vocabulary but its own shape: narrower, one layer, multi-head.
DRAFT_CFG = ModelConfig(vocab_size=64, dim=24, n_layers=1, n_heads=2, n_kv_heads=2, hidden_dim=48, max_seq_len=256)
# Scale of the random 2-D weights. GPT-2 init (std 0.02) gives near-uniform logits and a
# greedy run that repeats one token; x12 gives varied output (20+ distinct tokens in 150)
# whose top-2 logit gaps still stay far above float32 rounding (checked in test_generate).
SCALE = 12.0
PROMPT = [3, 17, 42, 5, 9, 1, 33, 60]
MAX_LEN = 256  # max tokens per sequence given to proposers' caches


# The K/V cache holds float16 (`native.KV_DTYPE`, as llama.cpp's by default): a pass that reads a cached
# past differs from the training path's float32 by that rounding, here up to about 0.3% of the largest
# logit. A wrong key, position or rollback is off by the logits' own scale.
KV_TOL = 5e-3


def kv_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a (read through the cache) equal to b to the cache's float16 rounding, on b's scale."""
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=0, atol=KV_TOL * float(b.abs().max())))


def random_model(cfg: ModelConfig, seed: int, scale: float = SCALE) -> Transformer:
    """A Transformer with GPT-2 init scaled up, packed for inference."""
    m = Transformer(cfg)
    m.init_weights(seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    return m.eval().pack()


def random_mtp(cfg: ModelConfig, seed: int, scale: float = SCALE) -> MTPModule:
    """An MTP module with seeded random weights (norm weights stay 1), packed."""
    mtp = MTPModule(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mtp.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02 * scale)
    return mtp.eval().pack()


def noisy_copy(model: Transformer, noise: float, seed: int) -> Transformer:
    """The model with relative Gaussian noise on its 2-D weights: a draft that agrees often, not always."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.add_(noise * p.std() * torch.randn(p.shape, generator=g))
    return m.eval().pack()


@pytest.fixture(scope="session", autouse=True)
def native_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The native kernels are built once per run, in the run's own folder, never the home folder
    (a test of the cache itself points SMALLEM_CACHE elsewhere)."""
    root = tmp_path_factory.mktemp("native-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SMALLEM_CACHE", str(root))
        yield root


@pytest.fixture(scope="session")
def target() -> Transformer:
    return random_model(TINY, seed=0)


@pytest.fixture(scope="session")
def draft() -> Transformer:
    return random_model(DRAFT_CFG, seed=1)


@pytest.fixture(scope="session")
def near_draft(target: Transformer) -> Transformer:
    """The target with 5% weight noise: accepts roughly half of its guesses, in varied runs."""
    return noisy_copy(target, 0.05, seed=5)


@pytest.fixture(scope="session")
def mtp() -> MTPModule:
    return random_mtp(TINY, seed=2)


# --- a tiny target + MTP module trained on a periodic stream ------------------------------
PERIOD = 40


@dataclass
class Trained:
    model: Transformer
    mtp: MTPModule
    period: list[int]  # the repeated sequence the stream is made of
    facts: dict


class _FakeClock:
    """perf_counter for the training loop: each call is 10 ms later, so a budget of
    B seconds is exactly 100*B optimizer steps whatever the machine's speed."""

    def __init__(self) -> None:
        self._ticks = itertools.count()

    def perf_counter(self) -> float:
        return next(self._ticks) * 0.01


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """Target and MTP module trained jointly (about 200 steps, ~3 s) on a period-40 random token stream.

    The MTP module then predicts token i+2 well, so MTP proposals are mostly accepted.
    """
    rng = np.random.default_rng(0)
    period = rng.integers(1, TINY.vocab_size, size=PERIOD)
    stream = np.tile(period, 100).astype(np.uint16)
    settings = TrainSettings(
        budget_s=2.0,  # 200 fake-clock steps
        batch_size=8,
        seq_len=32,
        lr=1e-2,
        warmup_steps=10,
        save_every_s=1e9,
        eval_every_s=1e9,
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("smallem_cli.train.loop.time", SimpleNamespace(perf_counter=_FakeClock().perf_counter))
        model, mtp, facts = train_model(
            TINY, stream, stream[: 4 * PERIOD + 34], settings, tmp_path_factory.mktemp("run")
        )
    assert mtp is not None and facts["steps"] == 200
    return Trained(model.eval().pack(), mtp.eval().pack(), [int(t) for t in period], facts)


# --- a tiny on-disk family for the CLI -------------------------------------------------------
# Byte-level BPE has 256 single-byte tokens plus <|endoftext|>, so the vocabulary must exceed 257.
FAMILY_CFG = ModelConfig(
    vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=256, mtp=True
)
CORPUS = (
    "In the beginning was the word, and the word was with the model.\n"
    "The quick brown fox jumps over the lazy dog; the dog sleeps on.\n"
    "Speculative decoding guesses tokens and the target checks them.\n"
    "Caf\u00e9 cr\u00e8me, na\u00efve r\u00e9sum\u00e9: bytes beyond ASCII too.\n"
)


@dataclass
class Family:
    dir: Path
    tokenizer: Path
    target: Path
    mtp: Path
    draft: Path  # draft-2l.safetensors, found beside the target by name
    fingerprint: str


@pytest.fixture(scope="session")
def family(tmp_path_factory: pytest.TempPathFactory) -> Family:
    d = tmp_path_factory.mktemp("family")
    text = d / "corpus.txt"
    text.write_text("<|endoftext|>".join([CORPUS] * 20), encoding="utf-8")
    tok = d / "tokenizer.json"
    trained_tok = train_tokenizer(text, tok, vocab_size=300)
    assert trained_tok.get_vocab_size() == 300 and trained_tok.token_to_id("<|endoftext|>") == 0
    fp = checkpoint.tokenizer_fingerprint(tok)
    # proposers list the tokens by frequency in the corpus, so --proposer-vocab can cut their heads
    rank = vocab_rank(encode_file(tok, text), FAMILY_CFG.vocab_size)
    tgt = random_model(FAMILY_CFG, seed=0)
    checkpoint.save(d / "target.safetensors", tgt, tokenizer=fp)
    checkpoint.save(d / "mtp.safetensors", random_mtp(FAMILY_CFG, seed=2), tokenizer=fp, vocab_rank=rank)
    # draft-2l: the target with weight noise, so that its guesses are kept often but not always
    checkpoint.save(d / "draft-2l.safetensors", noisy_copy(tgt, 0.05, seed=5), tokenizer=fp, vocab_rank=rank)
    return Family(d, tok, d / "target.safetensors", d / "mtp.safetensors", d / "draft-2l.safetensors", fp)
