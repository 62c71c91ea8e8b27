"""The batch engine: greedy identity per request, sampling by its own seed alone, the page pool."""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable

import pytest
import torch
from conftest import PROMPT, random_model
from engine_help import proposer, reference_logits

from smallem_cli.backends.engines import Backend
from smallem_cli.config import ModelConfig
from smallem_cli.engine.build import build
from smallem_cli.engine.config import EngineConfig
from smallem_cli.engine.family import NONE
from smallem_cli.engine.generate import generate
from smallem_cli.engine.proposers import Draft, Proposer, penalty_of
from smallem_cli.engine.request import Request
from smallem_cli.engine.sequence import Seq
from smallem_cli.kv.pool import PagePool, PoolExhausted
from smallem_cli.model.llama import MTPModule, Transformer
from smallem_cli.spec.sampling import Sampling
from smallem_cli.spec.verify import Penalty

N = 60
PS = 16


def decode(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def engine(
    models: dict,
    kind: str,
    k: int,
    max_batch: int,
    n_pages: int | None = None,
    end_ids: tuple[int, ...] = (),
    cut: int = 0,
):
    """An eager engine for the target and `kind`: none, ngram, a model of `models` by name (near,
    draft, mtp), or ngram+ one of those; `cut`: the proposer's head cut to that many tokens."""
    target = models["target"]
    V = target.cfg.vocab_size
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:cut] if cut else None  # a cut head
    base = kind.removeprefix("ngram+")
    if base in ("none", "ngram"):
        p = proposer(base)
    else:
        p = proposer(kind.replace(base, "mtp" if base == "mtp" else "draft"), target, models[base], ids)
    return build(EngineConfig(target, p, Backend(), k, max_batch, end_ids, decode, pages=n_pages))


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Mixed prompts of mixed lengths, some repeating themselves (the n-gram lookup then guesses)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = [rng.randrange(1, vocab) for _ in range(rng.randrange(1, 30))]
        out.append(p + p[: rng.randrange(0, len(p) + 1)] if i % 3 == 0 else p)
    return out


def requests(ps: list[list[int]], n: int = N, sampling: list[Sampling] | None = None) -> list[Request]:
    return [Request(i, i, tuple(p), n - (i % 5) * 7, sampling[i] if sampling else Sampling()) for i, p in enumerate(ps)]


@pytest.fixture(scope="module")
def models(target, draft, near_draft, mtp) -> dict:
    return {"target": target, "draft": draft, "near": near_draft, "mtp": mtp}


@pytest.mark.parametrize("kind", ["none", "ngram", "near", "draft", "mtp", "ngram+mtp", "ngram+near"])
def test_greedy_batch_of_16_is_the_target_alone(models, kind: str) -> None:
    """Every request's tokens in a batch of 16 equal the target alone on that prompt."""
    ps = prompts(20, 64, seed=1)
    reqs = requests(ps)
    eng = engine(models, kind, 0 if kind == "none" else 3, max_batch=16)
    got = {f.request.index: f for f in eng.run(reqs)}
    assert sorted(got) == list(range(len(reqs)))
    for r in reqs:
        ref, _ = generate(models["target"], NONE, list(r.prompt), r.max_new_tokens, 0)
        assert got[r.index].tokens == ref, f"request {r.index}"
        assert got[r.index].text == decode(ref)
    if kind in ("near", "mtp"):
        assert sum(sum(f.stats["accepted_at"]) for f in got.values()) > 0  # type: ignore[arg-type, misc]
    assert eng.pool.used() == 0


def test_requests_join_as_others_finish(models) -> None:
    """With room for 3, 10 requests all get answered, and the batch never holds more than 3."""
    seen = []
    eng = engine(models, "near", 2, max_batch=3)
    out = list(eng.run(requests(prompts(10, 64, seed=2)), progress=lambda p: seen.append(p.running)))
    assert len(out) == 10 and max(seen) <= 3 and seen.count(3) > 0
    assert seen and out[-1] is not None


