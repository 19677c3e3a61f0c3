"""Speculation statistics of one request (and sums over many), and a token's log-probabilities: what a
response reports, in plain dataclasses (no torch: the HTTP router imports them).

Counts follow vLLM's spec-decode metrics, so the same PromQL reads both:
- num_drafts: verification steps that had at least one proposed token;
- num_draft_tokens: proposed tokens; num_accepted_tokens: of those, accepted;
- acceptance_rate = num_accepted_tokens / num_draft_tokens;
- token_acceptance_rate: Leviathan's alpha (per-token, over the positions the target judged: a
  proposal's tokens after its first rejection were never judged), the alpha of the speedup formula;
- mean_accepted_length = 1 + num_accepted_tokens / num_drafts: tokens a draft step emits, counting
  its recovered or bonus token (vLLM's "mean acceptance length");
- accepted_per_position[i]: steps whose proposal position i was accepted; proposed_per_position[i]:
  steps that proposed a position i (differs from num_drafts when K varies: k=auto, n-gram misses);
- target_forwards: target forward passes after the prompt's prefill (one per step), so
  completion_tokens / target_forwards is tokens per target forward (1.0 for plain decoding).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one emitted token, and of the most likely alternatives
    (their texts are filled in when the token is committed: `RequestState.commit`)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), most likely first
    token: str = ""  # the emitted token's text, decoded alone
    top_tokens: tuple[str, ...] = ()  # [len(top)] the alternatives' texts


@dataclass
class SpeculativeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_full_accepts: int = 0  # draft steps whose whole proposal was accepted (the bonus token was used)
    accepted_per_position: list[int] = field(default_factory=list)
    proposed_per_position: list[int] = field(default_factory=list)
    target_forwards: int = 0
    draft_forwards: int = 0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    # Ray engine only: pre-drafted blocks used (hits) or thrown away (misses), and draft failures.
    pipeline_hits: int = 0
    pipeline_misses: int = 0
    draft_failures: int = 0

    def record_step(self, num_proposed: int, num_accepted: int) -> None:
        """Count one verification step (the target forward is counted by the caller)."""
        if num_proposed == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        self.num_full_accepts += num_accepted == num_proposed
        grow = num_proposed - len(self.proposed_per_position)
        if grow > 0:
            self.proposed_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(num_proposed):
            self.proposed_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def token_acceptance_rate(self) -> float:
        """Leviathan's alpha: the per-token acceptance probability under the i.i.d. model, estimated
        over the positions the target judged (accepted ones plus each step's first rejection)."""
        judged = self.num_accepted_tokens + self.num_drafts - self.num_full_accepts
        return self.num_accepted_tokens / judged if judged else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def merge(self, other: "SpeculativeStats") -> None:
        """Add another request's counts to these."""
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_full_accepts", "target_forwards",
                     "draft_forwards", "draft_seconds", "target_seconds", "pipeline_hits", "pipeline_misses",
                     "draft_failures"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.accepted_per_position, other.accepted_per_position),
                             (self.proposed_per_position, other.proposed_per_position)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "token_acceptance_rate": round(self.token_acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "proposed_per_position": list(self.proposed_per_position),
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "draft_seconds": round(self.draft_seconds, 4),
            "target_seconds": round(self.target_seconds, 4),
            "pipeline_hits": self.pipeline_hits,
            "pipeline_misses": self.pipeline_misses,
            "draft_failures": self.draft_failures,
        }
