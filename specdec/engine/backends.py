"""The seams between the scheduler and the models: what a target and a draft backend must do.

The scheduler (`specdec.engine.scheduler`) runs the algorithm once; backends only move its inputs and
outputs. In process they are `engine.LocalTarget`/`LocalDraft` over the core's pools; on Ray,
`actors.coordinator` sends the same calls to the target shards and the draft worker. Calls are
submitted and then waited on (`submit_*` returns a zero-argument function giving the results), so a
remote draft can pre-draft while the target verifies. Each result list has one slot per row: the
row's result, or the exception that failed that row alone (`TargetResult`, `DraftResult`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, Union

import torch

from specdec.decoding.proposers import Proposal
from specdec.decoding.verify import VerifyResult
from specdec.engine.pools import AdmitRow, DraftRow, ForwardReply, PrefixUsage, TargetRow

#: One row of a verify forward: the target's argmax ids `[num_logits]` (a row that asked for
#: `TargetRow.argmax_only`), the proposal's `VerifyResult` (a row with `TargetRow.verify`), or its
#: float32 logits `[num_logits, vocab]` (prompt log-probabilities).
TargetOutput = Union[list[int], VerifyResult, torch.Tensor]
#: One row's slot of a batched target call: its output, or the exception that failed it alone.
TargetResult = Union[TargetOutput, Exception]
#: One row's slot of a batched draft call: its proposal, or the exception that failed it alone.
DraftResult = Union[Proposal, Exception]


@dataclass(frozen=True)
class DraftCapabilities:
    """What a draft backend can do, declared once instead of probed with `getattr`."""

    #: It runs beside the target (a process of its own): pre-drafting overlaps the verify.
    concurrent: bool = False
    #: Pre-draft by default (a request may say otherwise); only meaningful when `concurrent`.
    pipeline: bool = False
    #: Each proposed token costs a draft forward (a draft model); False: a model-free lookup paid
    #: once per step whatever K (n-gram).
    per_token: bool = True


class TargetBackend(Protocol):
    def admit(self, rows: Sequence[AdmitRow]) -> list[int]:
        """Make each entering request's cache from the longest cached prefix of its prompt; per row
        the prompt tokens it holds (every shard the same)."""

    def fit(self, room: int) -> PrefixUsage:
        """Evict cached prefixes down to `room` bytes (over every shard); what they hold then."""

    def submit_forward(self, rows: Sequence[TargetRow]) -> Callable[[], ForwardReply]:
        """One batched forward; per row its `TargetOutput` (or the exception that failed it) and its
        cache length on each shard. Each row's cache first drops what its last step rejected (to
        `expected_length`): there is no rewind call."""

    def release(self, request_ids: Sequence[str]) -> None:
        """Free these requests' caches."""


class DraftBackend(Protocol):
    capabilities: DraftCapabilities

    def submit_propose(self, rows: Sequence[DraftRow]) -> Callable[[], list[DraftResult]]:
        """One batched proposal; per row a `Proposal` or the exception that failed it."""

    def fit(self, room: int) -> PrefixUsage:
        """Evict the draft's cached prefixes down to `room` bytes."""

    def release(self, request_ids: Sequence[str]) -> None:
        """Free these requests' draft states."""