@pytest.mark.parametrize("kind", ["near", "mtp", "ngram+mtp"])
def test_preemption_keeps_greedy_identity(models, kind: str) -> None:
    """A pool too small for the batch preempts sequences, recomputes them later, and every
    answer is still the target's; every page is back at the end."""
    ps = prompts(8, 64, seed=3)
    reqs = requests(ps, n=80)
    eng = engine(models, kind, 3, max_batch=8, n_pages=14)
    got = {f.request.index: f.tokens for f in eng.run(reqs)}
    assert eng.preemptions > 0
    for r in reqs:
        ref, _ = generate(models["target"], NONE, list(r.prompt), r.max_new_tokens, 0)
        assert got[r.index] == ref
    eng.pool.check()


@pytest.mark.parametrize("kind", ["near", "mtp", "ngram+mtp"])
def test_penalty_and_min_p_in_a_batch(models, kind: str) -> None:
    """Greedy requests with a repetition penalty (and min-p, which greedy ignores) beside plain
    ones: each equals the target alone with its own options."""
    ps = prompts(10, 64, seed=6)
    opts = [Sampling(repetition_penalty=1.5, min_p=0.1) if i % 2 else Sampling() for i in range(len(ps))]
    reqs = requests(ps, sampling=opts)
    got = {f.request.index: f.tokens for f in engine(models, kind, 3, max_batch=10).run(reqs)}
    for r in reqs:
        ref, _ = generate(models["target"], NONE, list(r.prompt), r.max_new_tokens, 0, r.sampling)
        assert got[r.index] == ref, f"request {r.index}"
    plain, _ = generate(models["target"], NONE, list(reqs[1].prompt), reqs[1].max_new_tokens, 0)
    assert got[1] != plain  # the penalty changed something


Chain = Callable[[torch.Tensor, int, Penalty | None], torch.Tensor]


def draft_chain(draft: Transformer) -> Chain:
    """A draft's k greedy guesses after the tokens so far, each from a whole-sequence pass (the
    training path) over them and the guesses before it, scored with the penalty."""

    def chain(tokens: torch.Tensor, k: int, pen: Penalty | None) -> torch.Tensor:
        out = []
        for _ in range(k):
            row = reference_logits(draft, torch.cat([tokens, *out]))[-1:]  # [1, V]
            g = (row if pen is None else pen.apply(row)).argmax(-1)
            if pen is not None:
                pen.take(g)
            out.append(g)
        return torch.cat(out)

    return chain


def mtp_chain(target: Transformer, mtp: MTPModule) -> Chain:
    """The MTP module's k greedy guesses after the tokens so far, from whole-sequence passes: pairs
    (h_j, x_{j+1}) over the tokens (the target's states), then each guess chained on the module's
    own state (`evaluate._mtp_chain`'s rule), scored with the penalty."""

    def chain(tokens: torch.Tensor, k: int, pen: Penalty | None) -> torch.Tensor:
        with torch.inference_mode():
            h = target.hidden(tokens[None])  # [1, C, d]
            hs, toks, out = h[:, :-1], tokens[None, 1:], []
            for _ in range(k):
                T = hs.shape[1]
                states = mtp(hs, target.embed_tokens(toks), target.cos[:T], target.sin[:T])  # [1, T, d]
                row = target.logits(states[:, -1])  # [1, V]
                g = (row if pen is None else pen.apply(row)).argmax(-1)
                if pen is not None:
                    pen.take(g)
                out.append(g)
                hs, toks = torch.cat([hs, states[:, -1:]], 1), torch.cat([toks, g[None]], 1)
        return torch.cat(out)

    return chain


