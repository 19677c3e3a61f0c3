"""What the scheduler holds per request (`ScheduledRequest`), one step's working state (`Step`) and
what a step did for each request (`StepInfo`), with the step's plan (`plan_step`).

The scheduler (`specdec.engine.scheduler`) plans a `Step` within the token budget, fills it phase
by phase (propose, verify, commit and rewind, pre-draft) and hands it once to its observer, which
gives each request its `StepInfo` (stats, K policy, metrics). Vocabulary as in vLLM's rejection
sampler: of a row's K proposed tokens some are accepted; the first rejected one is replaced by a
recovered token, or a bonus token follows a wholly accepted proposal.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from specdec.decoding.proposers import Proposal
from specdec.decoding.speculation_length import KPolicy
from specdec.decoding.verify import VerifyResult
from specdec.engine.backends import DraftResult
from specdec.engine.pools import TargetRow
from specdec.engine.request import GenerationRequest
from specdec.engine.request_state import RequestState, StreamChunk


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


class RequestObserver(Protocol):
    """What happens to one request, as the scheduler's thread sees it (the Ray engine's metrics)."""

    def started(self) -> None:
        """Admitted into the batch: its prefill begins."""

    def prefilled(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """Its prompt is in the target's cache; `num_cached_tokens` of it came from the prefix cache."""

    def step(self, info: StepInfo) -> None:
        """One verify step's numbers."""


@dataclass
class ScheduledRequest:
    """A request the scheduler holds: its state, K policy, and where its output goes."""

    request: GenerationRequest
    state: RequestState
    policy: KPolicy
    sink: Callable[[object], None]  # receives StreamChunk objects, then None (done) or an exception
    pipeline: bool
    deadline: float | None
    prefilled: int = 0  # prompt tokens in the target cache so far
    draft_ok: bool = True
    pending: Proposal | None = None  # a pre-drafted block for the next step
    cancelled: bool = False
    # Its K must not depend on batch-mates (a seeded residual request): `plan_step` lets it sit a
    # step out rather than trim its K to the step's token budget.
    pinned: bool = False
    waited: int = 0  # steps sat out in a row for the token budget (they go first next step)
    observer: RequestObserver | None = None
    limit: int | None = None  # the most tokens its caches may hold (prompt + max_tokens + a verify pass)
    reserved: int = 0  # its KV reservation in bytes (`budget.KVBudget`), held while it is in the batch
    admitted: bool = False  # in the batch (prefilling or running): its reservation counts
    reuse: bool = True  # may start from a cached prefix (not with prompt_logprobs: those need the prefill)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prefill_target(self) -> int:
        return len(self.state.token_ids) - 1  # all but the last prompt token


