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
3. one batched target forward over every row's `[last committed, d1..dK]`, which first drops each
   cache's tokens past its committed length minus one (what the last step rejected: the rewind rides
   on this forward) and verifies each proposal where the logits are (`verify.py`, on the target's
   device; rank 0 of a tensor-parallel group): only token ids come back, and logits never leave the
   device but for prompt log-probabilities;
4. (pipelining, a draft that runs beside the target) while the target verifies, the draft already
   drafts each row's next block assuming this one is accepted whole (PEARL, arXiv 2408.11850);
5. per row: commit through the stopping rules (`request_state.py`) (the draft rewinds lazily too, at
   its next proposal, to the prefix it shares with the committed context).

`_step` reads as that list: `plan_step` (K per row within the token budget), `_propose`,
`_submit_verify`, `_pre_draft`, `_verify`, `_commit`, `_collect_pre_drafts`, then
`_observe` hands the step's numbers once to the cost model, each request's stats and K policy
(`KPolicy`), and its `RequestObserver` (metrics), and `_emit` streams the chunks. The state moving
between phases is one `specdec.engine.step.Step`; the backends are typed seams
(`specdec.engine.backends`: per row a `TargetResult` or a `DraftResult`), the same in process and on
Ray.

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

from specdec.config import EngineConfig, SamplingParams
from specdec.decoding import verify
from specdec.decoding.proposers import Proposal
from specdec.decoding.sampling import make_concrete
from specdec.decoding.speculation_length import CostModel, KPolicy, choose_ks, make_policy
from specdec.engine.backends import DraftBackend, TargetBackend, TargetResult
from specdec.engine.budget import KVBudget
from specdec.engine.pools import AdmitRow, DraftRow, ForwardReply, TargetRow, VerifySpec
from specdec.engine.prompt import PromptResolver
from specdec.engine.request import Cancelled, GenerationRequest, RequestTimeout
from specdec.engine.request_state import RequestState, StreamChunk
from specdec.engine.step import (RequestObserver, ScheduledRequest, Step, plan_step, pre_drafted_block,
                                 truncated)

logger = logging.getLogger(__name__)


