"""The compiled engine: the graphs' math against the eager path, AOT packages end to end.

Graph math runs the step modules of graphs.py eagerly, as plain nn.Modules (fast, many
shapes). The AOT tests compile for real, so they are few and share one cache folder:
the tiny family's target (T=1, T=2) and MTP module (T=1, T=2), every pass that a run
with no proposer or with MTP at k=1 takes. The CLI tests then load those same packages
(same weights, same key) instead of compiling again.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import DRAFT_CFG, PROMPT, TINY, Family, random_model, random_mtp
from typer.testing import CliRunner

from smallem_cli import aot, checkpoint, graphs
from smallem_cli import family as families
from smallem_cli.cache import PagedKVCache
from smallem_cli.chain import MTPChain, MTPSampledChain
from smallem_cli.cli import app
from smallem_cli.generate import generate
from smallem_cli.model import MTPModule, Transformer
from smallem_cli.proposers import Head, MTPProposer, NoProposer
from smallem_cli.sampling import Sampling
from smallem_cli.steps import MIN_PAST, compiled_step
from smallem_cli.verify import Warper, uniforms

ATOL = RTOL = 1e-4
TS = (1, 2, 3, 4, 5, 16)
PASTS = (2, 17, 40)
VARIANTS = [(head, last) for head in (True, False) for last in (True, False)]

no_compiler = shutil.which("g++") is None or shutil.which("gcc") is None
needs_compiler = pytest.mark.skipif(no_compiler, reason="AOTInductor needs a C++ compiler (no g++ or gcc on PATH)")


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


# --- graph math, no compiling -------------------------------------------------------------------
@pytest.fixture(scope="module")
def eager_models() -> dict[str, Transformer]:
    """Fresh models (never given compiled steps): TINY is GQA (4 heads on 2 kv heads), the draft MHA."""
    return {"tiny": random_model(TINY, seed=0), "draft": random_model(DRAFT_CFG, seed=1)}


@pytest.fixture(scope="module")
def eager_mtp() -> MTPModule:
    return random_mtp(TINY, seed=2)


def prefilled(model: Transformer | MTPModule, S: int, fill) -> tuple[PagedKVCache, int]:
    cache = model.new_cache(4)  # 64 slots: past and new tokens on consecutive pages
    seq = cache.new_sequence()
    fill(cache, seq)
    assert cache.length(seq) == S
    return cache, seq


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("name", ["tiny", "draft"])
@torch.inference_mode()
def test_transformer_step_matches_eager(eager_models, name: str, T: int) -> None:
    """Logits, hidden states and the new K/V of `TransformerStep` are the eager forward's,
    for every (head, last) variant and several past lengths."""
    model = eager_models[name]
    V, d = model.cfg.vocab_size, model.cfg.dim
    g = torch.Generator().manual_seed(T)
    for S in PASTS:
        prefix = torch.randint(0, V, (S,), generator=g)
        new = torch.randint(0, V, (T,), generator=g)
        for head, last in VARIANTS:
            what = f"{name} T={T} S={S} head={head} last={last}"
            cache, seq = prefilled(model, S, lambda c, s: model(prefix, c, s))  # noqa: B023
            step = cache.append(seq, T)
            assert step.view is not None and step.start == S
            module = graphs.TransformerStep(model, head, last)
            cos, sin = model.rope_cos[S : S + T], model.rope_sin[S : S + T]
            logits_g, hidden_g, new_g = module(new, cos, sin, step.past())
            cache.keep(seq, S)  # the graph wrote nothing: the eager pass takes the same slots
            logits_e, hidden_e = model(new, cache, seq, head=head, last=last)
            rows = 1 if last else T
            assert hidden_e.shape == (rows, d)
            assert logits_e.shape == ((rows, V) if head else (0, d))
            close(hidden_g, hidden_e, f"{what}: hidden")
            close(logits_g, logits_e, f"{what}: logits")
            written = cache.kv[:, :, :, step.slots]  # [L, 2, Hkv, T, D], what the eager pass stored
            close(new_g, written, f"{what}: new K/V")
            assert written.abs().sum() > 0


@pytest.mark.parametrize("T", TS)
@torch.inference_mode()
def test_mtp_step_matches_eager(eager_models, eager_mtp, T: int) -> None:
    """`MTPStep` against `MTPModule.decode` (its table and rope from the target), last or not."""
    target, mtp = eager_models["tiny"], eager_mtp
    embed, d, V = target.embed_tokens.weight, TINY.dim, TINY.vocab_size
    g = torch.Generator().manual_seed(100 + T)
    for S in PASTS:
        h0, x0 = torch.randn(S, d, generator=g) * 3, torch.randint(0, V, (S,), generator=g)
        h, new = torch.randn(T, d, generator=g) * 3, torch.randint(0, V, (T,), generator=g)

        def fill(c: PagedKVCache, s: int) -> None:
            st = c.append(s, S)  # noqa: B023
            mtp.decode(h0, x0, embed, target.rope_packed[: st.length], c, st)  # noqa: B023

        for last in (False, True):
            what = f"mtp T={T} S={S} last={last}"
            cache, seq = prefilled(mtp, S, fill)
            step = cache.append(seq, T)
            module = graphs.MTPStep(mtp, embed, last)
            cos, sin = target.rope_cos[S : S + T], target.rope_sin[S : S + T]
            hidden_g, new_g = module(h, new, cos, sin, step.past())
            hidden_e = mtp.decode(h, new, embed, target.rope_packed[S : S + T], cache, step, last)
            assert hidden_e.shape == (1 if last else T, d)
            close(hidden_g, hidden_e, f"{what}: hidden")
            close(new_g, cache.kv[:, :, :, step.slots], f"{what}: new K/V")


@pytest.mark.parametrize("k", [2, 4, 6])
@pytest.mark.parametrize("cut", [False, True])
@torch.inference_mode()
def test_mtp_chain_guesses_as_step_by_step(eager_models, eager_mtp, k: int, cut: bool) -> None:
    """`MTPChain` (the greedy chain as one graph, run here as a plain module) guesses what the
    step-by-step loop guesses, from the same state, cache and head (whole or cut)."""
    target, mtp = eager_models["tiny"], eager_mtp
    V = TINY.vocab_size
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(k))[: V // 2] if cut else None
    head = Head(target, ids)
    g = torch.Generator().manual_seed(k)
    for S in PASTS:
        prompt = torch.randint(0, V, (S,), generator=g)
        tc = target.new_cache(8)
        _, hidden = target(prompt, tc, tc.new_sequence())
        p = MTPProposer(target, mtp, 64, head)
        p.start(prompt[:-1], prompt[-1:], hidden[:-1])
        eager, _ = p.propose(k, None, None)  # catch-up, then k guesses step by step
        L = p.true_len
        p.cache.keep(p.seq, L - 1)  # the catch-up's last pair (h_{S-2}, x_{S-1}) once more: its state
        out = p.step(hidden[-2:-1], prompt[-1:], last=True)
        assert p.cache.length(p.seq) == L
        where = p.cache.append(p.seq, 0)
        module = MTPChain(mtp, target.embed_tokens.weight, head.w, head.ids, k)
        cos, sin = target.rope_cos[L : L + k - 1], target.rope_sin[L : L + k - 1]
        fused, tops = module(out, cos, sin, where.past())
        assert fused.tolist() == eager.tolist(), (S, k, cut)
        assert tops.shape == (k,) and bool(((tops > 0) & (tops <= 1)).all())
        assert p.cache.length(p.seq) == L  # the chain wrote nothing
        # Sampled: the same draws (the same generator, in the same order) give the same
        # guesses, and the q they were drawn from.
        p.cache.keep(p.seq, L - 1)
        p.pending_h, p.pending_next, p.proposed = hidden[-2:-1], prompt[-1:], False
        sampled, q_eager = p.propose(k, Warper(0.8), torch.Generator().manual_seed(S))
        assert q_eager is not None
        u = uniforms((k,), torch.Generator().manual_seed(S), out)
        module = MTPSampledChain(mtp, target.embed_tokens.weight, head.w, head.ids, k)
        fused, q = module(out, torch.tensor([1 / 0.8]), u, cos, sin, where.past())
        assert fused.tolist() == sampled.tolist(), (S, k, cut)
        close(head.expand(q), q_eager, f"sampled chain q, S={S} k={k}")
        p.release()


# --- when a compiled step may serve a pass ---------------------------------------------------------
def test_compiled_step_falls_back_where_a_graph_cannot_serve(tmp_path: Path) -> None:
    model = random_model(TINY, seed=0)
    steps = aot.for_transformer(model, root=tmp_path)
    fn = object()
    steps.fns[(1, True, False)] = fn  # stands for a loaded package: nothing is compiled here
    model.compiled = steps
    cache = model.new_cache(1)
    assert tuple(cache.kv.shape) == steps.slab_shape  # a model with compiled steps: caches over its context
    seq = cache.new_sequence()
    cache.append(seq, MIN_PAST - 1)
    assert compiled_step(steps, cache, cache.append(seq, 1), True, False) is None  # past of MIN_PAST - 1
    step = cache.append(seq, 1)  # past of MIN_PAST
    assert compiled_step(steps, cache, step, True, False) is fn
    assert compiled_step(steps, cache, step, False, False) is None  # a variant not prepared
    assert compiled_step(steps, cache, step, True, True) is fn  # last on one token is the same graph
    steps.enabled = False
    assert compiled_step(steps, cache, step, True, False) is None
    steps.enabled = True
    # a cache of another slab shape
    other = PagedKVCache(TINY.n_layers, TINY.n_kv_heads, TINY.head_dim, 4)
    s = other.new_sequence()
    other.append(s, 5)
    assert compiled_step(steps, other, other.append(s, 1), True, False) is None
    # non-consecutive pages: two sequences interleave their pages
    a, b = cache.new_sequence(), cache.new_sequence()
    cache.append(a, 16)
    cache.append(b, 16)
    st = cache.append(a, 1)  # a's pages: two apart
    assert st.view is None
    assert compiled_step(steps, cache, st, True, False) is None


def test_positions_past_the_context_never_reach_a_graph(tmp_path: Path) -> None:
    """The slab has a page more than the context, so a past past the rope tables still fits its
    shape: such a pass must go eager (a compiled step would read the short rope out of bounds)."""
    target, mtp = random_model(TINY, seed=0), random_mtp(TINY, seed=2)
    called: list[str] = []

    def fake(name: str):
        def fn(*args):
            called.append(name)
            raise LookupError("a graph ran")

        return fn

    target.compiled = aot.for_transformer(target, root=tmp_path)
    target.compiled.fns[(2, True, False)] = fake("target")
    mtp.compiled = aot.for_mtp(mtp, target, root=tmp_path)
    mtp.compiled.fns[(2, True, True)] = fake("mtp")
    ctx = TINY.max_seq_len
    tokens = torch.tensor([1, 2])
    with torch.inference_mode():
        cache = target.new_cache(1)
        seq = cache.new_sequence()
        cache.append(seq, ctx - 2)
        with pytest.raises(LookupError):  # the last two positions of the context: the graph serves
            target(tokens, cache, seq)
        cache.keep(seq, ctx - 1)
        with contextlib.suppress(RuntimeError):  # one past the end: whatever eager does, no graph
            target(tokens, cache, seq)
        mcache = mtp.new_cache(1)
        mseq = mcache.new_sequence()
        h = torch.randn(2, TINY.dim)
        for start, expected in ((ctx - 2, LookupError), (ctx - 1, RuntimeError)):
            mcache.keep(mseq, 0)
            mcache.append(mseq, start)
            step = mcache.append(mseq, 2)
            rope = target.rope_packed[step.start : step.length]  # as MTPProposer slices it
            with contextlib.suppress(expected):
                mtp.decode(h, tokens, target.embed_tokens.weight, rope, mcache, step, last=True)
    assert called == ["target", "mtp"]


def test_key_depends_on_the_thread_count(tmp_path: Path) -> None:
    steps = aot.for_transformer(random_model(TINY, seed=0), root=tmp_path)
    before = torch.get_num_threads()
    one = steps.key(1, True, False)
    try:
        torch.set_num_threads(2)
        two = steps.key(1, True, False)
    finally:
        torch.set_num_threads(before)
    assert one != two
    assert steps.key(1, True, False) == one
    assert len({steps.key(1, True, False), steps.key(2, True, False), steps.key(1, False, False)}) == 3


def test_engine_names() -> None:
    cpu = torch.device("cpu")
    names = ("compiled", "auto", "eager", "native")
    assert [aot.engine_mode(e, cpu) for e in names] == ["build", "native", None, "native"]
    gpu = torch.device("cuda")  # a device object needs no GPU: the CPU engines refuse it, auto is eager there
    assert aot.engine_mode("auto", gpu) is None
    for e in ("compiled", "native"):
        with pytest.raises(ValueError, match="CPU only"):
            aot.engine_mode(e, gpu)
    with pytest.raises(ValueError, match="bogus"):
        aot.engine_mode("bogus", cpu)


# --- AOT, for real: few compiles, one cache folder -------------------------------------------------
class Compiled:
    def __init__(self, root: Path, target: Transformer, mtp: MTPModule, log: list[str], calls: dict) -> None:
        self.root, self.target, self.mtp, self.log, self.calls = root, target, mtp, log, calls


def count_calls(steps: aot.CompiledSteps, calls: dict, name: str) -> None:
    """Wrap each loaded step, so that a test sees which ones a run took."""
    for shape, fn in list(steps.fns.items()):
        assert fn is not None, (name, shape)

        def counted(*args, _fn=fn, _key=(name, *shape)):
            calls[_key] = calls.get(_key, 0) + 1
            return _fn(*args)

        steps.fns[shape] = counted


@pytest.fixture(scope="module")
def compiled(family: Family, tmp_path_factory: pytest.TempPathFactory) -> Compiled:
    """The tiny family's target and MTP module, with every pass of a run at k=0 (no proposer)
    and at k=1 (MTP) compiled into a fresh cache folder: 4 compiles."""
    if no_compiler:
        pytest.skip("AOTInductor needs a C++ compiler (no g++ or gcc on PATH)")
    root = tmp_path_factory.mktemp("aot-cache")
    cpu = torch.device("cpu")
    tgt = families.load_target(family.target, cpu)
    mtp, _ = checkpoint.load_mtp(family.mtp, tgt.model, cpu)
    mtp.eval().pack()
    log: list[str] = []
    tgt.model.compiled = aot.for_transformer(tgt.model, log.append, root)
    mtp.compiled = aot.for_mtp(mtp, tgt.model, log.append, root)
    aot.prepare(tgt.model, NoProposer(), [0], log.append)
    aot.prepare(tgt.model, MTPProposer(tgt.model, mtp, 64), [1], log.append)
    assert sorted(tgt.model.compiled.fns) == [(1, True, False), (2, True, False)]
    assert sorted(mtp.compiled.fns) == [(1, True, False), (2, True, True)]
    assert len(log) == 4 and all(line.startswith("compiling a decode step") for line in log), log
    assert len(list((root / "aot").glob("*.so"))) == 4
    calls: dict = {}
    count_calls(tgt.model.compiled, calls, "target")
    count_calls(mtp.compiled, calls, "mtp")
    return Compiled(root, tgt.model, mtp, log, calls)


def run(c: Compiled, kind: str, on: bool, n: int = 80, sampling: Sampling = Sampling()) -> list[int]:
    aot.use([c.target, c.mtp], on)
    try:
        proposer = NoProposer() if kind == "none" else MTPProposer(c.target, c.mtp, len(PROMPT) + n + 8)
        out, _ = generate(c.target, proposer, PROMPT, n, 0 if kind == "none" else 1, sampling)
    finally:
        aot.use([c.target, c.mtp], True)
    assert len(out) == n
    return out


@needs_compiler
@pytest.mark.parametrize("kind", ["none", "mtp"])
def test_compiled_generation_is_the_eager_one(compiled: Compiled, kind: str) -> None:
    """Greedy and seeded sampling give the eager run's tokens, and the compiled steps ran."""
    calls = compiled.calls
    for sampling in (Sampling(), Sampling(temperature=1.0, seed=7), Sampling(temperature=0.8, top_k=20, seed=3)):
        calls.clear()
        eager = run(compiled, kind, False, sampling=sampling)
        assert not calls  # switched off: eager alone
        assert len(set(eager)) >= 10  # a varied run, not one token repeated
        assert run(compiled, kind, True, sampling=sampling) == eager, sampling
        if kind == "none":  # one target pass per token after the prefill, each a compiled T=1 step
            assert calls == {("target", 1, True, False): 79}
        else:  # verify passes on 2 tokens; MTP catch-ups on 1 or 2 pairs
            assert calls.get(("target", 2, True, False), 0) > 10
            assert calls.get(("mtp", 2, True, True), 0) > 0 and calls.get(("mtp", 1, True, False), 0) > 0
            assert set(calls) == {("target", 2, True, False), ("mtp", 2, True, True), ("mtp", 1, True, False)}


