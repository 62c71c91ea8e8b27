"""Checks on the shipped family in checkpoints/ (skipped only where a file is absent)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from smallem_cli import defaults
from smallem_cli.backends.engines import Backend
from smallem_cli.engine import family
from smallem_cli.engine.generate import generate
from smallem_cli.model import checkpoint
from smallem_cli.spec.sampling import Sampling

FILES = ["target", "mtp", "draft-2l", "draft-4l"]
missing = [f for f in FILES if not (defaults.CHECKPOINTS / f"{f}.safetensors").exists()]
pytestmark = pytest.mark.skipif(bool(missing), reason=f"shipped checkpoints missing: {missing}")
no_native = shutil.which("g++") is None or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512")
BACKENDS = [
    "eager",
    pytest.param("native", marks=pytest.mark.skipif(no_native, reason="the native engine needs g++ and AVX2")),
]


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a smallem file, checked as `checkpoint` checks them."""
    meta = checkpoint.read_meta(path)
    return checkpoint._tensors(path, checkpoint.config_of(meta, path), meta.get("kind") == "mtp"), meta


def read_tokens(path: Path) -> list[list[int]]:
    """The token ids of a prompts file (one JSON object a line, as `bench.write_prompts` writes it)."""
    return [json.loads(line)["tokens"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def target() -> family.Target:
    return family.load_target(defaults.TARGET, torch.device("cpu"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return read_tokens(defaults.PROMPTS)


def test_files_are_16_bit_and_share_the_tokenizer(target: family.Target) -> None:
    for name in FILES:
        tensors, meta = read(defaults.CHECKPOINTS / f"{name}.safetensors")
        assert {t.dtype for t in tensors.values()} == {torch.float16}, name
        assert meta["tokenizer"] == target.fingerprint, name
    total = sum(p.stat().st_size for p in defaults.CHECKPOINTS.iterdir())
    assert total < 60e6


def test_prompts_follow_the_protocol(prompts: list[list[int]]) -> None:
    assert len(prompts) == 8 and all(len(p) == 32 for p in prompts)


def prepared(name: str, target: family.Target, p: family.LoadedProposer) -> Backend | None:
    """The backend `smallem generate` runs with (None: eager), prepared for the target and the
    proposer, its matrices int8 where it was loaded so (the default): every model native."""
    if name == "eager":
        return None
    b = Backend(name)
    assert b.prepare(target.model, p.models, None, p.models if p.int8 else ()) == name
    return b


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("proposer", ["draft-2l", "mtp", "ngram+mtp"])
def test_greedy_identity_on_the_shipped_family(
    target: family.Target, prompts: list[list[int]], proposer: str, backend_name: str
) -> None:
    p = family.load_proposer(proposer, target, torch.device("cpu"), defaults.proposer_vocab(greedy=True))
    assert p.int8 == (defaults.PROPOSER_WEIGHTS == "int8")
    b = prepared(backend_name, target, p)
    prompt = prompts[0]
    ref, _ = generate(target.model, family.NONE, prompt, 100, 0, backend=b)
    accepted = []
    for k in range(1, 6):
        out, stats = generate(target.model, p, prompt, 100, k, backend=b)
        assert out == ref, f"{proposer} k={k}"
        assert stats.backend == backend_name
        accepted.append(stats.acceptance_rate)
    assert max(accepted) > 0.3, accepted  # a trained proposer guesses right often


@pytest.mark.skipif(no_native, reason="the native engine needs g++ and AVX2")
def test_native_target_alone_is_the_eager_one(target: family.Target, prompts: list[list[int]]) -> None:
    """The shipped target's float16 weights, read as they are: the native text is the eager text."""
    b = prepared("native", target, family.NONE)
    for prompt in prompts[:2]:
        eager, _ = generate(target.model, family.NONE, prompt, 100, 0)
        native, _ = generate(target.model, family.NONE, prompt, 100, 0, backend=b)
        assert native == eager


def test_mtp_acceptance_on_the_benchmark_prompts(target: family.Target, prompts: list[list[int]]) -> None:
    p = family.load_proposer("mtp", target, torch.device("cpu"), defaults.proposer_vocab(greedy=True))
    acc = [generate(target.model, p, q, 60, 1)[1].acceptance_rate for q in prompts[:4]]
    assert sum(acc) / len(acc) >= 0.6, acc


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_sampling_is_seeded_and_reads_as_text(
    target: family.Target, prompts: list[list[int]], backend_name: str
) -> None:
    p = family.load_proposer("mtp", target, torch.device("cpu"), defaults.proposer_vocab(greedy=False))
    b = prepared(backend_name, target, p)
    s = Sampling(temperature=1.0, seed=5)
    a, _ = generate(target.model, p, prompts[1], 60, 2, s, backend=b)
    c, _ = generate(target.model, p, prompts[1], 60, 2, s, backend=b)
    d, _ = generate(target.model, p, prompts[1], 60, 2, Sampling(temperature=1.0, seed=6), backend=b)
    assert a == c and a != d
    assert len(set(a)) > 20  # not a degenerate loop


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_batch_engine_on_the_shipped_family(target: family.Target, backend_name: str) -> None:
    """The batch prompts file holds 64 prompts of 32 tokens; 8 of them decoded two at a time by the
    batch engine (ngram+mtp, the greedy default; the load policy guesses up to 2 sequences) equal the
    target alone, and the MTP module's guesses are kept there as in the loop; on either backend."""
    from smallem_cli.engine.build import build
    from smallem_cli.engine.config import EngineConfig
    from smallem_cli.engine.request import Request

    batch = read_tokens(defaults.BATCH_PROMPTS)
    assert len(batch) == 64 and all(len(p) == 32 for p in batch)
    b = Backend(backend_name)
    loaded = family.load_proposer("ngram+mtp", target, torch.device("cpu"), defaults.proposer_vocab(True))
    eng = build(EngineConfig(target.model, loaded, b, max_batch=defaults.SPECULATE_UP_TO, decode=str))
    assert b.label == backend_name
    reqs = [Request(i, i, tuple(p), 40) for i, p in enumerate(batch[::8])]
    got = {f.request.index: f for f in eng.run(reqs)}
    for r in reqs:
        ref, _ = generate(target.model, family.NONE, list(r.prompt), 40, 0)
        assert got[r.index].tokens == ref
    assert sum(f.stats["acceptance_rate"] for f in got.values()) / len(got) > 0.5  # type: ignore[misc]
