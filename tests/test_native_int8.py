"""A proposer's matrices as int8 on the native engine (`--proposer-weights int8`, `native.panels8`).

A proposer's numbers change only how often its guesses are kept, so the native engine may store
its matrices as int8 with a scale per row (`Backend.prepare`'s `int8` models). What is checked:
the rule (each row within half a step of its scale); that the int8 kernels compute what the eager
backend computes on the dequantized weights (scale x q), to float32 rounding: the MTP module's
pass, the MTP and draft chains (greedy and sampled: the same guesses, the same q) and whole
generations, token for token; that greedy text stays the target's alone and the target's own
matrices are never quantized; the option.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import PROMPT, TINY, Family, noisy_copy, random_model, random_mtp
from engine_help import halved
from test_native import chain_spy, close, eager_and_native, first_round, mtp_sequence, no_native
from typer.testing import CliRunner

from smallem_cli.backends import native
from smallem_cli.backends.engines import Backend
from smallem_cli.cli.app import app
from smallem_cli.engine import family as fam
from smallem_cli.engine.family import NONE, LoadedProposer
from smallem_cli.engine.generate import generate
from smallem_cli.model.llama import MTPModule, Transformer
from smallem_cli.spec.head import Head
from smallem_cli.spec.sampling import Sampling

pytestmark = pytest.mark.skipif(no_native, reason="the native engine needs g++ and an AVX2 CPU")

BLOCK = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def roundtrip(w: torch.Tensor) -> torch.Tensor:
    """W [out, in] as the int8 kernels read it: scale[n] * q[n], from `panels8`'s own panels."""
    q, scale = native.panels8(w, 8)
    rows = q.transpose(1, 2).reshape(-1, w.shape[1]).float() * scale[:, None]  # [panels * 8, in]
    return rows[: w.shape[0]]


def dequantize_block(block: torch.nn.Module) -> None:
    with torch.no_grad():
        for name in BLOCK:
            lin = getattr(block, name)
            lin.weight.copy_(roundtrip(lin.weight))


def with_head(model: Transformer, head: torch.Tensor) -> Transformer:
    """A copy of `model` whose output head is `head` (its own lm_head: the embedding stays), packed."""
    cfg = dataclasses.replace(model.cfg, tie_embeddings=False)
    m = Transformer(cfg)
    m.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        m.lm_head.weight.copy_(head)  # type: ignore[union-attr]
    return m.pack()


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    """The target (float16), its MTP module and a draft, and their eager references: the same
    models with the int8 round trip of every matrix the native engine quantizes (the MTP module's
    block and the h half of eh_proj, a draft's blocks and head, and the head rows the chains guess
    with: the target's for the MTP module)."""
    target = halved(random_model(TINY, seed=0))
    mtp, draft = halved(random_mtp(TINY, seed=2)), halved(noisy_copy(target, 0.05, seed=5))  # type: ignore[arg-type]
    mtp_ref = copy.deepcopy(mtp)
    dequantize_block(mtp_ref.block)  # type: ignore[attr-defined]
    with torch.no_grad():
        eh = mtp_ref.eh_proj.weight  # type: ignore[attr-defined]
        eh[:, : TINY.dim] = roundtrip(eh[:, : TINY.dim])
    draft_ref = copy.deepcopy(draft)
    for b in draft_ref.layers:  # type: ignore[attr-defined]
        dequantize_block(b)
    draft_ref = with_head(draft_ref, roundtrip(draft.head_weight.detach()))  # type: ignore[arg-type, operator]
    target_ref = with_head(target, roundtrip(target.head_weight.detach()))  # type: ignore[arg-type, operator]
    return {
        "target": target,
        "mtp": mtp,
        "draft": draft,
        "target_ref": target_ref,
        "mtp_ref": mtp_ref.pack(),  # type: ignore[operator]
        "draft_ref": draft_ref,
    }


@pytest.fixture(scope="module")
def b8(models: dict[str, torch.nn.Module]) -> Backend:
    """A native backend with steps for the target, and for the MTP module and the draft stored as
    int8 (the target is flagged too: a target's steps never are)."""
    target, mtp, draft = models["target"], models["mtp"], models["draft"]
    b, log = Backend("native"), []
    assert b.prepare(target, [mtp, draft], log.append, [target, mtp, draft]) == "native", log  # type: ignore[arg-type, list-item]
    return b