class ReferenceProposer:
    """A proposer for greedy requests that guesses each sequence alone from its tokens so far (no
    cache, no batch): the reference the batched proposers are held to. `penalty`: whether its
    guesses are scored with the request's repetition penalty."""

    def __init__(self, name: str, chain: Chain, penalty: bool = True) -> None:
        self.name, self.chain, self.penalty = name, chain, penalty
        self.taps: tuple[int, ...] = ()

    def start(self, seqs: list[Seq], fed: list[torch.Tensor], hidden: list[torch.Tensor]) -> None:
        pass

    def propose(self, seqs: list[Seq], ks: list[int]) -> list[Draft]:
        out: list[Draft] = []
        for s, k in zip(seqs, ks, strict=True):
            assert s.warp is None
            pen = penalty_of(s) if self.penalty else None
            tokens = torch.tensor(s.tokens)  # the prompt and every token emitted, `last` the final one
            assert tokens[-1] == s.last
            out.append((self.chain(tokens, k, None if pen is None else pen.copy()) if k else s.last[:0], None))
        return out

    def accept(self, seq: Seq, n: int, emitted: torch.Tensor, hidden: torch.Tensor) -> None:
        pass

    def drop(self, seq: Seq) -> None:
        pass


class Spy:
    """A proposer's guesses, round by round, for each request."""

    def __init__(self, inner: Proposer) -> None:
        self.inner, self.name, self.taps = inner, inner.name, inner.taps
        self.guesses: dict[int, list[list[int]]] = defaultdict(list)

    def start(self, seqs: list[Seq], fed: list[torch.Tensor], hidden: list[torch.Tensor]) -> None:
        self.inner.start(seqs, fed, hidden)

    def propose(self, seqs: list[Seq], ks: list[int]) -> list[Draft]:
        got = self.inner.propose(seqs, ks)
        for s, g in zip(seqs, got, strict=True):
            self.guesses[s.req.index].append(g[0].tolist())
        return got

    def accept(self, seq: Seq, n: int, emitted: torch.Tensor, hidden: torch.Tensor) -> None:
        self.inner.accept(seq, n, emitted, hidden)

    def drop(self, seq: Seq) -> None:
        self.inner.drop(seq)


@pytest.mark.parametrize("kind", ["near", "mtp"])
def test_batched_guesses_score_the_penalty(models, kind: str) -> None:
    """Under a repetition penalty a batched proposer guesses as a proposer of one sequence does,
    each guess scored with its context and the guesses before it (`verify.Penalty`): in every
    request of a batch, the same guesses round by round as the whole-sequence reference's,
    hence the same guesses kept. The reference without the penalty guesses otherwise (the
    negative control: the penalty is seen)."""
    ps = prompts(8, 64, seed=7)
    reqs = requests(ps, sampling=[Sampling(repetition_penalty=1.5)] * len(ps))
    target = models["target"]
    chain = mtp_chain(target, models["mtp"]) if kind == "mtp" else draft_chain(models[kind])

    def run(p: Proposer | None) -> tuple[dict[int, dict], Spy]:
        eng = engine(models, kind if p is None else "none", 3, max_batch=8)
        eng.proposer = spy = Spy(eng.proposer if p is None else p)
        return {f.request.index: f.stats | {"tokens": f.tokens} for f in eng.run(reqs)}, spy

    batched, b_spy = run(None)
    ref, r_spy = run(ReferenceProposer(kind, chain))
    _, plain_spy = run(ReferenceProposer(kind, chain, penalty=False))
    kept = 0
    for r in reqs:
        i = r.index
        assert b_spy.guesses[i] == r_spy.guesses[i], f"request {i}"
        assert batched[i]["accepted_at"] == ref[i]["accepted_at"] and batched[i]["tokens"] == ref[i]["tokens"]
        kept += sum(ref[i]["accepted_at"])
    assert kind == "mtp" or kept > 0
    assert any(plain_spy.guesses[r.index] != r_spy.guesses[r.index] for r in reqs)


@pytest.mark.parametrize(("kind", "cut"), [("near", 0), ("mtp", 0), ("ngram", 0), ("mtp", 40), ("ngram+near", 40)])
def test_sampled_request_depends_on_its_seed_alone(models, kind: str, cut: int) -> None:
    """A sampled request gives the same text alone and in a batch with greedy and sampled others."""
    ps = prompts(9, 64, seed=4)
    samp = [
        Sampling(1.0, seed=100 + i, repetition_penalty=1.0 + (i % 3) / 4) if i % 2 else Sampling()
        for i in range(len(ps))
    ]
    reqs = requests(ps, sampling=samp)
    batched = {f.request.index: f.tokens for f in engine(models, kind, 3, max_batch=9, cut=cut).run(reqs)}
    for r in reqs[1::2]:
        alone = next(iter(engine(models, kind, 3, max_batch=1, cut=cut).run([r]))).tokens
        assert batched[r.index] == alone
    assert len({tuple(t) for t in batched.values()}) == len(reqs)