class Scheduler:
    """Drives `target` and `draft` backends (`specdec.engine.backends`: local pools or Ray actors)."""

    def __init__(self, config: EngineConfig, target: TargetBackend, draft: DraftBackend | None,
                 prompts: PromptResolver, costs: CostModel | None = None,
                 on_fatal: Callable[[Exception], None] | None = None, budget: KVBudget | None = None) -> None:
        """`prompts`: the target's tokenizer, vocabulary, context and end-of-sequence ids (and how a
        request's prompt is checked against them, which engines do before `submit`)."""
        self.config = config
        self.target, self.draft = target, draft
        self.prompts = prompts
        self.tokenizer, self.vocab_size, self.max_context = prompts.tokenizer, prompts.vocab_size, prompts.max_context
        self.costs = costs or CostModel()
        self.on_fatal = on_fatal
        self.max_batch_size = config.max_batch_size
        self.max_batch_tokens = config.max_batch_tokens
        self.waiting: deque[ScheduledRequest] = deque()
        self.prefilling: deque[ScheduledRequest] = deque()
        self.running: list[ScheduledRequest] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ids: set[str] = set()
        self.batch_sizes: Counter[int] = Counter()  # steps run at each batch size (benchmarks, tests)
        self.budget = budget  # None: no KV budget (admission by batch size only)
        self.reserved = 0  # bytes reserved by the requests in the batch
        self.prefix_bytes = 0  # bytes held by the cached prefixes (target's and draft's)
        self.prefix_evictions = 0
        self._refit = False  # the batch changed: the prefix caches' room to apply

    # ---------------------------------------------------------------------------- requests

    @property
    def has_draft(self) -> bool:
        return self.draft is not None

    def submit(self, request: GenerationRequest, prompt_token_ids: list[int], sampling: SamplingParams,
               sink: Callable[[object], None], observer: RequestObserver | None = None) -> ScheduledRequest:
        """Queue a validated request; its chunks (then None, or an exception) go to `sink` from the
        scheduler's thread."""
        policy = make_policy(self.config, self.costs, request.num_speculative_tokens, has_draft=self.has_draft)
        can = self.draft.capabilities if self.draft is not None else None
        pipeline = bool(can is not None and can.concurrent
                        and (request.pipeline if request.pipeline is not None else can.pipeline))
        eos = self.prompts.eos_token_ids
        seeded = sampling.seed is not None
        # A seed and a sampling mode for a sampled request, fixed before anything draws from it.
        sampling = make_concrete(sampling, self.config.speculative_sampling, len(prompt_token_ids), eos)
        pinned, policy = self._pin(sampling, seeded, policy)
        pipeline = pipeline and not pinned
        state = RequestState(prompt_token_ids, sampling, self.tokenizer, eos)
        deadline = time.monotonic() + request.timeout_s if request.timeout_s is not None else None
        item = ScheduledRequest(request, state, policy, sink, pipeline, deadline, observer=observer, pinned=pinned,
                                reuse=sampling.prompt_logprobs is None)
        # Its caches' bound: the prompt, max_tokens (or the rest of the context), and one verify pass.
        new = sampling.max_tokens if sampling.max_tokens is not None else self.max_context
        item.limit = min(self.max_context, len(prompt_token_ids) + new + self.config.speculative_tokens_limit + 1)
        if self.budget is not None:
            item.reserved = self.budget.check(item.limit, len(prompt_token_ids))  # OverBudget: never fits
        with self._wake:
            if request.request_id in self._ids:
                raise ValueError(f"request id {request.request_id!r} is already in flight")
            self._ids.add(request.request_id)
            self.waiting.append(item)
            self._wake.notify_all()
        return item

    @staticmethod
    def _pin(sampling: SamplingParams, seeded: bool, policy: KPolicy) -> tuple[bool, KPolicy]:
        """(pinned, K policy) of a request. A seeded residual request's text depends on its K and on
        the draft's q: it gets K from its own history alone (auto: `HeuristicK`), never trimmed for
        batch-mates (`_plan`), and it does not pipeline: a pre-drafted block runs the draft over
        other shapes (bfloat16 rounding moves q: 6/64 texts changed,
        docs/bench/seeded-stability-tiny.json) and, with the hybrid draft, looks up another
        context. Greedy and invariant text never depend on K or q."""
        pinned = seeded and not sampling.greedy and sampling.speculative_sampling == "residual" and policy.drafts
        return pinned, policy.independent() if pinned else policy

    def cancel(self, item: ScheduledRequest) -> None:
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

    def drive(self, stop: Callable[[], bool], after_step: Callable[[], None] | None = None,
              idle_s: float = 1.0, on_idle: Callable[[], bool] | None = None) -> None:
        """The scheduler's thread (both engines run this loop): one `run_once` after another while
        there is work, until `stop()`. Idle for `idle_s`, it asks `on_idle()` whether to return. A
        bug in a step fails the requests held and the loop goes on serving."""
        import torch

        while not stop():
            if not self.wait_for_work(timeout=idle_s):
                if on_idle is not None and on_idle():
                    return
                continue
            try:
                with torch.inference_mode():
                    self.run_once()
                if after_step is not None:
                    after_step()
            except Exception as e:  # noqa: BLE001 - a bug in a step: fail what is held, keep serving
                logger.exception("scheduler step failed")
                self.fail_all(e)

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
                if self.budget is not None and self.reserved + self.waiting[0].reserved > self.budget.total:
                    break  # the KV budget is full: the head of the queue waits (first come, first served)
                admitted.append(self.waiting.popleft())
                admitted[-1].admitted = True
                self.reserved += admitted[-1].reserved
                self.prefilling.append(admitted[-1])
        if admitted:
            self._admit(admitted)
        if self._refit:
            self._fit_prefixes()
        if self.prefilling:
            self._prefill()
        if self.running:
            self._step(list(self.running))

    def _admit(self, items: list[ScheduledRequest]) -> None:
        """Make the admitted requests' target caches, each from the longest cached prefix of its
        prompt: its prefill starts after what the cache served."""
        self._fit_prefixes()  # their reservations shrank the prefixes' room: evict first
        rows = [AdmitRow(item.request_id, item.state.token_ids, item.limit, item.request.cache_salt or "",
                         item.reuse) for item in items]
        try:
            cached = self.target.admit(rows)
        except Exception as e:  # noqa: BLE001
            self._fatal_or_fail(items, e)
            return
        for item, n in zip(items, cached):
            item.prefilled = item.state.cached_tokens = min(n, item.prefill_target)
            if item.observer:
                item.observer.started()

    def _fit_prefixes(self) -> None:
        """Evict cached prefixes (least recently used first) to the room the reservations leave."""
        self._refit = False
        if self.budget is None:
            return
        room_target, room_draft = self.budget.prefix_room(self.reserved)
        usages = []
        for backend, room in ((self.target, room_target), (self.draft, room_draft)):
            if backend is not None:
                try:
                    usages.append(backend.fit(room))
                except Exception:  # noqa: BLE001 - a dead actor holds nothing; the next fit retries
                    logger.exception("fitting the prefix cache failed")
        self.prefix_bytes = sum(u.bytes for u in usages)
        self.prefix_evictions = sum(u.evictions for u in usages)

    @property
    def kv_usage(self) -> float | None:
        """Reserved plus cached bytes over the budget (None: no budget)."""
        if self.budget is None:
            return None
        return (self.reserved + self.prefix_bytes) / self.budget.total

    def _sweep(self) -> None:
        now = time.monotonic()
        for group in (self.waiting, self.prefilling, self.running):
            for item in list(group):
                if item.cancelled:
                    self._finish(item, Cancelled(f"request {item.request_id} was cancelled"))
                elif item.deadline is not None and now > item.deadline:
                    self._finish(item, RequestTimeout(f"request {item.request_id} ran past its timeout after "
                                                      f"{item.state.num_output_tokens} tokens"))

    def _prefill(self) -> None:
        """One batched forward over the next prompt chunk of every admitted request, `max_batch_tokens`
        tokens in all (a long prompt takes several iterations, between which the batch steps)."""
        budget, rows, items = self.max_batch_tokens, [], []
        for item in list(self.prefilling):
            end = min(item.prefill_target, item.prefilled + budget)
            if end > item.prefilled:
                # Prompt log-probabilities need every position's logits; otherwise the last one's argmax.
                every = item.state.sampling.prompt_logprobs is not None
                rows.append(TargetRow(item.request_id, item.state.token_ids[item.prefilled:end],
                                      end - item.prefilled if every else 1, item.prefilled, argmax_only=not every))
                items.append((item, end))
                budget -= end - item.prefilled
            elif item.prefilled >= item.prefill_target:
                items.append((item, item.prefilled))  # a one-token prompt: nothing to prefill
            if budget <= 0:
                break
        results: list[TargetResult] = []
        if rows:
            try:
                results = self.target.submit_forward(rows)().results
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
                top = item.state.sampling.prompt_logprobs
                if top is not None:  # position j predicts prompt token j + 1
                    item.state.add_prompt_logprobs([verify.token_logprob(result[j], token, top) for j, token in
                                                  enumerate(item.state.token_ids[item.prefilled + 1:end + 1])])
            item.prefilled = end
            if item.prefilled >= item.prefill_target:
                item.state.prefill_seconds = time.perf_counter() - item.state.started
                if item.observer:
                    item.observer.prefilled(item.state.num_prompt_tokens, item.state.cached_tokens)
                self.prefilling.remove(item)
                self.running.append(item)

    # ------------------------------------------------------------------------------ step

    def _plan(self, running: list[ScheduledRequest]) -> Step:
        """K per row (`choose_ks`: a failed draft's rows go target-only), clamped to each row's
        max_tokens and the context, then the rows that fit the token budget (`plan_step`)."""
        ks = choose_ks([item.policy if item.draft_ok else None for item in running])
        ks = [item.state.clamp_k(k, self.max_context) for item, k in zip(running, ks)]
        lookup = (lambda item: item.state.clamp_k(self.config.speculative_tokens_limit, self.max_context)) \
            if self.config.prompt_lookup_min else None
        return plan_step(running, ks, self.max_batch_tokens, lookup)

    def _step(self, batch: list[ScheduledRequest]) -> None:
        """One speculative step over the running batch, phase by phase (see the module docstring)."""
        step = self._plan(batch)
        self._propose(step)
        wait_target = self._submit_verify(step)
        if wait_target is None:
            return
        self._pre_draft(step)
        if not self._verify(step, wait_target):
            return
        self._commit(step)
        self._collect_pre_drafts(step)
        step.finished = time.perf_counter()
        self._observe(step)
        self._emit(step)

    def _propose(self, step: Step) -> None:
        """Each row's proposal: its pre-drafted block if it holds one, else one batched draft call."""
        batch, ks = step.batch, step.ks
        draft_rows = []
        for i, (item, k) in enumerate(zip(batch, ks)):
            pending, item.pending = item.pending, None  # a pre-drafted block is for this step only
            if k <= 0:
                continue
            if pending is not None and len(pending):
                step.proposals[i] = truncated(pending, k)
            else:
                draft_rows.append(i)
        if not draft_rows:
            return
        # Room for proposals that cost no draft forward (prompt-lookup matches): up to
        # speculative_tokens_limit per row, within max_tokens, the context and the step's token
        # budget (`plan_step` reserved a pinned row's).
        limit = self.config.speculative_tokens_limit
        free = [i for i in draft_rows if step.pinned_max_tokens[i] is None]
        caps = {i: max(ks[i], batch[i].state.clamp_k(limit, self.max_context)) for i in free}
        if free and sum(caps[i] - ks[i] for i in free) > step.spare_tokens:
            caps = {i: min(caps[i], ks[i] + step.spare_tokens // len(free)) for i in free}
        caps.update({i: step.pinned_max_tokens[i] for i in draft_rows if step.pinned_max_tokens[i] is not None})
        rows = [self._draft_row(batch[i], list(batch[i].state.token_ids), ks[i], caps[i]) for i in draft_rows]
        try:
            results = self.draft.submit_propose(rows)()
        except Exception as e:  # noqa: BLE001 - the draft failed: these rows go on target-only
            results = [e] * len(rows)
        for i, result in zip(draft_rows, results):
            if isinstance(result, Exception):
                self._draft_failed(batch[i], result)
            else:
                step.proposals[i], step.drafted[i] = result, True
        step.draft_seconds = time.perf_counter() - step.started

    @staticmethod
    def _draft_row(item: ScheduledRequest, context: list[int], k: int, cap: int | None = None) -> DraftRow:
        return DraftRow(item.request_id, context, k, item.state.sampling, cap, cache_limit=item.limit,
                        cache_salt=item.request.cache_salt or "", reuse=item.reuse)

    def _submit_verify(self, step: Step):
        """Send every row's `[last committed, d1..dK]` to the target in one batched forward."""
        step.verify_started = time.perf_counter()
        step.rows = [self._verify_row(item, p) for item, p in zip(step.batch, step.proposals)]
        try:
            return self.target.submit_forward(step.rows)
        except Exception as e:  # noqa: BLE001
            self._fatal_or_fail(step.batch, e)
            return None

    @staticmethod
    def _verify_row(item: ScheduledRequest, p: Proposal) -> TargetRow:
        """`[last committed, d1..dK]`, verified where the target's logits are: a row that needs only
        the argmax gets the ids, any other its `VerifyResult` (`TargetPool.forward`)."""
        sampling = item.state.sampling
        argmax = verify.argmax_only(sampling)
        spec = None if argmax else VerifySpec(sampling, p.probs if not sampling.greedy and
                                              sampling.speculative_sampling == "residual" else None)
        return TargetRow(item.request_id, [item.state.token_ids[-1]] + p.token_ids, len(p) + 1,
                         len(item.state.token_ids) - 1, argmax, spec)

    def _pre_draft(self, step: Step) -> None:
        """While the target verifies, draft each pipelined row's next block as if this one is accepted
        whole (PEARL, arXiv 2408.11850)."""
        step.pre_drafting_rows = [i for i, (item, p) in enumerate(zip(step.batch, step.proposals))
                                  if item.pipeline and item.draft_ok and len(p)]
        if not step.pre_drafting_rows:
            return
        rows = [self._draft_row(step.batch[i], step.batch[i].state.token_ids + step.proposals[i].token_ids,
                                len(step.proposals[i]) + 1) for i in step.pre_drafting_rows]
        try:
            step.wait_pre_draft = self.draft.submit_propose(rows)
        except Exception as e:  # noqa: BLE001
            for i in step.pre_drafting_rows:
                self._draft_failed(step.batch[i], e)
            step.pre_drafting_rows = []

    def _verify(self, step: Step, wait_target: Callable[[], ForwardReply]) -> bool:
        """Accept each row's longest valid prefix: exactly (greedy) or by rejection sampling."""
        try:
            reply = wait_target()
        except Exception as e:  # noqa: BLE001
            self._fatal_or_fail(step.batch, e)
            return False
        step.verified = time.perf_counter()
        outputs, step.cache_lengths = reply.results, dict(enumerate(reply.cache_lengths))
        for i, (item, p, out) in enumerate(zip(step.batch, step.proposals, outputs)):
            if isinstance(out, Exception):
                self._finish(item, out)
                continue
            state = item.state
            try:
                step.results[i] = out if isinstance(out, verify.VerifyResult) else verify.verify_proposal(
                    p.token_ids, p.probs, out, state.sampling, len(state.token_ids), state.token_ids)
            except Exception as e:  # noqa: BLE001 - this request's processing failed; the batch goes on
                self._finish(item, e)
                continue
            step.verified_rows.append(i)
        return True

    def _commit(self, step: Step) -> None:
        """Commit each row's tokens through its stopping rules. Its target cache keeps the step's
        rejected tokens until the next forward drops them (`TargetPool.forward`)."""
        for i in step.verified_rows:
            step.chunks[i] = step.batch[i].state.commit(step.results[i].token_ids, step.results[i].logprobs)
            step.chunks[i].num_proposed = len(step.proposals[i])

    def _collect_pre_drafts(self, step: Step) -> None:
        """Keep a pre-drafted block where the whole proposal was accepted and it guessed the bonus token."""
        if step.wait_pre_draft is None:
            return
        batch, results = step.batch, step.results
        usable = [i for i in step.pre_drafting_rows if i in step.chunks and results[i].all_accepted
                  and not batch[i].state.finished]
        early = None
        if usable:
            try:
                early = step.wait_pre_draft()
            except Exception as e:  # noqa: BLE001
                for i in usable:
                    self._draft_failed(batch[i], e)
        for j, i in enumerate(step.pre_drafting_rows):
            proposal = early[j] if early is not None and isinstance(early[j], Proposal) else None
            hit = bool(i in usable and proposal is not None and proposal.token_ids
                       and proposal.token_ids[0] == results[i].token_ids[-1])
            if hit:
                batch[i].pending = pre_drafted_block(proposal)
            step.pre_drafts[i] = (hit, proposal)

    def _observe(self, step: Step) -> None:
        """The step's numbers, once, to everything that learns from them: the cost model (auto-K),
        each request's stats and K policy, and its observer (metrics)."""
        batch = step.batch
        self.batch_sizes[len(batch)] += 1
        verify_seconds = step.verified - step.verify_started
        self.costs.observe_target(sum(len(r.token_ids) for r in step.rows), verify_seconds)
        self.costs.observe_overhead(step.finished - step.verified)
        drafted = [step.proposals[i] for i in range(len(batch)) if step.drafted[i]]
        if drafted:
            forwards = max(p.num_forwards for p in drafted)
            catchup = max(p.num_catchup_tokens for p in drafted)
            seconds = [p.seconds for p in drafted if p.seconds is not None]
            drafting = seconds[0] if seconds else step.draft_seconds
            if not self.draft.capabilities.per_token:
                # A model-free lookup: paid once per step, whatever K.
                self.costs.observe_draft(1, 0.0)
                self.costs.observe_draft_call(step.draft_seconds)
            elif forwards and catchup <= 2:  # a long catch-up is a small prefill, not a draft step
                self.costs.observe_draft(forwards, drafting, rows=len(drafted))
                self.costs.observe_draft_call(max(0.0, step.draft_seconds - drafting))
        for i in step.verified_rows:
            item, p, result = batch[i], step.proposals[i], step.results[i]
            info = step.info(i, verify_seconds, item.state.stats.draft_failures)
            item.state.record_step(len(p), result.num_accepted, p.num_forwards,
                                   step.draft_seconds if step.drafted[i] else 0.0, verify_seconds)
            if info.pipeline_hit is not None:
                item.state.stats.pipeline_hits += info.pipeline_hit
                item.state.stats.pipeline_misses += not info.pipeline_hit
            item.policy.observe(len(p), result.num_accepted)
            if item.observer:
                item.observer.step(info)

    def _emit(self, step: Step) -> None:
        """Stream each row's new tokens; a finished row leaves the batch (caches freed first)."""
        for i in step.verified_rows:
            item, chunk = step.batch[i], step.chunks[i]
            if i in step.cache_lengths:
                chunk.cache_lengths = step.cache_lengths[i]
            if item.state.finished:
                chunk.output = item.state.output()
                self._finish(item, None, last=chunk)
            else:
                item.sink(chunk)

    def _draft_failed(self, item: ScheduledRequest, error: Exception) -> None:
        item.state.stats.draft_failures += 1
        item.draft_ok = False
        item.pending = None
        logger.warning("draft failed for request %s (%s: %s); it continues target-only", item.request_id,
                       error.__class__.__name__, str(error).splitlines()[0][:200] if str(error) else "")

    def _fatal_or_fail(self, items: Sequence[ScheduledRequest], error: Exception) -> None:
        if self.on_fatal is not None:
            error = self.on_fatal(error) or error
        for item in items:
            self._finish(item, error)

    def _finish(self, item: ScheduledRequest, error: Exception | None, last: StreamChunk | None = None) -> None:
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
            if item.admitted:
                item.admitted = False
                self.reserved -= item.reserved
                self._refit = True  # its cache became a cached prefix: the room to check again
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