def test_rule() -> None:
    """Symmetric, per row: |q| <= 127, the largest entry of a row at 127, every weight within half
    a step of its value; a zero row stays zero; rows padded to whole panels (61 rows: 64)."""
    w = torch.randn(61, 40, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.01, 5, 61)[:, None]
    w[7] = 0
    q, scale = native.panels8(w, 8)
    assert q.dtype == torch.int8 and tuple(q.shape) == (8, 40, 8) and tuple(scale.shape) == (64,)
    rows = q.transpose(1, 2).reshape(64, 40)[:61].float()
    assert rows.abs().max() <= 127 and torch.equal(rows.abs().amax(1)[w.abs().amax(1) > 0], torch.full((60,), 127.0))
    back = roundtrip(w)
    assert torch.all((back - w).abs() <= scale[:61, None] / 2 * (1 + 1e-6)) and back[7].abs().sum() == 0


def test_target_is_never_quantized(models: dict[str, torch.nn.Module], b8: Backend) -> None:
    """Even flagged, the target's own steps read float16 (a proposer's flag is a proposer's); a
    backend that was not asked for int8 reads the proposer's float16 too."""
    target, mtp, draft = models["target"], models["mtp"], models["draft"]
    steps = {name: b8.steps(m) for name, m in (("target", target), ("mtp", mtp), ("draft", draft))}
    assert all(s is not None for s in steps.values())
    assert not steps["target"].int8 and steps["mtp"].int8 and steps["draft"].int8  # type: ignore[union-attr]
    assert steps["mtp"].mw.head.w is None  # type: ignore[union-attr]  # the module has no head of its own
    f16 = Backend("native")
    assert f16.prepare(target, [mtp], None) == "native"  # type: ignore[arg-type, list-item]
    assert not f16.steps(mtp).int8 and not f16.steps(target).int8  # type: ignore[union-attr]


def test_mtp_pass_is_the_dequantized_one(models: dict[str, torch.nn.Module], b8: Backend) -> None:
    """The int8 MTP module's pass (its states, the K/V it writes) is the eager pass of its reference."""
    target = models["target"]
    g = torch.Generator().manual_seed(1)
    h, nxt = torch.randn(12, TINY.dim, generator=g) * 3, torch.randint(0, TINY.vocab_size, (12,), generator=g)
    with torch.no_grad():
        got = mtp_sequence(models["mtp"], target, h, nxt, 8, b8.steps(models["mtp"]))  # type: ignore[arg-type]
        ref = mtp_sequence(models["mtp_ref"], target, h, nxt, 8)  # type: ignore[arg-type]
        plain = mtp_sequence(models["mtp"], target, h, nxt, 8)  # type: ignore[arg-type]
    assert close(got[0], ref[0]) and close(got[1], ref[1])
    assert not close(got[0], plain[0])  # int8 it is: not the float16 module's numbers


