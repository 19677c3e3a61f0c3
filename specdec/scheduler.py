"""The batch scheduler: the speculative loop of every request, one batched step at a time.

Both engines run this loop: `SpeculativeEngine` (in-process) over a local `TargetPool` and
`DraftPool`, the Ray coordinator over adapters that send the same calls to the target shards and the
draft worker. A single request is a batch of one.

Continuous batching, at step boundaries (cf. vLLM's scheduler, Orca's iteration-level scheduling):
- a submitted request waits in a FIFO queue while the batch is full (`max_batch_size`);
- admitted, it is prefilled in chunks: each loop iteration runs one batched forward over the next
  prompt chunk of every admitted request, `max_batch_tokens` tokens in all, between batch steps,
  so a long prompt does not stall the running batch for long; its first step then joins the batch;
- a finished, cancelled, timed-out or failed request leaves the batch at once and frees its caches.

One step over the running batch B (each row has its own committed length and K):
1. K per row: fixed K, or auto-K over the measured cost of the batch's total verify rows
   (`speculation_length.AutoK`), clamped to max_tokens and the context;
2. one batched draft call for the rows that draft (a draft model runs one forward over all of them
   per draft position; n-gram lookup is per row) — rows holding a pre-drafted block use it instead;
3. one batched target forward over every row's `[last committed, d1..dK]`;
4. (pipelining, a draft that runs beside the target) while the target verifies, the draft already
   drafts each row's next block assuming this one is accepted whole (PEARL, arXiv 2408.11850);
5. per row: acceptance (`verify.py`), commit through the stopping rules (`sequence.py`), then one
   batched rewind of the target caches to each row's committed length minus one (the draft rewinds
   lazily, at its next proposal, to the prefix it shares with the committed context).

Errors: a row's own error (its slot of a batched call holds an exception) fails that request alone;
an exception from a whole call fails the requests of that step; the caller's `on_fatal` decides
whether the engine must rebuild (a dead actor) before the next step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specdec.config import EngineConfig, SamplingParams
from specdec.pools import DraftRow, TargetRow
from specdec.proposers import Proposal
from specdec.request import GenerationRequest, RequestTimeout
from specdec.sampling import logits_to_probs
from specdec.sequence import Sequence as GenSequence, StreamChunk
from specdec.speculation_length import AutoK, CostModel, make_policy
from specdec import verify

logger = logging.getLogger(__name__)


class Cancelled(Exception):
    """The request was cancelled by its caller (a closed stream, a disconnected client)."""


@dataclass
class StepInfo:
    """What one verify step did for one request (for metrics; the request's stats get the same numbers)."""

    k: int  # draft tokens asked for (after clamping)
    num_proposed: int
    num_accepted: int
    num_committed: int
    verify_seconds: float
    batch_size: int = 1
    draft_seconds: float | None = None  # None: no drafting call for this row this step
    pipeline_hit: bool | None = None  # None: nothing was pre-drafted for this row this step
    draft_failures: int = 0
    target_rewound_tokens: int = 0
    target_cache_tokens: int | None = None
    draft_rewound_tokens: int = 0
    draft_cache_tokens: int | None = None


@dataclass
class Active:
    """A request the scheduler holds: its sequence, K policy, where its output goes."""

    request: GenerationRequest
    seq: GenSequence
    policy: object
    sink: Callable[[object], None]  # receives StreamChunk objects, then None (done) or an exception
    pipeline: bool
    deadline: float | None
    prefilled: int = 0  # prompt tokens in the target cache so far
    draft_ok: bool = True
    pending: Proposal | None = None  # a pre-drafted block for the next step
    cancelled: bool = False
    # Events for metrics: ("started", None), ("prefilled", (prompt tokens, cached)), ("step", StepInfo).
    observer: Callable[[str, object], None] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prefill_target(self) -> int:
        return len(self.seq.token_ids) - 1  # all but the last prompt token


class Scheduler:
    """`target` and `draft` are a `TargetPool`/`DraftPool` behind the calls below (local or remote):

    target.submit_forward(rows: [TargetRow]) -> wait() -> [ids | logits | exception]
    target.rewind([(request_id, length)]) -> [cache length]
    target.release([request_id])
    draft.submit_propose(rows: [DraftRow]) -> wait() -> [Proposal | exception]
    draft.release([request_id]); draft.concurrent: True when it runs beside the target (pipelining pays)
    """

    def __init__(self, config: EngineConfig, target, draft, *, tokenizer, eos_token_ids, vocab_size: int,
                 max_context: int, costs: CostModel | None = None,
                 on_fatal: Callable[[Exception], None] | None = None) -> None:
        self.config = config
        self.target, self.draft = target, draft
        # A callable is read at each submission (a model's generation config may change between requests).
        self.tokenizer, self._eos_token_ids = tokenizer, eos_token_ids
        self.vocab_size, self.max_context = vocab_size, max_context
        self.costs = costs or CostModel()
        self.on_fatal = on_fatal
        self.max_batch_size = config.max_batch_size
        self.max_batch_tokens = config.max_batch_tokens
        self.waiting: deque[Active] = deque()
        self.prefilling: deque[Active] = deque()
        self.running: list[Active] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ids: set[str] = set()
        self.batch_sizes: Counter[int] = Counter()  # steps run at each batch size (benchmarks, tests)

    # ---------------------------------------------------------------------------- requests

    @property
    def has_draft(self) -> bool:
        return self.draft is not None

    def submit(self, request: GenerationRequest, prompt_token_ids: list[int], sampling: SamplingParams,
               sink: Callable[[object], None], observer=None) -> Active:
        """Queue a validated request; its chunks (then None, or an exception) go to `sink` from the
        scheduler's thread."""
        policy = make_policy(self.config, self.costs, request.num_speculative_tokens, has_draft=self.has_draft)
        pipeline = bool(self.draft is not None and getattr(self.draft, "concurrent", False)
                        and (request.pipeline if request.pipeline is not None else getattr(self.draft, "pipeline",
                                                                                           False)))
        eos = self._eos_token_ids() if callable(self._eos_token_ids) else self._eos_token_ids
        seq = GenSequence(prompt_token_ids, sampling, self.tokenizer, frozenset(eos))
        deadline = time.monotonic() + request.timeout_s if request.timeout_s is not None else None
        item = Active(request, seq, policy, sink, pipeline, deadline, observer=observer)
        with self._wake:
            if request.request_id in self._ids:
                raise ValueError(f"request id {request.request_id!r} is already in flight")
            self._ids.add(request.request_id)
            self.waiting.append(item)
            self._wake.notify_all()
        return item

    def cancel(self, item: Active) -> None:
        with self._wake:
            item.cancelled = True
            self._wake.notify_all()

    @property
    def num_active(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    def wake(self) -> None:
        """Wake a thread blocked in `wait_for_work`."""
        with self._wake:
            self._wake.notify_all()

    def wait_for_work(self, timeout: float | None = None) -> bool:
        with self._wake:
            if not self.num_active:
                self._wake.wait(timeout)
            return bool(self.num_active)

    def fail_all(self, error: Exception) -> None:
        """Fail every request held (the engine is shutting down or cannot continue)."""
        with self._wake:
            items = list(self.waiting) + list(self.prefilling) + list(self.running)
        for item in items:
            self._finish(item, error)

    # ------------------------------------------------------------------------------- loop

    def run_once(self) -> None:
        """One iteration: drop cancelled requests, admit, one prefill chunk, one batched step."""
        self._sweep()
        with self._wake:
            admitted = []
            while self.waiting and len(self.prefilling) + len(self.running) < self.max_batch_size:
                admitted.append(self.waiting.popleft())
                self.prefilling.append(admitted[-1])
        for item in admitted:
            if item.observer:
                item.observer("started", None)
        if self.prefilling:
            self._prefill()
        if self.running:
            self._step(list(self.running))

    def _sweep(self) -> None:
        now = time.monotonic()
        for group in (self.waiting, self.prefilling, self.running):
            for item in list(group):
                if item.cancelled:
                    self._finish(item, Cancelled(f"request {item.request_id} was cancelled"))
                elif item.deadline is not None and now > item.deadline:
                    self._finish(item, RequestTimeout(f"request {item.request_id} ran past its timeout after "
                                                      f"{item.seq.num_output_tokens} tokens"))

    def _prefill(self) -> None:
        """One batched forward over the next prompt chunk of every admitted request, `max_batch_tokens`
        tokens in all (a long prompt takes several iterations, between which the batch steps)."""
        budget, rows, items = self.max_batch_tokens, [], []
        for item in list(self.prefilling):
            end = min(item.prefill_target, item.prefilled + budget)
            if end > item.prefilled:
                rows.append(TargetRow(item.request_id, item.seq.token_ids[item.prefilled:end], 1, item.prefilled, True))
                items.append((item, end))
                budget -= end - item.prefilled
            elif item.prefilled >= item.prefill_target:
                items.append((item, item.prefilled))  # a one-token prompt: nothing to prefill
            if budget <= 0:
                break
        results = []
        if rows:
            try:
                results = self.target.submit_forward(rows)()
            except Exception as e:  # noqa: BLE001 - these requests' prefill failed; the batch goes on
                self._fatal_or_fail([item for item, _ in items], e)
                return
        results = iter(results)
        for item, end in items:
            if end > item.prefilled:
                result = next(results)
                if isinstance(result, Exception):
                    self._finish(item, result)
                    continue
            item.prefilled = end
            if item.prefilled >= item.prefill_target:
                item.seq.prefill_seconds = time.perf_counter() - item.seq.started
                if item.observer:
                    item.observer("prefilled", (item.seq.num_prompt_tokens, item.prefilled))
                self.prefilling.remove(item)
                self.running.append(item)

    # ------------------------------------------------------------------------------ step

    def _choose_k(self, batch: list[Active]) -> list[int]:
        """K per row. Auto-K rows weigh their expected tokens against the step's cost at the batch's
        total verify rows, so K shrinks as the batch grows (and is 0 once the target is compute-bound)."""
        ks = [0] * len(batch)
        fixed_tokens, autos = 0, []
        for i, item in enumerate(batch):
            if not item.draft_ok:
                continue
            if isinstance(item.policy, AutoK):
                autos.append(i)
            else:
                ks[i] = item.policy.next_k()
                fixed_tokens += ks[i] + 1
        if autos:
            tokens = fixed_tokens + sum(batch[i].policy.last_k + 1 for i in autos)
            expected = sum(batch[i].policy.expected_tokens(batch[i].policy.last_k) for i in autos)
            for i in autos:
                policy = batch[i].policy
                mine_tokens, mine_expected = policy.last_k + 1, policy.expected_tokens(policy.last_k)
                ks[i] = policy.next_k(other_tokens=tokens - mine_tokens, other_expected=expected - mine_expected,
                                      rows=len(batch))
                tokens += ks[i] + 1 - mine_tokens
                expected += policy.expected_tokens(ks[i]) - mine_expected
        ks = [item.seq.clamp_k(k, self.max_context) for item, k in zip(batch, ks)]
        # The step's token budget: shrink the largest K first.
        while sum(k + 1 for k in ks) > self.max_batch_tokens and any(ks):
            ks[ks.index(max(ks))] -= 1
        return ks

    def _step(self, batch: list[Active]) -> None:
        t0 = time.perf_counter()
        ks = self._choose_k(batch)
        proposals = [Proposal([]) for _ in batch]
        drafted = [False] * len(batch)
        failures = [item.seq.stats.draft_failures for item in batch]
        draft_rows = []
        for i, (item, k) in enumerate(zip(batch, ks)):
            pending, item.pending = item.pending, None  # a pre-drafted block is for this step only
            if k <= 0:
                continue
            if pending is not None and len(pending):
                proposals[i] = _truncate(pending, k)
            else:
                draft_rows.append(i)
        draft_seconds = None
        if draft_rows:
            # Room for proposals that cost no draft forward (prompt-lookup matches): up to k_max per
            # row, within max_tokens, the context and the step's token budget.
            spare = max(0, self.max_batch_tokens - sum(k + 1 for k in ks)) // len(draft_rows)
            rows = [DraftRow(batch[i].request_id, list(batch[i].seq.token_ids), ks[i], batch[i].seq.sampling,
                             max(ks[i], min(batch[i].seq.clamp_k(self.config.k_max, self.max_context), ks[i] + spare)))
                    for i in draft_rows]
            try:
                results = self.draft.submit_propose(rows)()
            except Exception as e:  # noqa: BLE001 - the draft failed: these rows go on target-only
                results = [e] * len(rows)
            for i, result in zip(draft_rows, results):
                if isinstance(result, Exception):
                    self._draft_failed(batch[i], result)
                else:
                    proposals[i], drafted[i] = result, True
            draft_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        rows = [TargetRow(item.request_id, [item.seq.token_ids[-1]] + p.token_ids, len(p) + 1,
                          len(item.seq.token_ids) - 1, item.seq.sampling.greedy)
                for item, p in zip(batch, proposals)]
        try:
            wait_target = self.target.submit_forward(rows)
        except Exception as e:  # noqa: BLE001
            self._fatal_or_fail(batch, e)
            return
        predraft = None
        early_rows = [i for i, (item, p) in enumerate(zip(batch, proposals)) if item.pipeline and item.draft_ok
                      and len(p)]
        if early_rows:
            rows_ahead = [DraftRow(batch[i].request_id, batch[i].seq.token_ids + proposals[i].token_ids,
                                   len(proposals[i]) + 1, batch[i].seq.sampling) for i in early_rows]
            try:
                predraft = self.draft.submit_propose(rows_ahead)
            except Exception as e:  # noqa: BLE001
                for i in early_rows:
                    self._draft_failed(batch[i], e)
                early_rows = []
        try:
            outputs = wait_target()
        except Exception as e:  # noqa: BLE001
            self._fatal_or_fail(batch, e)
            return
        t2 = time.perf_counter()
        verify_seconds = t2 - t1
        self.costs.observe_target(sum(len(r.token_ids) for r in rows), verify_seconds)
        results, keep = [None] * len(batch), []
        for i, (item, p, out) in enumerate(zip(batch, proposals, outputs)):
            if isinstance(out, Exception):
                self._finish(item, out)
                continue
            sampling = item.seq.sampling
            if sampling.greedy:
                results[i] = verify.verify_greedy_ids(p.token_ids, out)
            else:
                results[i] = verify.verify_sampled(p.token_ids, p.probs, logits_to_probs(out, sampling),
                                            item.seq.verify_generator)
            keep.append(i)
        chunks = {}
        for i in keep:
            item = batch[i]
            chunks[i] = item.seq.commit(results[i].token_ids)
            chunks[i].num_proposed = len(proposals[i])
        rewind = [i for i in keep if not batch[i].seq.finished]
        lengths = {}
        if rewind:
            try:
                got = self.target.rewind([(batch[i].request_id, len(batch[i].seq.token_ids) - 1) for i in rewind])
            except Exception as e:  # noqa: BLE001
                self._fatal_or_fail([batch[i] for i in keep], e)
                return
            lengths = dict(zip(rewind, got))
        # Pre-drafted blocks: usable where the whole proposal was accepted and the bonus was guessed.
        hits = {}
        if predraft is not None:
            usable = [i for i in early_rows if i in chunks and results[i].all_accepted and not batch[i].seq.finished]
            early = None
            if usable:
                try:
                    early = predraft()
                except Exception as e:  # noqa: BLE001
                    for i in usable:
                        self._draft_failed(batch[i], e)
            for j, i in enumerate(early_rows):
                proposal = early[j] if early is not None else None
                hit = False
                if i in usable and isinstance(proposal, Proposal):
                    if proposal.token_ids and proposal.token_ids[0] == results[i].token_ids[-1]:
                        batch[i].pending = pre_drafted_block(proposal)
                        hit = True
                hits[i] = (hit, proposal if isinstance(proposal, Proposal) else None)
        t3 = time.perf_counter()
        self.batch_sizes[len(batch)] += 1
        self.costs.observe_overhead(t3 - t2)
        if draft_seconds is not None and any(drafted):
            num_draft = [proposals[i] for i in range(len(batch)) if drafted[i]]
            forwards = max(p.num_forwards for p in num_draft)
            catchup = max(p.num_catchup_tokens for p in num_draft)
            seconds = [p.seconds for p in num_draft if p.seconds is not None]
            drafting = seconds[0] if seconds else draft_seconds
            if not getattr(self.draft, "per_token", True):
                # A model-free lookup: paid once per step, whatever K.
                self.costs.observe_draft(1, 0.0)
                self.costs.observe_draft_call(draft_seconds)
            elif forwards and catchup <= 2:  # a long catch-up is a small prefill, not a draft step
                self.costs.observe_draft(forwards, drafting, rows=len(num_draft))
                self.costs.observe_draft_call(max(0.0, draft_seconds - drafting))
        for i in keep:
            item, chunk, p = batch[i], chunks[i], proposals[i]
            seq = item.seq
            info = StepInfo(k=ks[i], num_proposed=len(p), num_accepted=results[i].num_accepted,
                            num_committed=len(chunk.token_ids), verify_seconds=verify_seconds, batch_size=len(batch),
                            draft_seconds=draft_seconds if drafted[i] else None)
            if i in lengths:
                chunk.cache_lengths = lengths[i] if isinstance(lengths[i], list) else [lengths[i]]
                info.target_cache_tokens = chunk.cache_lengths[0]
                info.target_rewound_tokens = len(rows[i].token_ids) + rows[i].expected_length - info.target_cache_tokens
            if drafted[i]:
                info.draft_rewound_tokens, info.draft_cache_tokens = p.rewound_tokens, p.cache_tokens
            if i in hits:
                hit, early_p = hits[i]
                info.pipeline_hit = hit
                seq.stats.pipeline_hits += hit
                seq.stats.pipeline_misses += not hit
                if early_p is not None and i in hits and hit:
                    info.draft_rewound_tokens += early_p.rewound_tokens
                    info.draft_cache_tokens = early_p.cache_tokens
            info.draft_failures = seq.stats.draft_failures - failures[i]
            seq.record_step(len(p), results[i].num_accepted, p.num_forwards, draft_seconds if drafted[i] else 0.0,
                            verify_seconds)
            item.policy.observe(len(p), results[i].num_accepted)
            if item.observer:
                item.observer("step", info)
            if seq.finished:
                chunk.output = seq.output()
                self._finish(item, None, last=chunk)  # caches freed before the caller sees the end
            else:
                item.sink(chunk)

    def _draft_failed(self, item: Active, error: Exception) -> None:
        item.seq.stats.draft_failures += 1
        item.draft_ok = False
        item.pending = None
        logger.warning("draft failed for request %s (%s: %s); it continues target-only", item.request_id,
                       error.__class__.__name__, str(error).splitlines()[0][:200] if str(error) else "")

    def _fatal_or_fail(self, items: Sequence[Active], error: Exception) -> None:
        if self.on_fatal is not None:
            error = self.on_fatal(error) or error
        for item in items:
            self._finish(item, error)

    def _finish(self, item: Active, error: Exception | None, last: StreamChunk | None = None) -> None:
        """Remove the request from wherever it is, free its caches, and end its stream."""
        with self._wake:
            if item.request_id not in self._ids:
                return
            self._ids.discard(item.request_id)
            for group in (self.waiting, self.prefilling):
                if item in group:
                    group.remove(item)
            if item in self.running:
                self.running.remove(item)
        for release in (self.target.release, self.draft.release if self.draft is not None else None):
            if release is None:
                continue
            try:
                release([item.request_id])
            except Exception:  # noqa: BLE001 - a dead actor holds no state to free
                pass
        if last is not None:
            item.sink(last)
        item.sink(error)


def received(item):
    """What a request's sink received, for its stream: a chunk; None once it has ended; a failure is
    raised (the request is already out of the scheduler then)."""
    if isinstance(item, BaseException):
        raise item
    return item


def pre_drafted_block(early: Proposal) -> Proposal:
    """The next step's proposal from a block pre-drafted after [proposal]: its first token guessed
    the bonus token (and was right), the rest follow it, each with the q row it was drawn from."""
    return Proposal(early.token_ids[1:], early.probs[1:] if early.probs is not None else None)


def _truncate(proposal: Proposal, k: int) -> Proposal:
    if len(proposal) <= k:
        return proposal
    probs = proposal.probs[:k] if proposal.probs is not None else None
    return Proposal(proposal.token_ids[:k], probs)
