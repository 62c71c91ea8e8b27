"""The EAGLE head (`model.eagle`, `train.eagle`, `train.eagle_data`): the target's tapped states, eager and native
alike; greedy identity and the target's law through the real loop; its file, found by the target's weights; its data,
the engine's own states, appended and resumed; its training-time-test loss, which trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import PROMPT, TINY, random_model
from engine_help import backend
from safetensors.torch import load_file
from test_engine import chi2, pair_law

from smallem_cli.backends.engines import Backend
from smallem_cli.config import ModelConfig
from smallem_cli.engine.build import build
from smallem_cli.engine.config import EngineConfig
from smallem_cli.engine.family import NONE, LoadedProposer, Target, find_eagle
from smallem_cli.engine.forward import slab_for, transformer_pass
from smallem_cli.engine.request import Request
from smallem_cli.kv.step import build as build_step
from smallem_cli.model import eagle
from smallem_cli.model.checkpoint import CheckpointError, read_meta, write_safetensors
from smallem_cli.model.eagle import EagleHead
from smallem_cli.spec.head import Head
from smallem_cli.spec.sampling import Sampling
from smallem_cli.train import eagle as tr
from smallem_cli.train import eagle_data as data
from smallem_cli.train.loop import TrainSettings


def random_head(target, seed: int, cut: int = 0, scale: float = 12.0) -> EagleHead:
    """A head over `target` with seeded random weights; `cut` > 0: its vocabulary that many of the target's tokens."""
    g = torch.Generator().manual_seed(seed)
    V = target.cfg.vocab_size
    ids = torch.randperm(V, generator=g)[:cut] if cut else torch.arange(V)
    head = EagleHead(target.cfg, eagle.default_taps(target.cfg.n_layers), ids)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02 * scale)
    return head.eval().pack()


def loaded(head: EagleHead) -> LoadedProposer:
    return LoadedProposer("eagle", head, Head(head, head.ids))


def run(target, p: LoadedProposer, b: Backend, prompts: list[list[int]], n: int, k: int = 4, batch: int = 1,
        sampling: Sampling | None = None) -> list[list[int]]:  # fmt: skip
    eng = build(EngineConfig(target, p, b, k, batch))
    reqs = [Request(i, i, tuple(q), n, sampling or Sampling()) for i, q in enumerate(prompts)]
    got = {f.request.index: f.tokens for f in eng.run(reqs)}
    return [got[i] for i in range(len(prompts))]


def test_taps_are_the_layers_outputs_on_both_engines(target) -> None:
    """A pass with taps hands on the tapped layers' outputs (the last tap: the states it hands on without), the
    native engine's as the eager one's."""
    ids = torch.tensor(PROMPT)
    b = build_step([[0]], [0], [len(PROMPT)], 16, "cpu")
    taps = (1, 0, 1)
    got = {}
    for name in ("eager", "native"):
        steps = backend(name, target).steps(target)
        _, plain = transformer_pass(target, slab_for(target, 64, torch.device("cpu")), ids, b, "none", steps)
        _, tapped = transformer_pass(target, slab_for(target, 64, torch.device("cpu")), ids, b, "none", steps, taps)
        d = target.cfg.dim
        assert tapped.shape == (len(PROMPT), 3 * d)
        assert torch.equal(tapped[:, 2 * d :], plain) and torch.equal(tapped[:, :d], plain)
        got[name] = tapped
    eager = got["eager"].detach()
    assert torch.allclose(eager, got["native"], rtol=0, atol=1e-3 * float(eager.abs().max()))