@needs_compiler
@torch.inference_mode()
def test_compiled_steps_match_the_graphs(compiled: Compiled) -> None:
    """A loaded package computes what its graph module computes, at past lengths in its range."""
    model = compiled.target
    fn = model.compiled.fns[(2, True, False)]
    module = graphs.TransformerStep(model, True, False)
    g = torch.Generator().manual_seed(0)
    for S in (MIN_PAST, 33, model.cfg.max_seq_len - 2):  # positions stay within the rope tables
        cache = model.new_cache(1)
        seq = cache.new_sequence()
        cache.append(seq, S)
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=g))
        step = cache.append(seq, 2)
        tokens = torch.randint(0, model.cfg.vocab_size, (2,), generator=g)
        cos, sin = model.rope_cos[S : S + 2], model.rope_sin[S : S + 2]
        for got, want, what in zip(
            fn(tokens, cos, sin, step.past()),
            module(tokens, cos, sin, step.past()),
            ("logits", "hidden", "new K/V"),
            strict=True,
        ):
            close(got, want, f"S={S}: {what}")


@needs_compiler
def test_cached_packages_load_without_compiling(compiled: Compiled, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list = []
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", lambda *a, **k: built.append(a))
    log: list[str] = []
    again = aot.for_transformer(compiled.target, log.append, compiled.root)
    assert again.key(2, True, False) == compiled.target.compiled.key(2, True, False)
    again.prepare([(1, True, False), (2, True, False)])
    mtp_again = aot.for_mtp(compiled.mtp, compiled.target, log.append, compiled.root)
    mtp_again.prepare([(1, True, False), (2, True, True)])
    assert built == [] and log == []
    assert again.compile_s == 0 and mtp_again.compile_s == 0 and again.load_s > 0
    assert all(fn is not None for fn in [*again.fns.values(), *mtp_again.fns.values()])


@needs_compiler
def test_compile_failure_runs_eager(compiled: Compiled, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A compiler that fails: one line per shape saying so, no step, and generation as eager."""

    def boom(*args, **kwargs):
        raise RuntimeError("C++ compile error\nsecond line of the compiler's output")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", boom)
    log: list[str] = []
    steps = aot.for_transformer(compiled.target, log.append, tmp_path)
    steps.prepare([(1, True, False), (2, True, False)])
    failed = [line for line in log if "eager" in line]
    assert len(failed) == 2, log
    assert all("RuntimeError: C++ compile error" in line and "second line" not in line for line in failed)
    assert "T=1" in failed[0] and "T=2" in failed[1]
    assert steps.get(1, True, False) is None and steps.get(2, True, False) is None
    assert not list((tmp_path / "aot").glob("*.so"))  # nothing half-built is left to load
    saved = compiled.target.compiled
    try:
        compiled.target.compiled = steps  # enabled, but without steps: every pass eager
        out = run_target_alone(compiled.target, 40)
    finally:
        compiled.target.compiled = saved
    aot.use([compiled.target], False)
    try:
        assert out == run_target_alone(compiled.target, 40)
    finally:
        aot.use([compiled.target], True)


def run_target_alone(model: Transformer, n: int) -> list[int]:
    return generate(model, NoProposer(), PROMPT, n, 0)[0]


@needs_compiler
def test_a_corrupt_package_runs_eager(compiled: Compiled, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    built: list = []
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", lambda *a, **k: built.append(a))
    log: list[str] = []
    steps = aot.for_transformer(compiled.target, log.append, tmp_path)
    path = tmp_path / "aot" / f"{steps.key(1, True, False)}.so"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a zip archive" * 100)
    steps.prepare([(1, True, False)])
    assert len(log) == 1 and "T=1" in log[0] and log[0].endswith("running eager"), log
    assert steps.get(1, True, False) is None and built == []


def test_a_folder_others_can_write_is_not_loaded_from(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A package is a shared library: none is built or loaded in a folder writable by others."""
    built: list = []
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", lambda *a, **k: built.append(a))
    (tmp_path / "aot").mkdir()
    (tmp_path / "aot").chmod(0o777)
    log: list[str] = []
    steps = aot.for_transformer(random_model(TINY, seed=0), log.append, tmp_path)
    (tmp_path / "aot" / f"{steps.key(1, True, False)}.so").write_bytes(b"planted")
    steps.prepare([(1, True, False)])
    assert len(log) == 1 and "writable" in log[0] and log[0].endswith("running eager"), log
    assert steps.get(1, True, False) is None and built == []


# --- the CLI ---------------------------------------------------------------------------------------
def cli_generate(family: Family, *args: str):
    argv = ["generate", "The quick brown fox", "--target", str(family.target), "-n", "30", *args]
    return CliRunner().invoke(app, argv)


def test_cli_refuses_an_unknown_engine(family: Family) -> None:
    res = cli_generate(family, "--engine", "bogus")
    assert res.exit_code == 2 and res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "bogus" in lines[0], res.stderr
    assert "Traceback" not in res.output


@needs_compiler
@pytest.mark.parametrize("proposer", [("--proposer", "none"), ("--proposer", "mtp", "-k", "1")])
def test_cli_compiled_engine_prints_the_eager_text(
    compiled: Compiled, family: Family, monkeypatch: pytest.MonkeyPatch, proposer: tuple[str, ...]
) -> None:
    """`--engine compiled` loads the packages the fixture built (same weights: same keys) and
    prints the eager engine's text; its stderr holds the statistics line alone."""
    monkeypatch.setenv("SMALLEM_CACHE", str(compiled.root))
    served: list = []
    get = aot.CompiledSteps.get

    def counted(self, T, head, last):
        fn = get(self, T, head, last)
        served.append(fn is not None)
        return fn

    monkeypatch.setattr(aot.CompiledSteps, "get", counted)
    eager = cli_generate(family, *proposer, "--engine", "eager")
    assert eager.exit_code == 0 and not served, eager.stderr
    res = cli_generate(family, *proposer, "--engine", "compiled")
    assert res.exit_code == 0, (res.stderr, res.exception)
    assert res.stdout == eager.stdout and res.stdout.strip()
    assert re.fullmatch(r"\d+ tokens in .*, eager\)\n", eager.stderr), eager.stderr
    assert re.fullmatch(r"\d+ tokens in .*, compiled\)\n", res.stderr), res.stderr  # one line: nothing compiled
    assert served and all(served)


@needs_compiler
def test_cli_auto_engine_compiles_no_graph(family: Family, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The default engine is the native one (tests/test_native.py): it compiles no graph, prints
    the eager engine's text, and with -q says nothing, not even that it built its library."""
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", lambda *a, **kw: pytest.fail("compiled"))
    monkeypatch.setenv("SMALLEM_CACHE", str(tmp_path / "empty"))
    eager = cli_generate(family, "--proposer", "none", "--engine", "eager")
    auto = cli_generate(family, "--proposer", "none", "--engine", "auto", "-q")
    assert auto.exit_code == 0 and auto.stdout == eager.stdout and auto.stderr == "", auto.stderr


@needs_compiler
def test_compiled_mtp_chain_guesses_and_stays_exact(compiled: Compiled) -> None:
    """The MTP module's chain as one compiled graph (k=2, greedy and sampled: two compiles more):
    runs take it every round and give the eager run's tokens, top-p too (its guesses drawn at the
    temperature alone, `verify.proposal`, as the eager steps draw them); sampled guesses at
    adaptive depth go step by step."""
    target, mtp = compiled.target, compiled.mtp
    proposer = MTPProposer(target, mtp, len(PROMPT) + 80 + 8)
    graphs_ = {greedy: proposer.fused(2, greedy) for greedy in (True, False)}
    rounds: list[int] = []
    for greedy, ((owner, graph),) in graphs_.items():
        assert owner is mtp and mtp.compiled.prepare_fused(graph), greedy
        fn = mtp.compiled.fns_fused[graph[0]]

        def counted(*args, _fn=fn):
            rounds.append(1)
            return _fn(*args)

        mtp.compiled.fns_fused[graph[0]] = counted
    cases = [
        (Sampling(), 0.0, True),
        (Sampling(), 0.6, True),
        (Sampling(temperature=1.0, seed=7), 0.0, True),
        (Sampling(temperature=1.0, top_p=0.9, seed=7), 0.0, True),
        (Sampling(temperature=1.0, seed=7), 0.6, False),
    ]
    try:
        for sampling, p_min, fused in cases:
            rounds.clear()
            outs, stats = [], []
            for on in (False, True):
                aot.use([target, mtp], on)
                p = MTPProposer(target, mtp, len(PROMPT) + 80 + 8, p_min=p_min)
                out, st = generate(target, p, PROMPT, 80, 2, sampling)
                outs.append(out)
                stats.append(st.guessed)
            aot.use([target, mtp], True)
            assert outs[0] == outs[1], sampling
            if fused:
                assert len(rounds) > 20, sampling  # every round but the first few (a past shorter than MIN_PAST)
            else:
                assert not rounds
            if p_min:  # rounds cut short alike: the same guesses doubted, eager or fused
                assert stats[0][:2] == stats[1][:2] and sum(stats[1][:2]) > 0, stats
    finally:
        aot.use([target, mtp], True)
