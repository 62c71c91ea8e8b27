"""Token trees in the engine: the tree step's inputs, greedy identity (eager and native),
sampling by the target's law."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import PROMPT, TINY, random_model, random_mtp
from engine_help import halved, reference_logits, spy_native
from test_engine import V5, chi2, decode, prompts, requests

from smallem_cli.backends.engines import Backend
from smallem_cli.engine.build import build
from smallem_cli.engine.config import EngineConfig
from smallem_cli.engine.family import NONE, LoadedProposer
from smallem_cli.engine.generate import generate
from smallem_cli.engine.request import Request
from smallem_cli.engine.scheduler import Engine
from smallem_cli.kv.step import build_tree
from smallem_cli.model.llama import MTPModule, Transformer
from smallem_cli.spec.head import Head
from smallem_cli.spec.sampling import Sampling
from smallem_cli.spec.tree import tree_depth, tree_mask

PS = 16
no_native = shutil.which("g++") is None or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512")
ENGINES = ["eager", pytest.param("native", marks=pytest.mark.skipif(no_native, reason="needs g++ and an AVX2 CPU"))]


def tree_engine(
    target: Transformer,
    mtp: MTPModule,
    k: int,
    tree: tuple[int, int] | None,
    max_batch: int,
    cut: int = 0,
    backend: Backend | None = None,
) -> Engine:
    """The batch engine with the MTP module growing trees of (guesses, width) (None: a chain),
    its head cut to `cut` tokens (0: whole), on `backend` (None: eager)."""
    V = target.cfg.vocab_size
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:cut] if cut else None
    p = LoadedProposer("mtp", mtp, Head(target, ids), tree=tree)
    return build(EngineConfig(target, p, backend or Backend(), k, max_batch, decode=decode))


@pytest.fixture(scope="module")
def native_pair() -> tuple[Transformer, MTPModule, Backend]:
    """A float16-exact target and MTP module, and the native backend prepared for both."""
    target, mtp = halved(random_model(TINY, seed=0)), halved(random_mtp(TINY, seed=2))
    b, log = Backend("native"), []
    assert b.prepare(target, [mtp], log.append) == "native", log  # type: ignore[arg-type]
    return target, mtp, b  # type: ignore[return-value]


def on(engine: str, request: pytest.FixtureRequest) -> tuple[Transformer, MTPModule, Backend]:
    """The models and backend a test runs `engine` with: eager, the session's target and MTP module."""
    if engine == "native":
        return request.getfixturevalue("native_pair")
    return request.getfixturevalue("target"), request.getfixturevalue("mtp"), Backend()