@pytest.mark.parametrize("engine", ["eager", "native"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_with_the_head_is_the_target_alone(target, engine: str, batch: int) -> None:
    head = random_head(target, seed=3, cut=40)
    b = backend(engine, target, head)
    prompts = [PROMPT, PROMPT[:3], [5, 6, 7, 5, 6, 7], [1]]
    alone = run(target, NONE, b, prompts, 40)
    for k in (1, 4, 8):
        assert run(target, loaded(head), b, prompts, 40, k, batch) == alone


def test_a_confident_head_drafts_and_a_doubtful_one_stops(target) -> None:
    """The chain stops at a draft token the head gives under EAGLE_MIN_TOP: a head of near-uniform logits (its
    weights scaled to nothing) drafts no token; the same head made sure of itself drafts its k."""
    b = backend("native", target)
    flat = random_head(target, seed=4)
    with torch.no_grad():
        flat.lm_head.weight.zero_()
    b.prepare(target, [flat.pack()])
    eng = build(EngineConfig(target, loaded(flat), b, 4, 1))
    (f,) = eng.run([Request(0, 0, tuple(PROMPT), 20, Sampling())])
    assert f.stats["proposed"] == 0
    sure = random_head(target, seed=4)
    with torch.no_grad():
        sure.norm.weight.fill_(1000.0)
    b.prepare(target, [sure.pack()])
    eng = build(EngineConfig(target, loaded(sure), b, 4, 1))
    (f,) = eng.run([Request(0, 0, tuple(PROMPT), 20, Sampling())])
    assert f.stats["proposed"] > 0


V5 = ModelConfig(vocab_size=5, dim=16, n_layers=1, n_heads=2, n_kv_heads=2, hidden_dim=32, max_seq_len=64)


def test_sampling_with_the_head_follows_the_target() -> None:
    """20,000 sampled requests of 2 tokens, 64 at a time, a head of 4 of the 5 tokens (q zero on the fifth)
    drafting 2: the pairs follow the target's law (24 dof, chi2 < 51.2); the negative control, the same counts
    against the target's law at temperature 1.5, is rejected, so the test can tell such a difference."""
    target = random_model(V5, seed=0, scale=30.0)
    hot = random_model(V5, seed=0, scale=30.0 / 1.5)  # the same logits / 1.5
    head = random_head(target, seed=1, cut=4, scale=30.0)
    prompt = [1, 3]
    eng = build(EngineConfig(target, loaded(head), Backend(), 2, 64))
    n = 20_000
    counts = torch.zeros(5, 5)
    for f in eng.run(Request(i, i, tuple(prompt), 2, Sampling(1.0, seed=i)) for i in range(n)):
        counts[f.tokens[0], f.tokens[1]] += 1
    vs_p, vs_hot = chi2(counts, pair_law(target, prompt)), chi2(counts, pair_law(hot, prompt))
    print(f"eagle sampling: chi2 vs target {vs_p:.1f}, vs the target at T=1.5 {vs_hot:.1f}")
    assert vs_p < 51.2
    assert vs_hot > 200


def test_the_file_round_trips_and_is_found_by_the_targets_weights(target, tmp_path: Path) -> None:
    head = random_head(target, seed=5, cut=30)
    fp = eagle.weights_fingerprint(target)
    path = tmp_path / "any-name.safetensors"
    eagle.save(path, head, tokenizer="tok", target=fp, facts={"x": 1})
    back, meta = eagle.load(path, target)
    assert torch.equal(back.ids, head.ids) and back.taps == head.taps and meta["target"] == fp
    for name, p in head.state_dict().items():  # its rows are the target's, read from the target, never stored
        want = target.head_weight[head.ids] if name == eagle.ROWS else p.half().float()
        assert torch.equal(back.state_dict()[name], want), name
    assert eagle.ROWS not in load_file(str(path))
    tgt = Target(target, None, "tok", tmp_path / "target.safetensors", None)  # type: ignore[arg-type]
    assert find_eagle(tgt) == path
    other = random_model(TINY, seed=9)  # norms of ones, as the target's: trained norms tell models apart
    with torch.no_grad():
        other.layers[1].input_layernorm.weight[3] += 0.01
    assert eagle.weights_fingerprint(other) != fp
    with pytest.raises(CheckpointError, match="no EAGLE head"):
        find_eagle(Target(other, None, "tok", tmp_path / "target.safetensors", None))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "named"),
    [({"kind": "mtp"}, "not an EAGLE head"), ({"ids": "[0, 0, 1]"}, "distinct"), ({"ids": "[999]"}, "distinct"),
     ({"taps": "[7]"}, "not layers"), ({"taps": "x"}, "not lists")],
)  # fmt: skip
def test_a_bad_file_is_refused_in_one_line(target, tmp_path: Path, change: dict, named: str) -> None:
    path = tmp_path / "h.safetensors"
    eagle.save(path, random_head(target, seed=6, cut=3), tokenizer="t", target="f", facts={})
    meta = read_meta(path) | change
    write_safetensors(load_file(str(path)), path, meta)
    with pytest.raises(CheckpointError, match=named) as e:
        eagle.load(path, target)
    assert "\n" not in str(e.value)