def test_stop_token_and_stop_strings(models) -> None:
    ref, _ = generate(models["target"], NONE, PROMPT, N, 0)
    stop_tok = ref[10]
    cut = ref.index(stop_tok)
    eng = engine(models, "near", 3, max_batch=2, end_ids=(stop_tok,))
    (fin,) = eng.run([Request(0, "a", tuple(PROMPT), N)])
    assert fin.tokens == ref[:cut]
    words = decode(ref).split(" ")
    stop = " ".join(words[20:22])
    eng = engine(models, "near", 3, max_batch=2)
    (fin,) = eng.run([Request(0, "a", tuple(PROMPT), N, stop=(stop, "never there"))])
    assert fin.text == decode(ref)[: decode(ref).find(stop)]
    first = next(j for j in range(1, N + 1) if stop in decode(ref[:j]))
    assert stop not in fin.text and fin.tokens == ref[:first]  # up to the token that completed the stop


def test_pool_random_walk() -> None:
    """10,000 random admit / round / finish / preempt steps: no page lost, none owned twice."""
    rng = random.Random(0)
    pool = PagePool(64, 4)
    lengths: dict[int, int] = {}
    uid = 0
    for _ in range(10_000):
        op = rng.random()
        if op < 0.2 or not lengths:  # admit
            uid += 1
            n = rng.randrange(1, 40)
            if pool.pages_for(n) <= len(pool.free):
                pool.add(uid)
                pool.reserve(uid, n)
                lengths[uid] = n
        elif op < 0.7:  # a round: reserve k + 2 more, keep a random part
            s = rng.choice(list(lengths))
            want = lengths[s] + rng.randrange(1, 8)
            try:
                pool.reserve(s, want)
            except PoolExhausted:  # preempt: all its pages back
                pool.release(s)
                del lengths[s]
                continue
            lengths[s] = rng.randrange(lengths[s], want + 1)
            pool.trim(s, lengths[s])
        else:  # finish
            s = rng.choice(list(lengths))
            pool.release(s)
            del lengths[s]
        pool.check()
        for s, n in lengths.items():
            assert len(pool.tables[s]) == pool.pages_for(n)
    for s in list(lengths):
        pool.release(s)
    assert pool.used() == 0
    pool.check()


def test_pool_refuses_without_taking() -> None:
    pool = PagePool(4, 4)
    pool.add(1)
    pool.reserve(1, 12)
    pool.add(2)
    with pytest.raises(PoolExhausted):
        pool.reserve(2, 8)
    assert pool.tables[2] == [] and len(pool.free) == 1
    pool.check()


# --- sampling stays exact in a batch: the seed's chi-square test -------------------------
V5 = ModelConfig(vocab_size=5, dim=16, n_layers=1, n_heads=2, n_kv_heads=2, hidden_dim=32, max_seq_len=64)


def pair_law(model, prompt: list[int]) -> torch.Tensor:
    """P(x1, x2 | prompt) [5, 5], exactly, from the model's own logits."""
    out = torch.zeros(5, 5)
    with torch.inference_mode():
        for x1 in range(5):
            logits = reference_logits(model, torch.tensor([*prompt, x1]))
            p = torch.softmax(logits.double(), -1)
            out[x1] = p[-2, x1] * p[-1]
    return out


def chi2(counts: torch.Tensor, law: torch.Tensor) -> float:
    expected = law.flatten() * counts.sum()
    return float(((counts.flatten() - expected) ** 2 / expected).sum())


