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

import dataclasses

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
    # Verify the proposal here, where the logits are, and return its `VerifyResult` (token ids and,
    # when asked, log-probabilities) instead of `[num_logits, vocab]` logits.
    verify: "VerifySpec | None" = None


@dataclass
class ForwardReply:
    """A batched target forward's answer: per row its result (`TargetPool.forward`; None on a
    tensor-parallel rank other than 0) and its cache length on each shard when the forward began
    (after dropping the previous step's rejected tokens; shards must agree)."""

    results: list | None
    cache_lengths: list[list[int]]  # [row][shard]


@dataclass
class VerifySpec:
    """What verifying a row's proposal needs besides the target's logits: `token_ids[1:]` are the
    proposed tokens, the committed tokens are in the request's cache (`verify.verify_proposal`)."""

    sampling: SamplingParams  # made concrete (a seed and a mode)
    draft_probs: torch.Tensor | None = None  # q `[K, vocab]` (residual sampling only)


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

    def forward(self, rows: Sequence[TargetRow]) -> "ForwardReply":
        """Per row: `[num_logits]` argmax ids (`argmax_only`), the proposal's `VerifyResult` (a row
        with `verify`), `[num_logits, vocab]` float32 logits on the CPU, or a `RowError`; and each
        row's cache length when the forward began. The last step's rejected tokens are dropped here,
        first (the rewind rides on the next forward: no call of its own)."""
        results: list = [None] * len(rows)
        lengths: list[list[int]] = []
        live = []
        for i, row in enumerate(rows):
            cache = self.caches.get(row.request_id)
            if cache is None:
                cache = self.caches[row.request_id] = self.runner.new_cache()
            if len(cache) > row.expected_length:
                cache.rewind(row.expected_length)
            lengths.append([len(cache)])
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
                row = rows[i]
                if row.argmax_only:
                    results[i] = row_logits.argmax(dim=-1).tolist()
                elif row.verify is not None:
                    results[i] = self._verify(row, row_logits)
                else:
                    results[i] = row_logits.cpu()
        return ForwardReply(results, lengths)

    def _verify(self, row: TargetRow, logits: torch.Tensor):
        """The row's `VerifyResult`, from its logits on their device; a `RowError` if it fails."""
        from specdec.decoding import verify

        position = row.expected_length + 1  # the committed length: the cache held all but the last
        spec = row.verify
        q = spec.draft_probs.to(logits.device) if spec.draft_probs is not None else None
        committed = self.caches[row.request_id].token_ids[:position] if spec.sampling.processes_logits else ()
        try:
            return verify.verify_proposal(row.token_ids[1:], q, logits, spec.sampling, position, committed)
        except Exception as e:  # noqa: BLE001 - this request's processing failed; the batch goes on
            return RowError(f"{type(e).__name__}: {e}")

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
    context_token_ids: list[int]  # the context from position `context_start` on
    num_tokens: int
    sampling: SamplingParams
    # A proposal that costs no draft forward (a prompt-lookup match, `HybridProposer`) may be this long.
    max_tokens: int | None = None
    cache_limit: int | None = None  # the most tokens its draft cache may hold (its KV reservation)
    cache_salt: str = ""  # only prefixes of the same salt are found
    reuse: bool = True  # start a new draft state from a cached prefix
    # The context's first `context_start` tokens are those of the request's last row here (a remote
    # draft is sent only what changed: `as_delta`).
    context_start: int = 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix (list slices compare in C: a bisection of them)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def as_delta(row: DraftRow, sent: list[int] | None) -> DraftRow:
    """`row` with only the context past what it shares with `sent` (the context last sent for the
    request; None: nothing sent, the whole context goes)."""
    start = common_prefix(sent, row.context_token_ids) if sent else 0
    return dataclasses.replace(row, context_token_ids=row.context_token_ids[start:], context_start=start)


class DraftPool:
    def __init__(self, proposer, device: torch.device | str = "cpu", prefix_caching: bool = True) -> None:
        self.proposer = proposer
        self.device = torch.device(device)
        self.states: dict[str, object] = {}
        self.contexts: dict[str, list[int]] = {}  # request id -> its last row's whole context
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
        out: list = [None] * len(rows)
        whole = []
        for i, row in enumerate(rows):
            full = self._context(row)
            if isinstance(full, RowError):
                out[i] = full
            else:
                whole.append((i, row if row.context_start == 0 else
                              dataclasses.replace(row, context_token_ids=full, context_start=0)))
        if whole:
            try:
                proposals = self._propose([row for _, row in whole])
            except Exception as batch_error:  # noqa: BLE001
                if len(whole) == 1 and len(rows) == 1:
                    raise
                proposals = []
                for _, row in whole:
                    try:
                        proposals.extend(self._propose([row]))
                    except Exception as e:  # noqa: BLE001 - this row alone fails
                        proposals.append(RowError(f"{type(e).__name__}: {e}"))
                if all(isinstance(p, RowError) for p in proposals) and len(whole) == len(rows):
                    raise batch_error
            for (i, _), p in zip(whole, proposals):
                out[i] = p  # q stays on the draft's device: in process it goes to the target's as is
        return out

    def _context(self, row: DraftRow) -> list[int] | RowError:
        """The row's whole context (from its delta and the request's last one), kept for the next."""
        if row.context_start == 0:
            full = row.context_token_ids  # the caller's own list (the scheduler's copy, or Ray's)
        else:
            last = self.contexts.get(row.request_id)
            if last is None or len(last) < row.context_start:
                return RowError(f"request {row.request_id}: a context from position {row.context_start} but "
                                f"{'none' if last is None else len(last)} tokens held here (the draft restarted?)")
            full = last[:row.context_start] + list(row.context_token_ids)
        self.contexts[row.request_id] = full
        return full

    def _propose(self, rows: Sequence[DraftRow]) -> list[Proposal]:
        states = [self._state(r) for r in rows]
        return self.proposer.propose_batch(states, [r.context_token_ids for r in rows], [r.num_tokens for r in rows],
                                           [r.sampling for r in rows], max_tokens=[r.max_tokens for r in rows])

    def release(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self.contexts.pop(request_id, None)
            state = self.states.pop(request_id, None)
            if self.prefixes is not None:
                self.prefixes.release(request_id, state)
            elif state is not None:
                self.proposer.release(state)

    def __len__(self) -> int:
        return len(self.states)
