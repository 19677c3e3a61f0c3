"""The core scheduler's target and draft seams (`specdec.engine.backends`) over Ray actors.

They only move the scheduler's calls: a batched forward or rewind to every target shard of the
supervised group (each call is submitted to every shard before any is awaited, so all shards run
the same calls in the same order; rank 0 answers), a batched proposal to the separate draft worker
or to the rank-0 shard that hosts a colocated draft.
"""

from __future__ import annotations

from collections.abc import Sequence

import ray

from actors.groups import TargetGroupSupervisor, TargetShardError
from specdec.engine.backends import DraftCapabilities
from specdec.engine.pools import AdmitRow, DraftRow, ForwardReply, PrefixUsage, TargetRow, as_delta


class RemoteTarget:
    """The scheduler's target calls, sent to every shard of the supervised group (rank 0 answers)."""

    def __init__(self, group: TargetGroupSupervisor) -> None:
        self.group = group

    def admit(self, rows: Sequence[AdmitRow]) -> list[int]:
        """Every shard makes the same caches (same history, same lookups); they must agree."""
        per_shard = self.group.gather([s.admit.remote(rows) for s in self.group.shards()])
        if any(lengths != per_shard[0] for lengths in per_shard):
            self.group.drop(f"prefix cache hits differ between shards: {per_shard}")
            raise TargetShardError(f"target shards disagree on cached prefixes ({per_shard}); the shard group is "
                                   "rebuilt")
        return per_shard[0]

    def fit(self, room: int) -> PrefixUsage:
        """Each shard holds its heads' share of every entry: `room` is split evenly."""
        shards = self.group.shards()
        usages = self.group.gather([s.fit.remote(room // len(shards)) for s in shards])
        return PrefixUsage(sum(u.bytes for u in usages), usages[0].evictions)

    def submit_forward(self, rows: Sequence[TargetRow]):
        """Every shard runs the forward; rank 0's results, each row's cache length on every shard
        (they must agree: a shard that lost a request's state breaks the group, rebuilt)."""
        refs = [s.forward.remote(rows) for s in self.group.shards()]

        def wait() -> ForwardReply:
            replies = self.group.gather(refs)
            per_row = [[r.cache_lengths[i][0] for r in replies] for i in range(len(rows))]
            for row, lengths in zip(rows, per_row):
                if any(n != lengths[0] for n in lengths):
                    self.group.drop(f"cache lengths {lengths} for {row.request_id} (expected {row.expected_length})")
                    raise TargetShardError(f"target shards disagree on a cache: lengths {lengths}, expected "
                                           f"{row.expected_length}; the shard group is rebuilt")
            return ForwardReply(replies[0].results, per_row)

        return wait

    def release(self, request_ids: Sequence[str]) -> None:
        if self.group.group is not None:
            for s in self.group.group.shards:
                s.release.remote(request_ids)


class RemoteDraft:
    """The scheduler's draft calls: the separate draft worker (`worker`), or the rank-0 shard that
    hosts the draft (colocated: `worker` None)."""

    def __init__(self, worker, group: TargetGroupSupervisor, pipeline: bool, per_token: bool) -> None:
        self.worker, self.group = worker, group
        self.sent: dict[str, list[int]] = {}  # request id -> the context last sent (rows go as deltas)
        self.capabilities = DraftCapabilities(
            concurrent=worker is not None,  # its own process: pre-drafting overlaps the verify
            pipeline=pipeline, per_token=per_token)

    def fit(self, room: int) -> PrefixUsage:
        if self.worker is not None:
            return ray.get(self.worker.fit.remote(room))
        return ray.get(self.group.shards()[0].fit_draft.remote(room))

    def submit_propose(self, rows: Sequence[DraftRow]):
        """The rows go as deltas: each context past what it shares with the one last sent for its
        request (the draft keeps the rest). A failed call forgets what was sent: a restarted draft
        worker knows nothing, so the next rows go whole."""
        actor = self.worker if self.worker is not None else self.group.shards()[0]
        deltas = [as_delta(row, self.sent.get(row.request_id)) for row in rows]
        for row in rows:
            self.sent[row.request_id] = row.context_token_ids
        ref = actor.propose.remote(deltas)

        def wait():
            try:
                return ray.get(ref)
            except Exception:
                self.sent.clear()
                raise

        return wait

    def release(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self.sent.pop(request_id, None)
        if self.worker is not None:
            self.worker.release.remote(request_ids)