def test_the_fingerprint_is_the_folders_and_the_gguf_files(family, tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    from test_qwen import hf_model, save, write_converted

    from smallem_cli.interop.gguf import load_gguf
    from smallem_cli.interop.hf import load_hf

    hf = hf_model("qwen3")
    folder, _ = load_hf(save(hf, tmp_path / "hf", family.tokenizer))
    write_converted(hf, "qwen3", tmp_path / "m.gguf", family.tokenizer)
    assert eagle.weights_fingerprint(folder) == eagle.weights_fingerprint(load_gguf(tmp_path / "m.gguf").model)
    again, _ = load_hf(save(hf_model("qwen3", seed=1), tmp_path / "hf2", family.tokenizer))
    assert eagle.weights_fingerprint(again) != eagle.weights_fingerprint(folder)


def tiny_data(target, folder: Path, budget: int) -> int:
    taps = data.record_taps(eagle.default_taps(target.cfg.n_layers), target.cfg.n_layers)
    recorder = data.Recorder(taps)
    eng = build(EngineConfig(target, NONE, Backend(), None, 8), recorder)
    meta = {"taps": json.dumps(list(taps)), "target": "t"}

    def prompt(text: str) -> list[int]:
        return [ord(c) % target.cfg.vocab_size for c in text[:12]]

    return data.generate(eng, recorder, prompt, folder, budget, 16, 0, meta, lambda line: None)


def test_the_data_is_the_engines_states_appended_and_resumed(target, tmp_path: Path, monkeypatch) -> None:
    """Each shard's states are the tapped outputs of a pass over its document (the engine's, not a second pass's);
    a larger budget appends shards and leaves the first as it was."""
    monkeypatch.setattr(data, "SHARD", 4)
    tiny_data(target, tmp_path, 1)
    first = (tmp_path / "shard-00000.safetensors").read_bytes()
    assert len(data.shard_paths(tmp_path)) == 1
    have = tiny_data(target, tmp_path, 2 * data.shard_tokens(tmp_path) + 1)
    assert (tmp_path / "shard-00000.safetensors").read_bytes() == first and len(data.shard_paths(tmp_path)) == 3
    assert have == data.shard_tokens(tmp_path)
    s = data.read_shards(tmp_path)
    taps = data.record_taps(eagle.default_taps(target.cfg.n_layers), target.cfg.n_layers)
    for doc in (0, 5):
        at = (s.docs == doc).nonzero()[:, 0]
        ids = s.tokens[at]
        b = build_step([[0, 1, 2, 3]], [0], [len(ids) - 1], 16, "cpu")
        _, want = transformer_pass(target, slab_for(target, 64, torch.device("cpu")), ids[:-1], b, "none", None, taps)
        got = s.states[at[:-1]].float().flatten(1)
        assert torch.allclose(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))
        assert not s.answer[at[0]] and s.answer[at[-1]]