def test_sampling_in_a_batch_follows_the_target() -> None:
    """20,000 sampled requests of 2 tokens, up to 64 at a time with a draft guessing 2: the pairs
    follow the target's law (24 dof, chi2 < 51.2) and not the draft's (the negative control)."""
    target, draft = random_model(V5, seed=0, scale=30.0), random_model(V5, seed=1, scale=30.0)
    prompt = [1, 3]
    law_p, law_q = pair_law(target, prompt), pair_law(draft, prompt)
    eng = engine({"target": target, "draft": draft}, "draft", 2, max_batch=64)
    n = 20_000
    reqs = (Request(i, i, tuple(prompt), 2, Sampling(1.0, seed=i)) for i in range(n))
    counts = torch.zeros(5, 5)
    for f in eng.run(reqs):
        counts[f.tokens[0], f.tokens[1]] += 1
    vs_p, vs_q = chi2(counts, law_p), chi2(counts, law_q)
    print(f"batch sampling: chi2 vs target {vs_p:.1f}, vs draft {vs_q:.1f}")
    assert vs_p < 51.2
    assert vs_q > 200


def penalized_pair_law(model, prompt: list[int], penalty: float, temperature: float) -> torch.Tensor:
    """P(x1, x2 | prompt) [5, 5] under CTRL's penalty (each row's context: the prompt and what
    came before) at the temperature, from the model's own logits in float64."""
    out = torch.zeros(5, 5, dtype=torch.float64)

    def law(row: torch.Tensor, seen: list[int]) -> torch.Tensor:
        hit = torch.zeros(5, dtype=torch.bool)
        hit[seen] = True
        row = torch.where(hit, torch.where(row > 0, row / penalty, row * penalty), row)
        return torch.softmax(row / temperature, -1)

    with torch.inference_mode():
        for x1 in range(5):
            logits = reference_logits(model, torch.tensor([*prompt, x1])).double()
            out[x1] = law(logits[-2], prompt)[x1] * law(logits[-1], [*prompt, x1])
    return out


# the accepted range's ends (defaults.MIN/MAX_PENALTY); models whose logits the penalty leaves
# a law to test (at 1e-3 a logit of the usual size would make the law a point mass)
@pytest.mark.parametrize(("penalty", "scale"), [(1e-3, 0.01), (1e3, 3.0)])
def test_sampling_at_the_penalty_range_ends_follows_the_target(penalty: float, scale: float) -> None:
    """At either end of the repetition penalty's range, with a temperature of 0.5, sampled pairs
    with a draft guessing 2 follow the penalised target's law (cells the law gives under 5
    draws are pooled into one), and not the unpenalised one's: no logit overflows on the way."""
    from smallem_cli import defaults

    assert (defaults.MIN_PENALTY, defaults.MAX_PENALTY) == (1e-3, 1e3)
    target, draft = random_model(V5, seed=0, scale=scale), random_model(V5, seed=1, scale=scale)
    prompt, temperature, n = [1, 3], 0.5, 8_000
    law = penalized_pair_law(target, prompt, penalty, temperature).flatten()
    plain = penalized_pair_law(target, prompt, 1.0, temperature).flatten()
    eng = engine({"target": target, "draft": draft}, "draft", 2, max_batch=64)
    sampling = [Sampling(temperature, seed=i, repetition_penalty=penalty) for i in range(n)]
    reqs = (Request(i, i, tuple(prompt), 2, sampling[i]) for i in range(n))
    counts = torch.zeros(25, dtype=torch.float64)
    for f in eng.run(reqs):
        counts[f.tokens[0] * 5 + f.tokens[1]] += 1

    def pooled_chi2(law: torch.Tensor) -> tuple[float, int]:
        expected = law * n
        big = expected >= 5
        e = torch.cat([expected[big], expected[~big].sum().view(1)])
        o = torch.cat([counts[big], counts[~big].sum().view(1)])
        keep = e > 0
        assert (o[~keep] == 0).all()  # nothing drawn where the law puts nothing
        return float(((o[keep] - e[keep]) ** 2 / e[keep]).sum()), int(keep.sum()) - 1

    vs_p, df = pooled_chi2(law)
    vs_plain, _ = pooled_chi2(plain)
    print(f"penalty {penalty:g}: chi2 vs penalised target {vs_p:.1f} ({df} dof), vs unpenalised {vs_plain:.1f}")
    assert df >= 3
    assert vs_p < df + 4 * (2 * df) ** 0.5 + 10  # far inside the tail for these dof
    assert vs_plain > 10 * (df + 10)


