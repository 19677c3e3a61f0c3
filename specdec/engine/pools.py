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

Both pools keep a `PrefixCache` of their model's committed KV (`specdec.models.prefix_cache`): a
request admitted with `TargetPool.admit` starts from the longest cached prefix of its prompt (the
scheduler prefills only the rest); a draft state starts from the longest cached prefix of its first
context (the draft's catch-up feeds only the rest). Released caches stay as entries, evicted to the
room the engine's KV budget leaves them (`fit`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.config import SamplingParams
from specdec.decoding.proposers import Proposal
from specdec.models.kv_cache import KVCache
from specdec.models.model_runner import ModelRunner
from specdec.models.prefix_cache import PrefixCache


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


@dataclass
class AdmitRow:
    """A request entering the batch: its cache is made, from the longest cached prefix of its prompt."""

    request_id: str
    prompt_token_ids: list[int]
    limit: int | None  # the most tokens its cache may hold (its KV reservation)
    cache_salt: str = ""  # only entries of the same salt are found
    reuse: bool = True  # look for a cached prefix at all


@dataclass
class PrefixUsage:
    """What a pool's prefix cache holds after `fit`."""

    bytes: int
    evictions: int  # entries dropped for room so far
    hit_tokens: int = 0  # prompt tokens served from cached prefixes so far


class TargetPool:
    def __init__(self, runner: ModelRunner, prefix_caching: bool = True) -> None:
        self.runner = runner
        self.caches: dict[str, KVCache] = {}
        self.prefixes = PrefixCache() if prefix_caching else None

    def admit(self, rows: Sequence[AdmitRow]) -> list[int]:
        """Make each request's cache; per row the prompt tokens it already holds (copied from the
        longest cached prefix, all but the prompt's last token at most: the next step feeds it)."""
        lengths = []
        for row in rows:
            cache = self.caches[row.request_id] = self.runner.new_cache(row.limit)
            if self.prefixes is not None and row.reuse:
                hit = self.prefixes.lookup(row.prompt_token_ids, row.cache_salt, len(row.prompt_token_ids) - 1)
                if hit.length:
                    cache.copy_prefix(hit.entry.cache, hit.length)
                self.prefixes.watch(row.request_id, cache, row.cache_salt, row.prompt_token_ids)
            lengths.append(len(cache))
        return lengths

    def fit(self, room: int) -> PrefixUsage:
        """Evict cached prefixes down to `room` bytes."""
        if self.prefixes is None:
            return PrefixUsage(0, 0)
        return PrefixUsage(self.prefixes.fit(room), self.prefixes.evictions, self.prefixes.hit_tokens)

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
            if self.prefixes is not None:
                self.prefixes.release(request_id, cache)
            elif cache is not None:
                cache.clear()

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
    cache_limit: int | None = None  # the most tokens its draft cache may hold (its KV reservation)
    cache_salt: str = ""  # only prefixes of the same salt are found
    reuse: bool = True  # start a new draft state from a cached prefix


class DraftPool:
    def __init__(self, proposer, device: torch.device | str = "cpu", prefix_caching: bool = True) -> None:
        self.proposer = proposer
        self.device = torch.device(device)
        self.states: dict[str, object] = {}
        # A draft model's states are KV caches (n-gram lookup keeps none).
        self.prefixes = PrefixCache() if prefix_caching and proposer.per_token else None

    @property
    def name(self) -> str:
        return self.proposer.name

    def _state(self, row: DraftRow):
        state = self.states.get(row.request_id)
        if state is None:
            state = self.states[row.request_id] = self.proposer.new_state(row.cache_limit)
            if self.prefixes is not None:
                context = row.context_token_ids
                if row.reuse:
                    hit = self.prefixes.lookup(context, row.cache_salt, len(context) - 1)
                    if hit.length:
                        state.copy_prefix(hit.entry.cache, hit.length)
                self.prefixes.watch(row.request_id, state, row.cache_salt, context)
        return state

    def fit(self, room: int) -> PrefixUsage:
        if self.prefixes is None:
            return PrefixUsage(0, 0)
        return PrefixUsage(self.prefixes.fit(room), self.prefixes.evictions, self.prefixes.hit_tokens)

    def propose(self, rows: Sequence[DraftRow]) -> list[Proposal | RowError]:
        """One proposal per row; a model draft runs one batched forward per draft position. If the
        batch fails, each row is proposed alone, so a row whose own input fails (a bias, a grammar)
        gets its error in its slot and the others their proposals (a state re-syncs to its context
        on its next call, so a half-advanced one is harmless)."""
        try:
            proposals = self._propose(rows)
        except Exception as batch_error:  # noqa: BLE001
            if len(rows) == 1:
                raise
            proposals = []
            for row in rows:
                try:
                    proposals.extend(self._propose([row]))
                except Exception as e:  # noqa: BLE001 - this row alone fails
                    proposals.append(RowError(f"{type(e).__name__}: {e}"))
            if all(isinstance(p, RowError) for p in proposals):
                raise batch_error
        for p in proposals:
            if not isinstance(p, RowError) and p.probs is not None:
                p.probs = p.probs.cpu()
        return proposals

    def _propose(self, rows: Sequence[DraftRow]) -> list[Proposal]:
        states = [self._state(r) for r in rows]
        return self.proposer.propose_batch(states, [r.context_token_ids for r in rows], [r.num_tokens for r in rows],
                                           [r.sampling for r in rows], max_tokens=[r.max_tokens for r in rows])

    def release(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            state = self.states.pop(request_id, None)
            if self.prefixes is not None:
                self.prefixes.release(request_id, state)
            elif state is not None:
                self.proposer.release(state)

    def __len__(self) -> int:
        return len(self.states)