def test_training_time_test_lowers_the_loss(target, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(data, "SHARD", 16)
    tiny_data(target, tmp_path / "d", 1)
    shards = data.read_shards(tmp_path / "d")
    ids = data.frequent(shards, 48, target.cfg.vocab_size, [])
    head = tr.new_head(target, eagle.default_taps(target.cfg.n_layers), ids, seed=0)
    teacher = tr.Teacher.of(target, ids)
    x = torch.stack([torch.arange(20), torch.arange(20) + 20])
    before, _ = tr.ttt_loss(head, teacher, shards, x, target.cos, target.sin)
    settings = TrainSettings(budget_tokens=150 * 4 * 18, batch_size=4, seq_len=18, lr=1e-2, warmup_steps=1)
    facts = tr.train_head(head, teacher, shards, target.cos, target.sin, settings, tmp_path / "run", None)
    after, extra = tr.ttt_loss(head, teacher, shards, x, target.cos, target.sin)
    assert float(after) < 0.7 * float(before)
    assert {"val_top1@1", "val_top1@2", "val_top1@3"} <= set(facts) and set(extra) == {"top1@1", "top1@2", "top1@3"}


def test_the_cost_model_picks_k() -> None:
    """More tokens a round for the cost of more draft steps: a head accepted often drafts longer, a poor one little."""
    from smallem_cli.engine import cost

    assert cost.tokens_per_round([0.5], 2) == 1.75 and cost.tokens_per_round([1.0, 0.5], 3) == 2.75
    v = [0.0, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8, 1.9]  # a verification of T tokens: 1 + 0.1 (T - 1)
    assert cost.best_k([0.9], 0.05, v) > cost.best_k([0.6], 0.05, v) > 1
    assert cost.best_k([0.05], 0.3, v) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--head-vocab", "3"], "--head-vocab must be >= 16"), (["--data-tokens", "0"], "--data-tokens must be >= 1"),
     (["--target", "nowhere.gguf"], "no such checkpoint")],
)  # fmt: skip
def test_train_eagle_refuses_bad_options_in_one_line(family, tmp_path: Path, argv: list[str], message: str) -> None:
    from test_cli import refused
    from typer.testing import CliRunner

    from smallem_cli.cli.app import app

    base = ["train", "eagle", "--target", str(family.target), "--run-dir", str(tmp_path / "r")]
    refused(CliRunner().invoke(app, [*base, *argv]), message)


SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "eagle-smollm2.safetensors"
SMOL = Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.skipif(not SHIPPED.is_file(), reason="checkpoints/eagle-smollm2.safetensors is absent")
def test_the_shipped_head_is_compact_float16_and_names_its_target() -> None:
    meta = read_meta(SHIPPED)
    assert meta["kind"] == eagle.KIND and len(meta["target"]) == 16
    assert {t.dtype for t in load_file(str(SHIPPED)).values()} == {torch.float16}
    assert SHIPPED.stat().st_size <= 16e6
    assert len(json.loads(meta["ids"])) == 8192 and json.loads(meta["taps"]) == [2, 15, 27]


@pytest.mark.skipif(not (SHIPPED.is_file() and SMOL.is_file()), reason="SmolLM2's GGUF file is absent (make smollm2)")
@pytest.mark.parametrize("engine", ["eager", "native"])
def test_the_shipped_head_serves_smollm2_and_keeps_its_tokens(engine: str) -> None:
    from smallem_cli.engine import family
    from smallem_cli.model.chat import chat_ids

    tgt = family.load_target(SMOL, torch.device("cpu"), chat=True)
    p = family.load_proposer("eagle", tgt, torch.device("cpu"))
    assert p.name == "eagle" and p.acceptance and all(0 < a < 1 for a in p.acceptance)
    b = backend(engine, tgt.model, *p.models)
    msgs = [[{"role": "user", "content": q}] for q in ("What is a prime number?", "Name three colors.")]
    prompts = [chat_ids(tgt.tok, tgt.chat, m) for m in msgs]
    alone = run(tgt.model, NONE, b, prompts, 24)
    drafted = run(tgt.model, p, b, prompts, 24, k=4)
    assert drafted == alone


def test_the_default_k_is_measured_on_the_native_engine(target) -> None:
    """With its acceptance known (its file's facts), a head's k is the cost model's on the native engine; a k given,
    or the eager engine, keeps its own."""
    from dataclasses import replace

    from smallem_cli import defaults

    head = random_head(target, seed=7)
    p = replace(loaded(head), acceptance=(0.9, 0.8))
    b = backend("native", target, head)
    auto = build(EngineConfig(target, p, b, None, 1))
    assert 1 <= auto.k <= defaults.MAX_EAGLE_K and auto.k == auto.k_sample == p.measured_k
    assert build(EngineConfig(target, p, b, 2, 1)).k == 2
    assert build(EngineConfig(target, replace(p, measured_k=None), Backend(), None, 1)).k == defaults.K["eagle"][0]
