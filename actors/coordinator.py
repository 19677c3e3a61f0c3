"""The coordinator: runs the speculative loop of many requests at once over remote actors.

Per step of a request: ask the draft (its own worker actor, or the rank-0 shard that hosts it when
colocated) for K proposals, send [last token, proposals] to every
target shard for one verify forward, run acceptance (the core's `verify.py`), commit through the
core's `Sequence`, then rewind every shard's cache to the committed length and check that all
shards agree. Only orchestration lives here; the algorithm is the core's.

Pipelining (the post-verify overlap of PEARL, arXiv 2408.11850): while the shards verify block i,
the draft already drafts block i+1 assuming block i is accepted whole; its first token is its guess
of the bonus token. If verification accepts all of block i and the bonus token equals that guess,
the rest is the next proposal at no wait; otherwise it is dropped (the draft rewinds to the
committed prefix on its next call). Output is identical either way under greedy decoding and has the
same distribution under sampling. Requests are async tasks of one actor, so the draft works on one
request while the shards verify another.

Failures: a dead (separate) draft makes its requests finish target-only (K=0) and is restarted by
Ray for later ones; a colocated draft that raises does the same, and dies only with its shard; a failed shard fails the requests in flight with a clear error and the whole shard
group (and its process group) is rebuilt for the next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncIterator, Sequence

import ray

from actors.builder import create_draft_worker, create_target_group, kill_target_group, reserve_draft
from actors.config import RayEngineConfig
from actors.metrics import EngineMetrics, RequestMetrics, StepRecord
from specdec.config import SamplingParams
from specdec.models import check_same_vocabulary, load_tokenizer
from specdec.presets import short_name
from specdec.prompt import Prompt, resolve_prompt
from specdec.proposers import Proposal
from specdec.sequence import Sequence as GenSequence, StreamChunk
from specdec.speculation_length import CostModel, make_policy
from specdec.verify import verify_greedy_ids, verify_sampled

logger = logging.getLogger(__name__)


class TargetShardError(RuntimeError):
    """A target shard failed or died; the request cannot complete (the group is being rebuilt)."""


class RequestTimeout(TimeoutError):
    """The request ran past its `timeout_s`; it was stopped at a step boundary and its caches freed."""


#: A request cancelled within this many seconds of its deadline counts as a timeout, not a
#: cancellation (the caller enforcing the same deadline cancels it first).
_DEADLINE_SLACK_S = 1.0


class Coordinator:
    def __init__(self, config: RayEngineConfig, model_name: str | None = None, replica: str = "0") -> None:
        """`model_name` and `replica` label this engine's metrics (`actors/metrics.py`)."""
        self.config = config
        self.metrics = EngineMetrics(model_name or short_name(config.engine.target), replica, config.engine.k_max)
        self.tokenizer = None
        self.draft = None  # the separate draft worker actor (None when colocated or draft="none")
        self._draft_pg = None  # its placement group
        self.group = None  # actors.builder.TargetGroup
        self.info: dict = {}
        self.costs = CostModel()
        self._group_ready: asyncio.Event | None = None
        self._generation = 0  # bumped at every rebuild of the shard group
        self._active: set[str] = set()  # ids of the requests in flight
        self._last_progress = time.monotonic()  # when a shard call last completed
        # Every call to an actor is submitted from this one thread (see `_detached`).
        self._submitter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-submit")

    async def start(self) -> dict:
        """Load tokenizers, check the pair, start the shard group and the draft worker."""
        from specdec.cli import quiet_libraries

        quiet_libraries()
        engine = self.config.engine
        self.tokenizer = load_tokenizer(engine.target, engine.trust_remote_code)
        if engine.draft not in ("ngram", "none"):
            check_same_vocabulary(self.tokenizer, load_tokenizer(engine.draft, engine.trust_remote_code),
                                  engine.target, engine.draft)
        self._group_ready = asyncio.Event()
        separate = engine.draft != "none" and not self.config.colocated
        if separate:  # both roles' resources before any model loads
            self._draft_pg = await reserve_draft(self.config)
        self.group = await create_target_group(self.config)
        self.info = self.group.info
        self._group_ready.set()
        if separate:
            self.draft = create_draft_worker(self.config, self.info["vocab_size"], self._draft_pg)
            await self.draft.ready.remote()
        self.info = {**self.info, "draft_placement": self.config.draft_placement if engine.draft != "none" else None,
                     "pipeline": self.config.pipeline}
        return self.info

    @property
    def has_draft(self) -> bool:
        return self.config.colocated or self.draft is not None

    def _drafter(self, group):
        """The actor that proposes for requests on `group`: the draft worker, or shard 0 (colocated)."""
        return group.shards[0] if self.config.colocated else self.draft

    def shutdown(self) -> None:
        self._submitter.shutdown(wait=False)
        kill_target_group(self.group)
        self.group = None
        if self.draft is not None:
            ray.kill(self.draft, no_restart=True)
            self.draft = None
        if self._draft_pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._draft_pg)
            self._draft_pg = None

    # --------------------------------------------------------------------------- inspection

    def handles(self) -> dict:
        shards = list(self.group.shards) if self.group else []
        draft = shards[0] if self.config.colocated and shards else self.draft
        return {"draft": draft, "shards": shards}

    async def cache_lengths(self, request_id: str) -> list:
        return await asyncio.gather(*[s.cache_length.remote(request_id) for s in self.group.shards])

    async def check_health(self, stall_s: float = 60.0, timeout_s: float = 20.0) -> None:
        """Raise if the engine is stuck or an actor is gone. Under load the shards are busy and a
        ping would queue behind the forwards, so progress (a shard call completed within `stall_s`)
        is the proof of life; idle, every actor must answer a ping within `timeout_s`."""
        if self._active:
            stalled = time.monotonic() - self._last_progress
            if stalled > stall_s:
                raise RuntimeError(f"no shard call completed for {stalled:.0f}s with {len(self._active)} requests "
                                   "in flight")
            return
        await self.request_counts(timeout_s)

    async def request_counts(self, timeout_s: float = 10.0) -> dict:
        """Requests holding state, per place: here (in flight), on each shard (KV caches, and draft
        states when colocated) and in the separate draft worker. Every actor answers, or this raises:
        it doubles as the health check of the group."""
        refs = [s.num_requests.remote() for s in self.group.shards]
        if self.draft is not None:
            refs.append(self.draft.num_requests.remote())
        counts = await asyncio.wait_for(asyncio.gather(*refs), timeout_s)
        return {"coordinator": len(self._active), "shards": counts[:len(self.group.shards)],
                "draft": counts[len(self.group.shards)] if self.draft is not None else None}

    # ---------------------------------------------------------------------------- requests

    async def generate_stream(self, prompt: Prompt | None = None, prompt_token_ids: Sequence[int] | None = None,
                              sampling: SamplingParams | None = None, chat: bool = False,
                              request_id: str | None = None, num_speculative_tokens: int | str | None = None,
                              pipeline: bool | None = None, timeout_s: float | None = None
                              ) -> AsyncIterator[StreamChunk]:
        """`prompt` is text, or with `chat` a list of {"role", "content"} messages (or pass the ids);
        `num_speculative_tokens` (an int, "auto", or 0 for target-only) and `pipeline` override the
        engine's settings for this request. Past `timeout_s` the request raises `RequestTimeout` at
        its next step."""
        sampling = sampling or SamplingParams()
        policy = make_policy(self.config.engine, self.costs, num_speculative_tokens, has_draft=self.has_draft)
        # Pipelining needs a draft in a process of its own; a colocated draft ignores the request.
        pipeline = self.config.pipeline if pipeline is None else (pipeline and self.draft is not None)
        ids, sampling = resolve_prompt(self.tokenizer, prompt, prompt_token_ids, chat, sampling,
                                       self.info["vocab_size"], self.info["max_context"], self.config.engine.target)
        deadline = time.monotonic() + timeout_s if timeout_s is not None else None
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._active:
            raise ValueError(f"request id {request_id!r} is already in flight")
        record = self.metrics.arrived(request_id)
        finish_reason = None
        try:
            await self._group_ready.wait()
            if request_id in self._active:
                raise ValueError(f"request id {request_id!r} is already in flight")
            record.started()
            steps = self._run(request_id, ids, sampling, policy, pipeline, deadline, record)
            async with contextlib.aclosing(steps):  # a closed stream frees the caches now, not at GC
                async for chunk in steps:
                    finish_reason = chunk.finish_reason
                    yield chunk
        except RequestTimeout:
            finish_reason = "timeout"
            raise
        except (asyncio.CancelledError, GeneratorExit):
            if finish_reason is None:  # closed after its last chunk: it finished
                late = deadline is not None and time.monotonic() >= deadline - _DEADLINE_SLACK_S
                finish_reason = "timeout" if late else "cancelled"
            raise
        finally:
            record.finished(finish_reason or "error")

    async def _run(self, request_id, ids, sampling, policy, pipeline, deadline, record: RequestMetrics):
        group, generation = self.group, self._generation
        seq = GenSequence(ids, sampling, self.tokenizer, frozenset(self.info["eos_token_ids"]))
        draft_ok = self.has_draft
        self._active.add(request_id)
        try:
            if len(ids) > 1:
                await self._forward(group, generation, request_id, ids[:-1], 1, 0, greedy=True)
            seq.prefill_seconds = time.perf_counter() - seq.started
            record.prefilled(len(ids), len(ids) - 1)
            pending: Proposal | None = None
            while not seq.finished:
                if deadline is not None and time.monotonic() > deadline:
                    raise RequestTimeout(f"request {request_id} ran past its timeout after "
                                         f"{seq.num_output_tokens} tokens")
                chunk, pending, draft_ok = await self._step(request_id, seq, policy, group, generation, pending,
                                                            draft_ok, pipeline, record)
                if seq.finished:
                    chunk.output = seq.output()
                yield chunk
        finally:
            self._active.discard(request_id)
            await self._release(group, request_id)

    async def _step(self, request_id, seq: GenSequence, policy, group, generation, pending, draft_ok, pipeline,
                    record: RequestMetrics):
        sampling = seq.sampling
        k = seq.clamp_k(policy.next_k(), self.info["max_context"]) if draft_ok else 0
        failures = seq.stats.draft_failures
        t0 = time.perf_counter()
        proposal, drafted = Proposal([]), False
        drafter = self._drafter(group) if draft_ok else None
        if k > 0:
            if pending is not None and len(pending):
                proposal = _truncate(pending, k)
            else:
                try:
                    proposal = await (await self._detached(
                        lambda: drafter.propose.remote(request_id, seq.token_ids, k, sampling)))
                    drafted = True
                except ray.exceptions.RayError as e:
                    draft_ok = self._draft_failed(seq, e)
        t1 = time.perf_counter()
        inputs = [seq.token_ids[-1]] + proposal.token_ids
        verify = await self._submit(group, "forward", request_id, inputs, len(inputs), len(seq.token_ids) - 1,
                                    sampling.greedy)
        predraft = None
        if pipeline and draft_ok and len(proposal):
            context = seq.token_ids + proposal.token_ids
            predraft = await self._detached(
                lambda: drafter.propose.remote(request_id, context, len(proposal) + 1, sampling))
        target_out = (await self._await_shards(verify, generation, "verification"))[0]
        t2 = time.perf_counter()
        if sampling.greedy:
            result = verify_greedy_ids(proposal.token_ids, target_out)
        else:
            from specdec.sampling import logits_to_probs

            result = verify_sampled(proposal.token_ids, proposal.probs, logits_to_probs(target_out, sampling),
                                    seq.verify_generator)
        cached = len(seq.token_ids) - 1 + len(inputs)  # target cache after the verify forward
        chunk = seq.commit(result.token_ids)
        chunk.num_proposed = len(proposal)
        if not seq.finished:
            chunk.cache_lengths = await self._rewind(group, generation, request_id, len(seq.token_ids) - 1)
        step = StepRecord(k=k, num_proposed=len(proposal), num_accepted=result.num_accepted,
                          num_committed=len(chunk.token_ids), verify_seconds=t2 - t1,
                          draft_seconds=t1 - t0 if drafted else None)
        if chunk.cache_lengths:
            step.target_cache_tokens = chunk.cache_lengths[0]
            step.target_rewound_tokens = cached - chunk.cache_lengths[0]
        if drafted:
            step.draft_rewound_tokens, step.draft_cache_tokens = proposal.rewound_tokens, proposal.cache_tokens
        next_pending = None
        if predraft is not None:
            if result.all_accepted and not seq.finished:
                try:
                    early = await predraft
                except ray.exceptions.RayError as e:
                    draft_ok = self._draft_failed(seq, e)
                else:
                    step.draft_rewound_tokens += early.rewound_tokens
                    step.draft_cache_tokens = early.cache_tokens
                    if early.token_ids and early.token_ids[0] == result.token_ids[-1]:
                        next_pending = Proposal(early.token_ids[1:],
                                                early.probs[1:] if early.probs is not None else None)
            if next_pending is not None:
                seq.stats.pipeline_hits += 1
            else:
                seq.stats.pipeline_misses += 1
            step.pipeline_hit = next_pending is not None
        step.draft_failures = seq.stats.draft_failures - failures
        record.step(step)
        t3 = time.perf_counter()
        seq.record_step(len(proposal), result.num_accepted, proposal.num_forwards, t1 - t0, t2 - t1)
        policy.observe(len(proposal), result.num_accepted)
        self.costs.observe_target(len(inputs), t2 - t1)
        self.costs.observe_overhead(t3 - t2)
        if drafted and proposal.num_catchup_tokens <= 2:
            # Drafting time is paid per proposed token, the call's round trip once per drafting step.
            drafting = proposal.seconds if proposal.seconds is not None else t1 - t0
            self.costs.observe_draft(max(1, proposal.num_forwards), drafting)
            self.costs.observe_draft_call(max(0.0, (t1 - t0) - drafting))
        return chunk, next_pending, draft_ok

    def _draft_failed(self, seq: GenSequence, error: Exception) -> bool:
        seq.stats.draft_failures += 1
        logger.warning("draft worker failed (%s); the request continues target-only", error.__class__.__name__)
        return False

    # ------------------------------------------------------------------------------ shards

    async def _detached(self, submit):
        """Run `submit` (which calls `.remote()`) on the submitter thread and return its refs.

        Outside the request's own task context the calls are not Ray children of the request, so
        cancelling the request (Ray Serve cancels the replica's task, recursively, when a client goes
        away or times out) does not cancel them: an actor call interrupted midway would leave one
        shard out of a collective the others are waiting in. The request's coroutine still stops at
        its next await, and its `finally` frees the caches. One thread keeps each batch of calls to
        all shards contiguous, so every shard sees calls in the same order."""
        return await asyncio.get_running_loop().run_in_executor(self._submitter, submit)

    async def _submit(self, group, method: str, *args) -> list:
        """Submit one call to every shard before awaiting any, so all shards see calls in one order
        (Ray runs an actor's calls from one caller in submission order)."""
        return await self._detached(lambda: [getattr(s, method).remote(*args) for s in group.shards])

    async def _forward(self, group, generation, request_id, token_ids, num_logits, expected_length, greedy):
        refs = await self._submit(group, "forward", request_id, token_ids, num_logits, expected_length, greedy)
        return (await self._await_shards(refs, generation, "prefill"))[0]

    async def _rewind(self, group, generation, request_id, length):
        refs = await self._submit(group, "rewind", request_id, length)
        lengths = await self._await_shards(refs, generation, "rewind")
        if any(n != length for n in lengths):
            await self._rebuild(generation, f"cache lengths {lengths} after rewinding to {length}")
            raise TargetShardError(f"target shards disagree after a rewind: cache lengths {lengths}, committed "
                                   f"length {length}; the shard group is being rebuilt")
        return lengths

    async def _await_shards(self, refs, generation, what):
        try:
            results = await asyncio.gather(*refs)
            self._last_progress = time.monotonic()
            return results
        except ray.exceptions.RayError as e:
            await self._rebuild(generation, f"{what} failed: {e.__class__.__name__}")
            raise TargetShardError(
                f"a target shard failed during {what} ({e.__class__.__name__}: {_first_line(e)}); the request "
                "was aborted and the shard group is being rebuilt for the next request"
            ) from None

    async def _rebuild(self, generation: int, reason: str) -> None:
        """Replace the whole shard group (its process group cannot lose a member)."""
        if generation != self._generation:
            return  # another request already rebuilt it
        self._generation += 1
        self._group_ready.clear()
        logger.warning("rebuilding the target shard group: %s", reason)
        old = self.group
        kill_target_group(old)
        try:
            self.group = await create_target_group(self.config)
        finally:
            self._group_ready.set()

    async def _release(self, group, request_id: str) -> None:
        draft = self.draft
        refs = await self._detached(lambda: [s.release.remote(request_id) for s in group.shards]
                                    + ([draft.release.remote(request_id)] if draft is not None else []))
        for ref in refs:
            try:
                await asyncio.wait_for(ref, timeout=10)
            except Exception:  # noqa: BLE001 - a dead actor holds no state to free
                pass


def _truncate(proposal: Proposal, k: int) -> Proposal:
    if len(proposal) <= k:
        return proposal
    probs = proposal.probs[:k] if proposal.probs is not None else None
    return Proposal(proposal.token_ids[:k], probs)


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else ""
