"""The speculative loop: prefill, then rounds of propose -> verify pass -> verify -> roll back.

    prefill      the prompt goes through the target (and the proposer); the target's last
                 logits give the first new token, `last`.
    round        the proposer guesses d_1..d_k; one target pass reads [last, d_1..d_k]
                 and scores k+1 positions; verification keeps n guesses and adds one
                 token of the target's; both caches roll back to what was kept.

The target's cache always holds every token but `last`. One host sync per round: the
verdict (n and the emitted tokens) comes back to decide the rollback.

Every sampling option changes the target's distribution before verification, so the
output stays exact for it: greedy, the target alone's with the same options; sampled,
distributed as the target alone's. A repetition penalty reshapes the target's logits at
each position of a pass by the context up to that position (`verify.penalize`); the
proposer guesses without it (its guesses are only checked), which costs acceptance, never
exactness.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .cache import PagedKVCache
from .defaults import PAGE_SIZE
from .model import Transformer
from .proposers import Proposer, Warp
from .verify import Warper, greedy_pick, penalize, sample, verify_greedy, verify_sample


@dataclass(frozen=True)
class Sampling:
    """The options a generation samples with. Pure values: a batch engine applies them per request."""

    temperature: float = 0.0  # 0 means greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    min_p: float | None = None  # after temperature: drop tokens below min_p x the top probability
    repetition_penalty: float = 1.0  # CTRL's: a token of the context has its logit scaled down; 1 is off

    @property
    def greedy(self) -> bool:
        """Greedy decoding (temperature 0): top-k, top-p and min-p then change nothing, the penalty does."""
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0

    def warp(self) -> Warp | None:
        """logits -> the distribution target and proposer both draw from; None when greedy."""
        if self.greedy:
            return None
        return Warper(self.temperature, self.top_k, self.top_p, self.min_p)


@dataclass
class Stats:
    proposer: str
    k: int
    new_tokens: int = 0
    passes: int = 0  # target passes that yielded tokens: the prefill, then one per round
    proposed: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # rounds whose i-th guess was kept
    # rounds by how many guesses they checked (index 0..k): a fixed-k proposer fills index k
    # alone; an n-gram lookup or an adaptive depth (`p_min`) proposes fewer when unsure
    guessed: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    elapsed_s: float = 0.0  # prefill included

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.new_tokens / max(1, self.passes)

    def as_dict(self) -> dict[str, object]:
        return {
            "proposer": self.proposer,
            "k": self.k,
            "new_tokens": self.new_tokens,
            "target_passes": self.passes,
            "tokens_per_s": round(self.tokens_per_s, 2),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_pass": round(self.tokens_per_pass, 3),
            "accepted_at": self.accepted_at,
            "rounds_by_guesses": self.guessed,
            "prefill_s": round(self.prefill_s, 4),
            "elapsed_s": round(self.elapsed_s, 4),
        }


def cache_pages(n_tokens: int, page_size: int = PAGE_SIZE) -> int:
    return -(-n_tokens // page_size) + 1


def prefill(
    target: Transformer, cache: PagedKVCache, seq: int, prompt: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt [P] through the target -> (logits of the last position [1, V], hidden [P, d])."""
    return target(prompt, cache, seq, last_only=True)


