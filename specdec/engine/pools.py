"""The per-request state of each model role, keyed by request id, with batched calls over many.

`TargetPool`: the target's KV caches; `forward(rows)` runs one batched forward over every row
(`ModelRunner.forward`) and returns per row the argmax ids (an `argmax_only` row) or the logits. `DraftPool`:
a proposer with one state (draft KV cache) per request (its random numbers are counter-based,
`sampling.py`, so they need no state); `propose(rows)`
drafts every row together (`DraftModelProposer.propose_batch`: one draft forward per position).

The in-process engine calls them directly; a Ray target shard and the draft worker actor wrap one
each, so the scheduler drives the same code whether the models are local or remote. A row whose
input is wrong (its cache does not hold what the caller expects) gets an exception in its slot and
the others proceed: one request's error never fails its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.config import SamplingParams
from specdec.models.kv_cache import KVCache
from specdec.models.model_runner import ModelRunner
from specdec.decoding.proposers import Proposal


class RowError(RuntimeError):
    """One row of a batched call failed; the rest of the batch was served."""


@dataclass
class TargetRow:
    """One request's part of a batched target forward."""

    request_id: str
    token_ids: list[int]  # [num_new] appended to the request's cache
    num_logits: int  # logits of the last num_logits new positions are returned
    expected_length: int  # tokens the request's cache must hold before this forward
    # Return the argmax ids `[num_logits]` instead of the logits (`verify.argmax_only`: the verify
    # needs nothing else, so a remote shard sends no logits).
    argmax_only: bool


class TargetPool:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.caches: dict[str, KVCache] = {}

    def forward(self, rows: Sequence[TargetRow]) -> list[list[int] | torch.Tensor | RowError]:
        """Per row: `[num_logits]` argmax ids (`argmax_only`), `[num_logits, vocab]` float32 logits on
        the CPU, or a `RowError`."""
        results: list = [None] * len(rows)
        live = []
        for i, row in enumerate(rows):
            cache = self.caches.get(row.request_id)
            if cache is None:
                cache = self.caches[row.request_id] = self.runner.new_cache()
            if len(cache) != row.expected_length:
                results[i] = RowError(f"cache of request {row.request_id} holds {len(cache)} tokens, the "
                                      f"scheduler expects {row.expected_length}")
            elif len(cache) + len(row.token_ids) > self.runner.max_context:
                results[i] = RowError(f"request {row.request_id}: {len(cache) + len(row.token_ids)} tokens exceed "
                                      f"the target's context of {self.runner.max_context}")
            else:
                live.append(i)
        if live:
            logits = self.runner.forward([self.caches[rows[i].request_id] for i in live],
                                               [rows[i].token_ids for i in live], [rows[i].num_logits for i in live])
            for i, row_logits in zip(live, logits):
                results[i] = row_logits.argmax(dim=-1).tolist() if rows[i].argmax_only else row_logits.cpu()
        return results

    def rewind(self, rows: Sequence[tuple[str, int]]) -> list[int]:
        """Rewind each (request id, length); the cache lengths after it."""
        lengths = []
        for request_id, length in rows:
            cache = self.caches.get(request_id)
            if cache is not None:
                cache.rewind(min(length, len(cache)))
            lengths.append(len(cache) if cache is not None else 0)
        return lengths

    def release(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            cache = self.caches.pop(request_id, None)
            if cache is not None:
                cache.rewind(0)

    def __len__(self) -> int:
        return len(self.caches)


@dataclass
class DraftRow:
    request_id: str
    context_token_ids: list[int]
    num_tokens: int
    sampling: SamplingParams
    # A proposal that costs no draft forward (a prompt-lookup match, `HybridProposer`) may be this long.
    max_tokens: int | None = None


class DraftPool:
    def __init__(self, proposer, device: torch.device | str = "cpu") -> None:
        self.proposer = proposer
        self.device = torch.device(device)
        self.states: dict[str, object] = {}

    @property
    def name(self) -> str:
        return self.proposer.name

    def _state(self, request_id: str):
        if request_id not in self.states:
            self.states[request_id] = self.proposer.new_state()
        return self.states[request_id]

    def propose(self, rows: Sequence[DraftRow]) -> list[Proposal]:
        """One proposal per row; a model draft runs one batched forward per draft position."""
        states = [self._state(r.request_id) for r in rows]
        proposals = self.proposer.propose_batch(states, [r.context_token_ids for r in rows],
                                                [r.num_tokens for r in rows], [r.sampling for r in rows],
                                                max_tokens=[r.max_tokens for r in rows])
        for p in proposals:
            if p.probs is not None:
                p.probs = p.probs.cpu()
        return proposals

    def release(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            entry = self.states.pop(request_id, None)
            if entry is not None:
                self.proposer.release(entry)

    def __len__(self) -> int:
        return len(self.states)