@dataclass
class Step:
    """One step's working state, filled phase by phase (rows are indexed like `batch`)."""

    batch: list[ScheduledRequest]
    ks: list[int]  # [num_rows] K asked of each row (0: target-only this step)
    started: float
    # [num_rows] a pinned row's longest proposal, reserved in the budget; None: the row shares
    # `spare_tokens` with the other unpinned rows.
    pinned_max_tokens: list[int | None] = field(default_factory=list)
    spare_tokens: int = 0  # verify tokens left in the budget for the unpinned rows' prompt-lookup matches
    proposals: list[Proposal] = field(default_factory=list)  # [num_rows]
    drafted: list[bool] = field(default_factory=list)  # [num_rows] a draft call proposed it this step
    failures_before: list[int] = field(default_factory=list)  # [num_rows] draft failures before the step
    draft_seconds: float | None = None
    rows: list[TargetRow] = field(default_factory=list)  # [num_rows] the verify forward's rows
    verify_started: float = 0.0
    verified: float = 0.0
    finished: float = 0.0
    results: list[VerifyResult | None] = field(default_factory=list)  # [num_rows] None: the row failed
    verified_rows: list[int] = field(default_factory=list)  # rows whose verification succeeded
    chunks: dict[int, StreamChunk] = field(default_factory=dict)
    # row -> its target cache length on each shard when this step's forward began (the committed
    # length before the step, minus one: what the last step rejected was dropped first)
    cache_lengths: dict[int, list[int]] = field(default_factory=dict)
    pre_drafting_rows: list[int] = field(default_factory=list)  # rows drafting their next block during the verify
    wait_pre_draft: Callable[[], list[DraftResult]] | None = None
    pre_drafts: dict[int, tuple[bool, Proposal | None]] = field(default_factory=dict)  # row -> (hit, block)

    def __post_init__(self) -> None:
        n = len(self.batch)
        self.proposals = [Proposal([]) for _ in range(n)]
        self.drafted = [False] * n
        self.results = [None] * n
        self.failures_before = [item.state.stats.draft_failures for item in self.batch]
        self.pinned_max_tokens = self.pinned_max_tokens or [None] * n

    def info(self, i: int, verify_seconds: float, draft_failures_now: int) -> StepInfo:
        """Row i's numbers for stats and metrics."""
        p, chunk = self.proposals[i], self.chunks[i]
        info = StepInfo(k=self.ks[i], num_proposed=len(p), num_accepted=self.results[i].num_accepted,
                        num_committed=len(chunk.token_ids), verify_seconds=verify_seconds,
                        draft_seconds=self.draft_seconds if self.drafted[i] else None,
                        draft_failures=draft_failures_now - self.failures_before[i])
        if not self.batch[i].state.finished:  # its cache keeps all it committed but the last (the next input)
            info.target_cache_tokens = len(self.batch[i].state.token_ids) - 1
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


def plan_step(running: list[ScheduledRequest], ks: list[int], max_batch_tokens: int,
              lookup_tokens: Callable[[ScheduledRequest], int] | None) -> Step:
    """The step's rows and their K within the token budget (`max_batch_tokens` verify tokens).

    A pinned row (`ScheduledRequest.pinned`) takes its K whole, plus room for the longest proposal
    it may get (a prompt-lookup match: `lookup_tokens(row)`, when prompt lookup is on), or sits this
    step out; rows that sat out go first next step, so none waits more than a step or two (a pinned
    row whose K is over the whole budget steps alone). The others share what is left: each at least
    one token, then the largest K shrinks first."""
    ks = list(ks)
    reserved = list(ks)  # the longest proposal a row may get
    for i, item in enumerate(running):
        if item.pinned and ks[i]:
            reserved[i] = max(ks[i], lookup_tokens(item) if lookup_tokens is not None else ks[i])
    left, rows = max_batch_tokens, []
    for i in sorted(range(len(running)), key=lambda i: -running[i].waited):
        need = reserved[i] + 1 if running[i].pinned else 1
        if need <= left or not rows:  # a row that needs more than the whole budget steps alone
            rows.append(i)
            left -= need
    for i, item in enumerate(running):
        item.waited = 0 if i in rows else item.waited + 1
    rows.sort()
    free = [i for i in rows if not running[i].pinned]
    left = max(left, 0) + len(free)
    while sum(ks[i] + 1 for i in free) > left and any(ks[i] for i in free):
        ks[max(free, key=lambda i: ks[i])] -= 1
    return Step([running[i] for i in rows], [ks[i] for i in rows], started=time.perf_counter(),
                pinned_max_tokens=[reserved[i] if running[i].pinned else None for i in rows],
                spare_tokens=max(0, left - sum(ks[i] + 1 for i in free)))


def pre_drafted_block(early: Proposal) -> Proposal:
    """The next step's proposal from a block pre-drafted after [proposal]: its first token guessed
    the bonus token (and was right), the rest follow it, each with the q row it was drawn from."""
    return Proposal(early.token_ids[1:], early.probs[1:] if early.probs is not None else None)


def truncated(proposal: Proposal, k: int) -> Proposal:
    """The first `k` tokens of a proposal (a pre-drafted block longer than this step's K)."""
    if len(proposal) <= k:
        return proposal
    probs = proposal.probs[:k] if proposal.probs is not None else None
    return Proposal(proposal.token_ids[:k], probs)
