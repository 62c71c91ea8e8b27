"""The suffix lookup (`spec.suffix`): draft tokens copied from the texts this process wrote before, bounded in tokens
(the oldest evicted), the longest match first; through the engine, a repeated workload's second pass drafts whole
answers, every greedy text stays the target's alone, a batch line may be a conversation, and a server shares the
texts only when told."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import Family
from test_batch_cli import answers, batch
from test_bench_prompts import hf_dir  # noqa: F401  (a fixture)

from smallem_cli.engine.build import build
from smallem_cli.engine.config import EngineConfig
from smallem_cli.engine.family import load_proposer, load_target
from smallem_cli.engine.request import Request
from smallem_cli.spec.suffix import ANCHOR, SURE, SuffixCache, SuffixLookup


def test_the_longest_match_is_copied() -> None:
    cache = SuffixCache(100)
    cache.add([1, 2, 3, 4, 5, 6, 7])
    cache.add([9, 2, 3, 4, 5, 8, 8])  # the latest text with the anchor 2 3 4 5, matching one token less
    assert cache.match([0, 1, 2, 3, 4, 5], 3) == (5, [6, 7])  # the longer match wins, its text's end stops it
    assert cache.match([7, 7, 2, 3, 4, 5], 3) == (ANCHOR, [8, 8])  # equals: the latest
    assert cache.match([2, 3, 4], 3) == (0, [])  # shorter than the anchor
    assert cache.match([5, 5, 5, 5], 3) == (0, [])  # never seen


def test_the_oldest_texts_are_evicted_with_their_anchors() -> None:
    cache = SuffixCache(10)
    cache.add([1, 2, 3, 4, 5, 6])
    tid = cache.add([7, 8, 9])
    cache.extend(tid, [10, 11])  # 11 tokens in all: the first text goes
    assert cache.size == 5 and list(cache.texts.values()) == [[7, 8, 9, 10, 11]]
    assert cache.match([1, 2, 3, 4], 2) == (0, []) and all(7 in key for key in cache.at)
    assert cache.match([7, 8, 9, 10], 2) == (4, [11])  # an anchor indexed as the text grew
    cache.add(list(range(100, 130)))  # longer than the bound: its last 10 tokens kept, alone
    assert cache.size == 10 and list(cache.texts.values()) == [list(range(120, 130))]
    with pytest.raises(ValueError, match="at least one token"):
        SuffixCache(0)


def test_a_lookup_takes_the_longer_of_its_text_and_the_cache() -> None:
    cache = SuffixCache(100)
    cache.add([1, 2, 3, 4, 5, 6, 7, 8])
    lookup = SuffixLookup(cache, 300, 2, 4)
    lookup.start(torch.tensor([9, 9, 9, 1, 2, 3, 4]), torch.tensor([5]))
    assert lookup.find(3) == [6, 7, 8]  # its own text has no 2-gram ending in `4 5` before: the cache's
    lookup = SuffixLookup(SuffixCache(100), 300, 2, 4)
    lookup.start(torch.tensor([4, 5, 6, 4]), torch.tensor([5]))
    assert lookup.find(2) == [6, 4]  # an empty cache: the n-gram lookup's own


def test_a_repeat_is_drafted_as_deep_as_its_match() -> None:
    """A match of SURE tokens or more is a repeat: its continuation offered as deep as the match (at most k), whatever
    the acceptance so far; a shorter one is the n-gram lookup's, as deep as its measured acceptance is worth."""
    past = list(range(1000, 1100))
    for matched in (SURE, SURE + 7, 60):
        cache = SuffixCache(1000)
        cache.add(past)
        lookup = SuffixLookup(cache, 2000, 2, 4, draft_cost=0.5)
        lookup.start(torch.tensor([5, *past[: matched - 1]]), torch.tensor([past[matched - 1]]))
        assert lookup.find(32) == past[matched : matched + 32]
        assert lookup.depth(32) == min(32, matched) and lookup.depth(8) == 8
    cache = SuffixCache(1000)
    cache.add(past)
    lookup = SuffixLookup(cache, 2000, 2, 4, draft_cost=0.5)
    lookup.start(torch.tensor([5, *past[: SURE - 2]]), torch.tensor([past[SURE - 2]]))  # one token short of a repeat
    assert lookup.find(32) == past[SURE - 1 : SURE + 31] and lookup.depth(32) == lookup.depth(5) < SURE