def test_tree_step_sees_ancestors_at_their_depth() -> None:
    """build_tree: node i at position start + depth(i), written at entry start + i, seeing the
    prefix, its ancestors and itself; padding in S is never seen."""
    parents = [[-1, 0, 0, 1, 1, 2], [-1, 0, 1]]
    starts = [5, 20]
    tables = [[3, 0], [1, 2]]
    rows = [[0, 1, 2, 3, 4, 5], [1, 2]]
    b = build_tree(tables, starts, parents, rows, 16, torch.device("cpu"))
    assert b.counts == [6, 2]
    for s, (par, st, r) in enumerate(zip(parents, starts, rows, strict=True)):
        p = torch.tensor(par)
        depth = tree_depth(p)
        mask = tree_mask(p)
        first = sum(len(x) for x in rows[:s])
        for j, i in enumerate(r):
            assert int(b.positions[first + j]) == st + int(depth[i])
            slot = tables[s][(st + i) // 16] * 16 + (st + i) % 16
            assert int(b.slots[first + j]) == slot
            seen = b.bias[s, j] == 0
            assert seen[:st].all()
            assert seen[st : st + len(par)].tolist() == mask[i].tolist()
            assert not seen[st + len(par) :].any()


@pytest.mark.parametrize(("k", "tree"), [(1, (3, 3)), (3, (6, 2)), (4, (12, 4)), (5, (16, 3))])
@pytest.mark.parametrize("engine", ENGINES)
def test_greedy_trees_are_the_target_alone(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, engine: str, k: int, tree: tuple[int, int]
) -> None:
    """Every request of a batch of 8, decoded with MTP trees, equals the target alone (eager);
    native: with every pass native, the tree's growth and its verify pass."""
    target, mtp, b = on(engine, request)
    calls = spy_native(monkeypatch)
    reqs = requests(prompts(12, 64, seed=11), n=50)
    eng = tree_engine(target, mtp, k, tree, max_batch=8, backend=b)
    got = {f.request.index: f for f in eng.run(reqs)}
    assert bool(calls) == (engine == "native")
    for r in reqs:
        ref, _ = generate(target, NONE, list(r.prompt), r.max_new_tokens, 0)
        assert got[r.index].tokens == ref, f"request {r.index}"
        assert got[r.index].stats["backend"] == engine
    assert eng.pool.used() == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_generate_with_a_tree_is_the_target_alone(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """One prompt (`generate`, the engine of one sequence) with trees of 8 guesses: the target
    alone's tokens, more than one kept per target pass."""
    target, mtp, b = on(engine, request)
    ref, _ = generate(target, NONE, PROMPT, 40, 0)
    calls = spy_native(monkeypatch)
    got, st = generate(target, LoadedProposer("mtp", mtp, Head(target), tree=(8, 4)), PROMPT, 40, 3, backend=b)
    assert got == ref and st.backend == engine and bool(calls) == (engine == "native")
    assert st.tokens_per_pass > 1


def test_trained_mtp_trees_keep_more_than_its_chain(trained) -> None:
    """With a trained module, a tree gives the same tokens as the chain of the same depth in
    fewer target passes, and both are the target alone; with a repetition penalty and a cut
    head too."""
    target, mtp, period = trained.model, trained.mtp, trained.period
    ps = [period[i : i + 10] for i in (0, 3, 7, 12)] + [[7, 7, 7, 2, 9, 61, 33], [5, 1, 5, 1, 40]]
    for opts, cut in ((Sampling(), 0), (Sampling(repetition_penalty=1.3), 40)):
        reqs = [Request(i, i, tuple(p), 40, opts) for i, p in enumerate(ps)]
        chain = tree_engine(target, mtp, 3, (3, 1), max_batch=6, cut=cut)  # width 1: a chain
        wide = tree_engine(target, mtp, 3, (12, 4), max_batch=6, cut=cut)
        a = {f.request.index: f for f in chain.run(reqs)}
        b = {f.request.index: f for f in wide.run(reqs)}
        for r in reqs:
            ref, _ = generate(target, NONE, list(r.prompt), 40, 0, opts)
            assert a[r.index].tokens == b[r.index].tokens == ref
        passes = [sum(int(f.stats["target_passes"]) for f in x.values()) for x in (a, b)]  # type: ignore[arg-type]
        assert passes[1] < passes[0], passes  # the same tokens in fewer target passes


def test_tree_guesses_score_the_penalty(trained) -> None:
    """Under a repetition penalty a tree scores each node's children with the context and the
    node's path, as the chain scores its guesses: a tree of width 1 keeps, position by position,
    what the chain keeps."""
    target, mtp, period = trained.model, trained.mtp, trained.period
    ps = [period[i : i + 10] for i in (0, 3, 7, 12)] + [[7, 7, 7, 2, 9, 61, 33], [5, 1, 5, 1, 40]]
    reqs = [Request(i, i, tuple(p), 40, Sampling(repetition_penalty=3.0)) for i, p in enumerate(ps)]
    tree = {f.request.index: f.stats for f in tree_engine(target, mtp, 3, (3, 1), max_batch=8).run(reqs)}
    chain = {f.request.index: f.stats for f in tree_engine(target, mtp, 3, None, max_batch=8).run(reqs)}
    for r in reqs:
        assert tree[r.index]["accepted_at"] == chain[r.index]["accepted_at"], f"request {r.index}"


def triple_law(model, prompt: list[int]) -> torch.Tensor:
    """P(x1, x2, x3 | prompt) [5, 5, 5], exactly, from the model's own logits."""
    out = torch.zeros(5, 5, 5, dtype=torch.float64)
    for x1 in range(5):
        for x2 in range(5):
            p = torch.softmax(reference_logits(model, torch.tensor([*prompt, x1, x2])).double(), -1)
            out[x1, x2] = p[-3, x1] * p[-2, x2] * p[-1]
    return out


def test_sampled_requests_in_tree_mode_follow_the_target() -> None:
    """20,000 sampled requests of 3 tokens, up to 64 at a time, in an engine growing trees of
    width 2 and depth 3 (a sampled request offers the module's sampled chain, in the same
    tree pass): the triples follow the target's law (124 dof, chi2 < 190, p ~ 1e-4) and not
    another model's (the negative control)."""
    target, other = random_model(V5, seed=0, scale=30.0), random_model(V5, seed=1, scale=30.0)
    mtp = random_mtp(V5, seed=2, scale=30.0)
    prompt = [1, 3]
    law_p, law_o = triple_law(target, prompt), triple_law(other, prompt)
    eng = tree_engine(target, mtp, 3, (5, 2), max_batch=64)
    n = 20_000
    reqs = (Request(i, i, tuple(prompt), 3, Sampling(1.0, seed=i)) for i in range(n))
    counts = torch.zeros(5, 5, 5, dtype=torch.float64)
    deep = 0
    for f in eng.run(reqs):
        counts[f.tokens[0], f.tokens[1], f.tokens[2]] += 1
        deep += int(f.stats["target_passes"]) == 2  # type: ignore[arg-type]  # one round gave x2 and x3
    vs_p, vs_o = chi2(counts, law_p), chi2(counts, law_o)
    print(f"tree mode, sampled: chi2 vs target {vs_p:.1f}, vs another model {vs_o:.1f}; {deep} one-round pairs")
    assert deep > 1000  # the round kept a guess
    assert vs_p < 190
    assert vs_o > 1000


# --- the command line ----------------------------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
def test_cli_generate_with_a_tree_prints_the_target_alone(
    family, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """`smallem generate --tree N` (--engine eager, native): the greedy text of the eager target
    alone, greedy and sampled runs seeded alike give the same text whatever the tree, and the
    statistics say so."""
    from test_cli import as_json, generate

    ref = as_json(generate(family, "--proposer", "none", "-n", "30", "--json", "--engine", "eager"))
    for args in (["--tree", "6"], ["--tree", "12", "-k", "3"], ["--tree", "1", "-k", "1"]):
        got = as_json(generate(family, "--proposer", "mtp", *args, "-n", "30", "--json", "--engine", engine))
        assert got["tokens"] == ref["tokens"], args
        assert got["stats"]["proposer"] == "mtp" and got["stats"]["new_tokens"] == 30
        assert got["stats"]["backend"] == engine
    seeded = ["--temperature", "1", "--seed", "5"]
    sampled = [
        as_json(generate(family, "--proposer", "mtp", "--tree", "8", *seeded, "-n", "20", "--json", "--engine", engine))
        for _ in range(2)
    ]
    assert sampled[0]["tokens"] == sampled[1]["tokens"]  # seeded


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--proposer", "draft-2l", "--tree", "8"], r"--tree needs the MTP module as proposer"),
        (["--proposer", "ngram+mtp", "--tree", "8"], r"--tree needs the MTP module as proposer"),
        (["--proposer", "mtp", "--tree", "-1"], r"--tree must be in 0\.\.64"),
        (["--proposer", "mtp", "--tree", "65"], r"--tree must be in 0\.\.64"),
    ],
)
def test_cli_refuses_a_tree_it_cannot_grow(family, args: list[str], message: str) -> None:
    from test_cli import generate, refused

    refused(generate(family, *args, "-n", "5"), message)


def test_cli_batch_with_trees_answers_as_generate(family, tmp_path) -> None:
    """`smallem batch --tree 8`: every answer's tokens are `smallem generate --proposer none`'s."""
    import json

    from test_cli import as_json, generate
    from typer.testing import CliRunner

    from smallem_cli.cli.app import app

    prompts = ["In the beginning", "And God said", "Blessed are the"]
    res = CliRunner().invoke(
        app,
        ["batch", "-", "--target", str(family.target), "--proposer", "mtp", "--tree", "8", "-n", "20", "--ordered"],
        input="\n".join(prompts) + "\n",
    )
    assert res.exit_code == 0, res.output
    answers = [json.loads(line) for line in res.stdout.splitlines()]
    for p, a in zip(prompts, answers, strict=True):
        ref = as_json(generate(family, "--proposer", "none", "-n", "20", "--json", prompt=p))
        assert a["tokens"] == ref["tokens"], p


def test_sampled_request_in_tree_mode_depends_on_its_seed_alone(target, mtp) -> None:
    """A sampled request gives the same tokens alone and among greedy and sampled others."""
    ps = prompts(9, 64, seed=21)
    opts = [Sampling(1.0, seed=40 + i) if i % 2 else Sampling() for i in range(len(ps))]
    reqs = [Request(i, i, tuple(p), 30, o) for i, (p, o) in enumerate(zip(ps, opts, strict=True))]
    together = {f.request.index: f.tokens for f in tree_engine(target, mtp, 3, (8, 2), max_batch=9).run(reqs)}
    for r in reqs:
        alone = next(iter(tree_engine(target, mtp, 3, (8, 2), max_batch=1).run([r])))
        assert alone.tokens == together[r.index], r.index
        if r.sampling.greedy:
            ref, _ = generate(target, NONE, list(r.prompt), 30, 0)
            assert alone.tokens == ref


def test_bench_rows_for_each_tree_budget(family, tmp_path) -> None:
    """`smallem bench --tree 3,6`: a row per MTP proposer and budget, each 2/2 identical; a bad
    budget is one line and exit 2."""
    import json

    from test_cli import refused
    from typer.testing import CliRunner

    from smallem_cli.cli.app import app

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"tokens": list(range(5 + i, 17 + i)), "text": ""}) for i in range(2)))
    base = ["bench", "--target", str(family.target), "--proposers", "draft-2l,mtp", "--prompts", str(prompts)]
    args = [*base, "-n", "12", "--repeats", "1", "--modes", "greedy", "--engines", "eager", "--json"]
    res = CliRunner().invoke(app, [*args, "--tree", "3,6"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["rows"]
    assert [r["proposer"] for r in rows] == ["none", "draft-2l", "mtp", "mtp@tree3", "mtp@tree6"]
    assert all(r["identical"] == "2/2" for r in rows)
    for bad, message in (("0", r"--tree must be in 1\.\.64"), ("3,x", r"--tree takes budgets like")):
        refused(CliRunner().invoke(app, [*args, "--tree", bad]), message)