def test_load_policy_caps_greedy_drafts_only() -> None:
    from smallem_cli import defaults
    from smallem_cli.engine.scheduler import load_k

    assert load_k(4, True, 2, True, "draft-2l") == 4 and load_k(4, True, 3, True, "draft-2l") == 0
    assert load_k(4, True, 2, True, "mtp") == 4 and load_k(4, True, 3, True, "ngram+mtp") == 0
    assert load_k(4, False, 64, True, "draft-2l") == 4  # sampled: the seed alone decides the text
    assert load_k(4, True, 64, False, "draft-2l") == 4  # a k the user gave is kept
    assert defaults.load_cap("ngram", 64) == defaults.MAX_K


@pytest.mark.parametrize("proposer", ["near", "mtp"])
def test_load_policy_guesses_only_in_a_small_batch(models, proposer: str) -> None:
    """With the policy on (auto k), a draft or the MTP module guesses nothing while more than 2 sequences run
    (rounds of 0 guesses), 4 once fewer are left (the requests end one by one); tokens stay the target's."""
    reqs = [Request(i, i, tuple(p), 8 + 6 * i) for i, p in enumerate(prompts(12, 64, seed=9))]
    eng = engine(models, proposer, 4, max_batch=12)
    eng.auto_k = True
    got = {f.request.index: f for f in eng.run(reqs)}
    for r in reqs:
        assert got[r.index].tokens == generate(models["target"], NONE, list(r.prompt), r.max_new_tokens, 0)[0]
    by_depth = [sum(f.stats["rounds_by_guesses"][m] for f in got.values()) for m in range(5)]  # type: ignore[index]
    assert by_depth[0] > 0 and by_depth[4] > 0 and sum(by_depth[1:4]) == 0, by_depth


@pytest.mark.parametrize("where", ["prefill", "round"])
def test_non_finite_logits_stop_the_run(models, where: str) -> None:
    """NaN logits raise the loop's NonFiniteError (one line in `smallem batch`), never an answer."""
    import copy

    from smallem_cli.spec.sampling import NonFiniteError

    bad = copy.deepcopy(models["target"])
    eng = engine({**models, "target": bad}, "none", 0, max_batch=2)
    if where == "prefill":
        bad.head_t = torch.full_like(bad.head_t, float("nan"))
        bad.head_rows = torch.full_like(bad.head_rows, float("nan"))  # the same head, for a few rows
    else:  # the prefill's logits are finite, the first round's are not
        real, calls = bad.logits, []

        def logits(h: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return real(h) if len(calls) == 1 else real(h) * float("nan")

        bad.logits = logits  # type: ignore[method-assign]
    with pytest.raises(NonFiniteError):
        list(eng.run([Request(0, 0, tuple(PROMPT), 10)]))


def test_stop_strings_cut_as_generate_cuts_them(models) -> None:
    """A stop string that begins earlier but completes later than another wins, whatever the rounds:
    the answer is the whole text cut before its earliest stop string (`stops.StopPrinter`'s rule)."""
    from smallem_cli.engine.stops import stop_index

    ref, _ = generate(models["target"], NONE, PROMPT, N, 0)
    full, words = decode(ref), decode(ref).split(" ")
    stops = (" ".join(words[30:33]), words[31])  # the short one completes first, the long one begins first
    for kind in ("near", "mtp", "none"):
        eng = engine(models, kind, 0 if kind == "none" else 3, max_batch=2)
        (fin,) = eng.run([Request(0, 0, tuple(PROMPT), N, stop=stops)])
        at = stop_index(full, stops)
        assert at is not None and fin.text == full[:at], kind
        assert all(s not in fin.text for s in stops) and fin.tokens == ref[: len(fin.tokens)]
