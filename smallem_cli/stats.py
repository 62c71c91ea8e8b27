"""A generation's counters: tokens, target passes, draft tokens verified and accepted, by depth."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class Stats:
    proposer: str
    k: int
    new_tokens: int = 0
    passes: int = 0  # target passes that yielded tokens: the prefill, then one per round
    end_token: int = 0  # 1 where the model's end token ended it: a pass yielded it, the text leaves it out
    proposed: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # rounds whose i-th draft token was accepted, i < k
    rounds_by_drafted: list[int] = field(default_factory=list)  # rounds by draft tokens verified, 0..k
    reused: int = 0  # prompt positions found in the cache: a conversation's earlier turns
    prefill_s: float = 0.0
    # a round's split, as the cost model reads it (on a GPU the proposer's work also lands in round_s, at the sync)
    propose_s: float = 0.0  # host seconds in the proposer's drafts
    round_s: float = 0.0  # seconds in decode rounds, drafts included
    elapsed_s: float = 0.0  # prefill included
    backend: str = "eager"  # what ran the passes (`Backend.label`): "eager" (PyTorch), a native build, "partly …"

    def __post_init__(self) -> None:
        self.accepted_at = self.accepted_at or [0] * self.k
        self.rounds_by_drafted = self.rounds_by_drafted or [0] * (self.k + 1)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return (self.new_tokens + self.end_token) / max(1, self.passes)

    def copy_from(self, other: Stats) -> None:
        """Take every counter of `other` (the engine's own); this one's proposer label stays (a path, say)."""
        for name in _COUNTERS:
            setattr(self, name, list(v) if isinstance(v := getattr(other, name), list) else v)

    def as_dict(self) -> dict[str, object]:
        return {
            "proposer": self.proposer,
            "k": self.k,
            "new_tokens": self.new_tokens,
            "target_passes": self.passes,
            "tokens_per_s": round(self.tokens_per_s, 2),
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_pass": round(self.tokens_per_pass, 3),
            "accepted_at": self.accepted_at,
            "rounds_by_guesses": self.rounds_by_drafted,  # the key as it was: scripts read it
            "prefill_s": round(self.prefill_s, 4),
            "elapsed_s": round(self.elapsed_s, 4),
            "backend": self.backend,
        }


_COUNTERS = tuple(f.name for f in fields(Stats) if f.name != "proposer")  # what `copy_from` takes, once