def context_mask(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The repetition penalty's context: bool [V], True for every token in tokens [P]."""
    return torch.zeros(vocab_size, dtype=torch.bool, device=tokens.device).index_fill_(0, tokens, True)


def first_token(
    raw: torch.Tensor, prompt: torch.Tensor, w: Warp | None, gen: torch.Generator | None, penalty: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The prefill's last logits raw [1, V] -> (the first new token [1], the penalty's context:
    bool [V] over the prompt and that token, None without a penalty). No host sync."""
    if penalty == 1.0:
        return (greedy_pick(raw) if w is None else sample(w(raw), gen)), None
    seen = context_mask(prompt, raw.shape[-1])
    logits = penalize(raw, seen, prompt[-1:], penalty)
    last = greedy_pick(logits) if w is None else sample(w(logits), gen)
    return last, seen.index_fill_(0, last.view(-1), True)


class NonFiniteError(RuntimeError):
    """The target's logits hold NaN or inf: broken weights or an overflow, never a silent answer."""


def speculative_step(
    target: Transformer,
    cache: PagedKVCache,
    seq: int,
    proposer: Proposer,
    last: torch.Tensor,
    k: int,
    w: Warp | None,
    generator: torch.Generator | None,
    seen: torch.Tensor | None = None,
    penalty: float = 1.0,
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One round, up to the verdict: -> (m, n [1], out [1, m+1], hidden [m+1, d], finite [1]).

    The proposer offers m <= k guesses (m is a shape, known without a sync: a proposer
    that is unsure may offer fewer, even none). `w` is the sampling warp (`Sampling.warp()`),
    None for greedy verification. `seen` (bool [V], the tokens before the pass) and `penalty`
    apply a repetition penalty to the target's logits (`penalize`): None, no penalty.
    `finite` says whether every logit of the pass was finite (NaN would make argmax and
    sampling pick token 0 without a word). No host sync here.
    """
    drafts, q = proposer.propose(k, w, generator)  # [m], [m, V] (None when greedy)
    m = drafts.shape[0]
    fed = torch.cat([last, drafts])  # [m+1]
    raw, hidden = target(fed, cache, seq)  # [m+1, V], [m+1, d]
    logits = raw if seen is None else penalize(raw, seen, fed, penalty)  # [m+1, V]
    if w is None:
        n, out = verify_greedy(drafts[None], logits[None])
    else:
        p = w(logits)
        assert q is not None or m == 0, "a proposer that guesses under sampling says from which q"
        q = q if q is not None else p[:0]
        n, out = verify_sample(drafts[None], q[None], p[None], generator)
    return m, n, out, hidden, raw.isfinite().all().view(1)


def _check_finite(ok: bool) -> None:
    if not ok:
        raise NonFiniteError("the target's logits are not finite (NaN or inf): its weights or settings are broken")


def stream(
    target: Transformer,
    proposer: Proposer,
    prompt: list[int],
    max_new_tokens: int,
    k: int,
    sampling: Sampling = Sampling(),
    stop_token: int | None = None,
    stats: Stats | None = None,
    page_size: int = PAGE_SIZE,
) -> Iterator[list[int]]:
    """Generate, yielding the tokens of each round as soon as they are verified.

    `stats` (if given) is updated in place, so it is valid even if the caller stops early
    (a stop string, say: see `stops`). The stop token ends generation and is not yielded.
    """
    if max_new_tokens < 1:
        return
    device = target.embed_tokens.weight.device
    st = stats if stats is not None else Stats(proposer.name, k)
    gen = torch.Generator(device=device).manual_seed(sampling.seed)
    cache = target.new_cache(cache_pages(len(prompt) + max_new_tokens + k + 1, page_size), page_size)
    seq = cache.new_sequence()
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            ids = torch.tensor(prompt, dtype=torch.long, device=device)
            raw, hidden = prefill(target, cache, seq, ids)
            w = sampling.warp()  # built once, used every round
            pen = sampling.repetition_penalty
            # seen: the repetition penalty's context, on the device: every token so far, `last` included
            last, seen = first_token(raw, ids, w, gen, pen)
            proposer.start(ids, last, hidden)
            first, finite = torch.stack([last.view(-1)[0], raw.isfinite().all().long()]).tolist()  # one sync
            _check_finite(finite == 1)
            st.prefill_s = time.perf_counter() - t0
            if first == stop_token:
                return
            st.new_tokens = st.passes = 1
            st.elapsed_s = time.perf_counter() - t0
            yield [first]
            st.accepted_at = [0] * k
            st.guessed = [0] * (k + 1)
            while st.new_tokens < max_new_tokens:
                m, n_t, out, hidden, finite = speculative_step(target, cache, seq, proposer, last, k, w, gen, seen, pen)
                verdict = torch.cat([n_t, out[0], finite.long()]).tolist()  # the round's one host sync
                _check_finite(verdict[-1] == 1)
                n = verdict[0]
                emitted = verdict[1 : n + 2]
                start = cache.length(seq) - (m + 1)
                cache.keep(seq, start + n + 1)  # rollback: [last, d_1..d_n] stay
                proposer.accept(n, out[0, : n + 1], hidden[: n + 1])
                last = out[0, n : n + 1]
                if seen is not None:
                    seen.index_fill_(0, out[0, : n + 1], True)  # on the device: no sync
                st.passes += 1
                st.proposed += m
                st.guessed[m] += 1
                st.accepted += n
                for i in range(n):
                    st.accepted_at[i] += 1
                stop = stop_token in emitted
                if stop:
                    emitted = emitted[: emitted.index(stop_token)]
                emitted = emitted[: max_new_tokens - st.new_tokens]  # a round may overshoot the limit
                st.new_tokens += len(emitted)
                st.elapsed_s = time.perf_counter() - t0
                if emitted:
                    yield emitted
                if stop:
                    return
    finally:
        proposer.release()
        cache.release(seq)


def generate(
    target: Transformer,
    proposer: Proposer,
    prompt: list[int],
    max_new_tokens: int,
    k: int,
    sampling: Sampling = Sampling(),
    stop_token: int | None = None,
) -> tuple[list[int], Stats]:
    """All new tokens at once, with their statistics."""
    stats = Stats(proposer.name, k)
    out: list[int] = []
    for chunk in stream(target, proposer, prompt, max_new_tokens, k, sampling, stop_token, stats):
        out.extend(chunk)
    return out, stats