def run_twice(family: Family, prompts: list[str], shared: bool, n: int = 24) -> list:
    """Each prompt twice, one at a time, through one engine with the suffix lookup -> the answers."""
    tgt = load_target(family.target, "cpu")
    p = load_proposer("suffix", tgt, tgt.model.device)
    eng = build(EngineConfig(tgt.model, p, k=8, max_batch=1, suffix_shared=shared))
    reqs = [Request(i, i, tuple(tgt.tok.encode(text).ids), n) for i, text in enumerate(prompts * 2)]
    return sorted(eng.run(reqs), key=lambda f: f.request.index)


def test_a_repeated_workload_drafts_its_answers(family: Family) -> None:
    """The second pass over the same prompts: the target alone's tokens, nearly every draft token accepted, several
    tokens a pass; without sharing (a server's default) the second pass drafts from its own text alone."""
    prompts = ["In the beginning God", "And the LORD said unto"]
    tgt = load_target(family.target, "cpu")
    alone = build(EngineConfig(tgt.model, max_batch=1))
    reqs = [Request(i, i, tuple(tgt.tok.encode(t).ids), 24) for i, t in enumerate(prompts)]
    ref = [f.tokens for f in alone.run(reqs)]
    shared = run_twice(family, prompts, shared=True)
    assert [f.tokens for f in shared] == ref * 2
    second = [f.stats for f in shared[len(prompts) :]]
    assert all(st["tokens_per_pass"] >= 4 for st in second), second
    apart = run_twice(family, prompts, shared=False)
    assert [f.tokens for f in apart] == ref * 2
    assert sum(f.stats["target_passes"] for f in apart[2:]) > sum(st["target_passes"] for st in second)


def test_suffix_before_a_draft_keeps_the_greedy_text(family: Family) -> None:
    out = {p: answers(batch(family, "-q", "-n", "16", "--proposer", p, input="In the beginning\nAnd God said\n"))
           for p in ("none", "suffix", "suffix+draft-2l")}  # fmt: skip
    assert out["suffix"] == [a | {"stats": b["stats"]} for a, b in zip(out["none"], out["suffix"], strict=True)]
    assert [a["tokens"] for a in out["suffix+draft-2l"]] == [a["tokens"] for a in out["none"]]
    assert {a["stats"]["proposer"] for a in out["suffix+draft-2l"]} == {"suffix+draft-2l"}


def test_a_batch_line_may_be_a_conversation(family: Family, hf_dir) -> None:  # noqa: F811
    """ "messages" through the target's chat template, as `generate --chat` renders them; refused where the target
    has none."""
    from typer.testing import CliRunner

    from smallem_cli.cli.app import app

    line = json.dumps({"id": "m", "messages": [{"role": "user", "content": "In the beginning"}]})
    got = answers(CliRunner().invoke(app, ["batch", "-q", "-n", "6", "--target", str(hf_dir)], input=line + "\n"))
    ref = CliRunner().invoke(
        app, ["generate", "In the beginning", "--chat", "-n", "6", "--target", str(hf_dir), "--json"]
    )
    assert ref.exit_code == 0, ref.output
    assert got[0]["id"] == "m" and got[0]["tokens"] == json.loads(ref.stdout)["tokens"]
    plain = answers(batch(family, "-q", "-n", "4", input=line + "\n"))  # the shipped family's: no template
    assert plain == [{"id": "m", "error": plain[0]["error"]}] and "no chat template" in plain[0]["error"]
