"""Checks on the shipped family in checkpoints/ (skipped only where a file is absent)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from smallem_cli import defaults
from smallem_cli.bench import run as bench
from smallem_cli.engine import family
from smallem_cli.engine.generate import generate
from smallem_cli.model import checkpoint
from smallem_cli.spec.proposers import NoProposer
from smallem_cli.spec.sampling import Sampling

FILES = ["target", "mtp", "draft-2l", "draft-4l"]
missing = [f for f in FILES if not (defaults.CHECKPOINTS / f"{f}.safetensors").exists()]
pytestmark = pytest.mark.skipif(bool(missing), reason=f"shipped checkpoints missing: {missing}")


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a smallem file, checked as `checkpoint` checks them."""
    meta = checkpoint.read_meta(path)
    return checkpoint._tensors(path, checkpoint.config_of(meta, path), meta.get("kind") == "mtp"), meta


@pytest.fixture(scope="module")
def target() -> family.Target:
    return family.load_target(defaults.TARGET, torch.device("cpu"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return bench.read_prompts(defaults.PROMPTS)


def test_files_are_16_bit_and_share_the_tokenizer(target: family.Target) -> None:
    for name in FILES:
        tensors, meta = read(defaults.CHECKPOINTS / f"{name}.safetensors")
        assert {t.dtype for t in tensors.values()} == {torch.float16}, name
        assert meta["tokenizer"] == target.fingerprint, name
    total = sum(p.stat().st_size for p in defaults.CHECKPOINTS.iterdir())
    assert total < 60e6


def test_prompts_follow_the_protocol(prompts: list[list[int]]) -> None:
    assert len(prompts) == 8 and all(len(p) == 32 for p in prompts)


@pytest.mark.parametrize("proposer", ["draft-2l", "mtp"])
def test_greedy_identity_on_the_shipped_family(target: family.Target, prompts: list[list[int]], proposer: str) -> None:
    make = family.load_proposer(proposer, target, torch.device("cpu"), defaults.proposer_vocab(greedy=True))
    prompt = prompts[0]
    ref, _ = generate(target.model, NoProposer(), prompt, 100, 0)
    accepted = []
    for k in range(1, 6):
        out, stats = generate(target.model, make(len(prompt) + 110), prompt, 100, k)
        assert out == ref, f"{proposer} k={k}"
        accepted.append(stats.acceptance_rate)
    assert max(accepted) > 0.3, accepted  # a trained proposer guesses right often


def test_mtp_acceptance_on_the_benchmark_prompts(target: family.Target, prompts: list[list[int]]) -> None:
    make = family.load_proposer("mtp", target, torch.device("cpu"), defaults.proposer_vocab(greedy=True))
    acc = [generate(target.model, make(200), p, 60, 1)[1].acceptance_rate for p in prompts[:4]]
    assert sum(acc) / len(acc) >= 0.6, acc


def test_sampling_is_seeded_and_reads_as_text(target: family.Target, prompts: list[list[int]]) -> None:
    make = family.load_proposer("mtp", target, torch.device("cpu"), defaults.proposer_vocab(greedy=False))
    s = Sampling(temperature=1.0, seed=5)
    a, _ = generate(target.model, make(200), prompts[1], 60, 2, s)
    b, _ = generate(target.model, make(200), prompts[1], 60, 2, s)
    assert a == b
    assert len(set(a)) > 20  # not a degenerate loop


def test_batch_engine_on_the_shipped_family(target: family.Target) -> None:
    """The batch prompts file holds 64 prompts of 32 tokens; 8 of them decoded together by the
    batch engine (ngram+mtp, the greedy default) equal the target alone, and the MTP module's
    guesses are kept there as in the loop."""
    from smallem_cli.engine.build import build_engine
    from smallem_cli.engine.request import Request

    batch = bench.read_prompts(defaults.BATCH_PROMPTS)
    assert len(batch) == 64 and all(len(p) == 32 for p in batch)
    eng = build_engine(
        target, "ngram+mtp", torch.device("cpu"), k=None, max_batch=8, proposer_vocab=None, eot=None, decode=str
    )
    reqs = [Request(i, i, tuple(p), 40) for i, p in enumerate(batch[::8])]
    got = {f.request.index: f for f in eng.run(reqs)}
    for r in reqs:
        ref, _ = generate(target.model, NoProposer(), list(r.prompt), 40, 0)
        assert got[r.index].tokens == ref
    assert sum(f.stats["acceptance_rate"] for f in got.values()) / len(got) > 0.5  # type: ignore[misc]