@pytest.mark.parametrize("kind", ["mtp", "draft"])
@pytest.mark.parametrize("sampled", [False, True])
def test_chain_guesses_as_the_dequantized_steps(
    models: dict[str, torch.nn.Module], b8: Backend, kind: str, sampled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chain of 4 guesses with the head cut to 40 tokens: the int8 native chain (one call a round)
    guesses what the eager reference's step-by-step loop guesses, with the same q when sampled."""
    cut = torch.arange(TINY.vocab_size - 1, -1, -1)[:40]
    calls = chain_spy(monkeypatch)
    g = torch.Generator().manual_seed(4)
    for trial in range(4):
        prompt = torch.randint(0, TINY.vocab_size, (11,), generator=g)
        h = torch.randn(10, TINY.dim, generator=g) * 3
        sampling = Sampling(temperature=1.3, seed=trial) if sampled else Sampling()
        got = {}
        for which, bk in (("", b8), ("_ref", Backend())):
            tgt, model = models["target" + which], models[kind + which]
            hidden = h if kind == "mtp" else torch.empty(0)
            head = Head(tgt if kind == "mtp" else model, cut)  # type: ignore[arg-type]
            *_, tokens, q = first_round(bk, tgt, model, prompt[:10], prompt[10:], hidden, 4, sampling, head)  # type: ignore[arg-type]
            got[which] = tokens.tolist(), q
        (a, qa), (b, qb) = got["_ref"], got[""]
        assert a == b and len(b) == 4, (trial, a, b)
        assert calls == [4] * (trial + 1)  # the native round was one chain call; the reference's, none
        assert (qa is None) == (qb is None) == (not sampled)
        if sampled:
            assert qa is not None and qb is not None and close(qa, qb)


@pytest.mark.parametrize("kind", ["mtp", "draft"])
def test_generation(models: dict[str, torch.nn.Module], b8: Backend, kind: str) -> None:
    """Greedy: the target's own text, with the guesses the eager reference keeps; seeded sampling:
    the reference's draws, token for token."""
    target = models["target"]

    def run(which: str, sampling: Sampling, bk: Backend) -> tuple[list[int], tuple[int, int]]:
        tgt, model = models["target" + which], models[kind + which]
        head = Head(tgt if kind == "mtp" else model)  # type: ignore[arg-type]
        p = LoadedProposer(kind, model, head)  # type: ignore[arg-type]
        out, st = generate(target, p, PROMPT, 80, 3, sampling, backend=bk)  # type: ignore[arg-type]
        return out, (st.proposed, st.accepted)

    alone = eager_and_native(lambda bk: generate(target, NONE, PROMPT, 80, 0, backend=bk)[0], b8)  # type: ignore[arg-type]
    for sampling in (Sampling(), Sampling(temperature=1.0, seed=7)):
        ref = run("_ref", sampling, Backend())
        got = run("", sampling, b8)
        assert got == ref, sampling
        if sampling.greedy:
            assert got[0] == alone[0] == alone[1]


def test_the_option(family: Family) -> None:
    """load_proposer marks the proposer it loads (int8 by default, f16 when asked), and the native
    backend prepared from it reads that proposer's matrices so, never the target's;
    a bad value is one line, exit 2, for generate, batch and bench."""
    tgt = fam.load_target(family.target, torch.device("cpu"))
    for weights, flag in (("int8", True), ("f16", False)):
        for spec in ("mtp", "draft-2l", "ngram+mtp"):
            p = fam.load_proposer(spec, tgt, torch.device("cpu"), weights=weights)
            assert isinstance(p.model, MTPModule | Transformer) and p.int8 is flag, (spec, weights)
            b = Backend("native")  # as generate, batch and bench prepare it
            assert b.prepare(tgt.model, p.models, None, p.models if p.int8 else ()) == "native", (spec, weights)
            assert b.steps(p.model).int8 is flag and not b.steps(tgt.model).int8, (spec, weights)  # type: ignore[union-attr]
    runner = CliRunner()
    t = str(family.target)
    for args in (
        ["generate", "hi", "--target", t, "--proposer-weights", "int4", "-n", "2"],
        ["bench", "--target", t, "--proposer-weights", "int8,int8"],
        ["bench", "--target", t, "--proposer-weights", "fp8"],
    ):
        r = runner.invoke(app, args)
        assert r.exit_code != 0 and "--proposer-weights" in r.output and "Traceback" not in r.output, (args, r.output)


def test_bench_rows_for_both(family: Family, tmp_path: Path) -> None:
    """`bench --proposer-weights int8,f16`: the proposer's rows, and P@f16 rows beside them, all
    identical to the target alone; in the batch engine's table too."""
    import json

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"tokens": list(range(5 + i, 15 + i)), "text": ""}) + "\n" for i in range(4)))
    args = ["bench", "--target", str(family.target), "--prompts", str(prompts), "-n", "12", "--proposers", "mtp"]
    args += ["--engines", "native", "--proposer-weights", "int8,f16", "-k", "3", "--json"]
    res = CliRunner().invoke(app, [*args, "--modes", "greedy", "--repeats", "1"])
    assert res.exit_code == 0, res.output
    rows = [r for r in json.loads(res.stdout)["rows"] if r["engine"] == "native"]
    assert {r["proposer"] for r in rows} == {"mtp", "mtp@f16", "none"}
    assert all(r["identical"] == "4/4" for r in rows)
    res = CliRunner().invoke(app, [*args, "--batch", "2", "--repeats", "1"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["batch_rows"]
    assert [r["proposer"] for r in rows] == ["none", "mtp", "mtp@f16"] and all(r["identical"] == "4/4" for r in rows)
