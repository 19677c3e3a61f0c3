"""One speculative step's working state (`Step`) and what it did for each request (`StepInfo`).

The scheduler (`specdec.engine.scheduler`) fills a `Step` phase by phase (propose, verify, commit and
rewind, pre-draft) and hands it once to its observer, which gives each request its `StepInfo`
(stats, K policy, metrics). Vocabulary as in vLLM's rejection sampler: of a row's K proposed tokens
some are accepted; the first rejected one is replaced by a recovered token, or a bonus token follows
a wholly accepted proposal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdec.engine.pools import TargetRow
from specdec.decoding.proposers import Proposal
from specdec.engine.request_state import StreamChunk

if TYPE_CHECKING:
    from specdec.engine.scheduler import ScheduledRequest


@dataclass
class StepInfo:
    """What one verify step did for one request (for metrics; the request's stats get the same numbers)."""

    k: int  # draft tokens asked for (after clamping)
    num_proposed: int
    num_accepted: int
    num_committed: int
    verify_seconds: float
    draft_seconds: float | None = None  # None: no drafting call for this row this step
    pipeline_hit: bool | None = None  # None: nothing was pre-drafted for this row this step
    draft_failures: int = 0
    target_rewound_tokens: int = 0
    target_cache_tokens: int | None = None
    draft_rewound_tokens: int = 0
    draft_cache_tokens: int | None = None


@dataclass
class Step:
    """One step's working state, filled phase by phase (rows are indexed like `batch`)."""

    batch: list[ScheduledRequest]
    ks: list[int]  # [num_rows] K asked of each row (0: target-only this step)
    started: float
    # [num_rows] a pinned row's longest proposal (its budget share); None: the row shares `room`.
    reach: list[int | None] = field(default_factory=list)
    room: int = 0  # verify tokens left in the budget for the unpinned rows' prompt-lookup matches
    proposals: list[Proposal] = field(default_factory=list)  # [num_rows]
    drafted: list[bool] = field(default_factory=list)  # [num_rows] a draft call proposed it this step
    failures_before: list[int] = field(default_factory=list)  # [num_rows] draft failures before the step
    draft_seconds: float | None = None
    rows: list[TargetRow] = field(default_factory=list)  # [num_rows] the verify forward's rows
    verify_started: float = 0.0
    verified: float = 0.0
    finished: float = 0.0
    results: list = field(default_factory=list)  # [num_rows] verify.VerifyResult (None: the row failed)
    keep: list[int] = field(default_factory=list)  # rows that verified
    chunks: dict[int, StreamChunk] = field(default_factory=dict)
    cache_lengths: dict[int, list[int]] = field(default_factory=dict)  # row -> target cache length per shard
    early_rows: list[int] = field(default_factory=list)  # rows pre-drafting their next block
    wait_pre_draft: Callable[[], list] | None = None
    pre_drafts: dict[int, tuple[bool, Proposal | None]] = field(default_factory=dict)  # row -> (hit, block)

    def __post_init__(self) -> None:
        n = len(self.batch)
        self.proposals = [Proposal([]) for _ in range(n)]
        self.drafted = [False] * n
        self.results = [None] * n
        self.failures_before = [item.seq.stats.draft_failures for item in self.batch]
        self.reach = self.reach or [None] * n

    def info(self, i: int, verify_seconds: float, draft_failures_now: int) -> StepInfo:
        """Row i's numbers for stats and metrics."""
        p, chunk = self.proposals[i], self.chunks[i]
        info = StepInfo(k=self.ks[i], num_proposed=len(p), num_accepted=self.results[i].num_accepted,
                        num_committed=len(chunk.token_ids), verify_seconds=verify_seconds,
                        draft_seconds=self.draft_seconds if self.drafted[i] else None,
                        draft_failures=draft_failures_now - self.failures_before[i])
        if i in self.cache_lengths:
            info.target_cache_tokens = self.cache_lengths[i][0]
            info.target_rewound_tokens = (len(self.rows[i].token_ids) + self.rows[i].expected_length
                                          - info.target_cache_tokens)
        if self.drafted[i]:
            info.draft_rewound_tokens, info.draft_cache_tokens = p.rewound_tokens, p.cache_tokens
        if i in self.pre_drafts:
            hit, block = self.pre_drafts[i]
            info.pipeline_hit = hit
            if hit and block is not None:
                info.draft_rewound_tokens += block.rewound_tokens
                info.draft_cache_tokens = block.cache_tokens
        return info
