"""The coordinator: drives the core's batch scheduler over remote actors.

The loop is the core's (`specdec.engine.scheduler.Scheduler`: continuous batching, one batched draft call
and one batched verify forward per step, acceptance, commit, rewind); this actor only moves its
inputs and outputs. Its adapters (`actors/remote.py`) send each scheduler call to the actors that run
it: a batched forward or rewind to every target shard (all shards get the same calls in the same
order: one scheduler thread submits them all, each to every shard before awaiting any), a batched
proposal to the draft worker (or to the rank-0 shard that hosts the draft when colocated). The shard
group is kept up by `actors.groups.TargetGroupSupervisor`. Requests are async tasks of this actor
that stream what the scheduler commits (`specdec.engine.streams.stream_async`, as the in-process
engine does).

Pipelining (the post-verify overlap of PEARL, arXiv 2408.11850) pays when the draft runs in a
process of its own: while the shards verify step i, the draft worker already drafts step i+1 of
every pipelined row, assuming its block is accepted whole; the scheduler uses a row's pre-drafted
block when its proposal was accepted and the guessed bonus token was right, and drops it otherwise
(the draft rewinds to the committed prefix on its next call). Output is identical either way under
greedy decoding and has the same distribution under sampling. A colocated draft shares the shard's
cores, so it never pre-drafts.

Failures: a draft that fails makes its requests continue target-only (K=0); Ray restarts a dead
separate draft for later requests. A row's own error (its slot of a batched call holds the
exception) fails that request alone. A dead shard fails the requests of the step with a clear
error, and the whole shard group (and its process group) is rebuilt before the next step; any
other exception from a shard call fails that step's requests without a rebuild.

Health (`check_health`, Serve's replica check): a slow engine is healthy, a stuck one is not. One
forward on a busy CPU or a long prefill chunk can outlast any fixed wait for a shard call, so when
none has completed for `health_stall_s` the check asks every actor for its progress (decoder layers
finished, `specdec.engine.progress`; answered mid-forward by a thread of the actor's own): a dead or silent
actor fails the check, layers finishing mean slow, and no layer for `health_stall_s` means stuck. A
shard group being rebuilt is recovering: the check passes while the rebuild runs (its placement and
process-group set-up have timeouts of their own), and fails if the rebuild failed, so Serve replaces
the replica then, not while it is mending itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator

import ray

from actors.config import RayEngineConfig
from actors.groups import (HEALTH_GROUP, TargetGroupSupervisor, TargetShardError, check_tp_divides,
                           create_draft_worker, expected_vocab_size, reserve_draft, target_config)
from actors.metrics import GAUGE_REFRESH_S, EngineMetrics, request_features
from actors.remote import RemoteDraft, RemoteTarget
from specdec.kernels.calibration import runtime_check
from specdec.kernels.linear import VERIFY_TOKENS
from specdec.models.loading import check_same_vocabulary, load_tokenizer
from specdec.models.presets import short_name
from specdec.engine.prompt import PromptResolver
from specdec.decoding.proposers import NON_MODEL_DRAFTS
from specdec.engine.request import Cancelled, GenerationRequest, RequestTimeout
from specdec.engine.scheduler import Scheduler
from specdec.engine.step import StepInfo
from specdec.engine.streams import stream_async
from specdec.engine.request_state import StreamChunk
from specdec.decoding.speculation_length import CostModel

logger = logging.getLogger(__name__)

__all__ = ["Cancelled", "Coordinator", "RequestTimeout", "TargetShardError"]

#: A request cancelled within this many seconds of its deadline counts as a timeout, not a
#: cancellation (the caller enforcing the same deadline cancels it first).
_DEADLINE_SLACK_S = 1.0

#: What means an actor is gone (its process died or cannot be reached), as opposed to a call that raised.
_ACTOR_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


class Coordinator:
    def __init__(self, config: RayEngineConfig, model_name: str | None = None, replica: str = "0") -> None:
        """`model_name` and `replica` label this engine's metrics (`actors/metrics.py`)."""
        self.config = config
        self.metrics = EngineMetrics(model_name or short_name(config.engine.target), replica,
                                     config.engine.speculative_tokens_limit)
        self.tokenizer = None
        self.prompts: PromptResolver | None = None  # set up in start()
        self.draft = None  # the separate draft worker actor (None when colocated or draft="none")
        self._draft_pg = None  # its placement group
        self.shard_group = TargetGroupSupervisor(config)
        self.info: dict = {}
        self.costs = CostModel()
        self.scheduler: Scheduler | None = None
        self.calibration_check = runtime_check(None, None, VERIFY_TOKENS)  # set up in start()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._gauges: asyncio.Task | None = None  # re-sets the metrics' gauges (`_refresh_gauges`)

    async def start(self) -> dict:
        """Load tokenizers, check the pair and the target's config, start the shard group and the
        draft worker (loading at the same time when the config gives the target's vocabulary size),
        then the scheduler."""
        from specdec.config import quiet_libraries

        quiet_libraries()
        self._gauges = asyncio.create_task(self._refresh_gauges())
        if self.config.gpu_defaults:  # where the draft goes depends on the nodes' GPUs
            from actors.placement import cluster_nodes, resolve

            self.config = resolve(self.config, cluster_nodes())
            self.shard_group = TargetGroupSupervisor(self.config)
        engine = self.config.engine
        self.tokenizer = load_tokenizer(engine.target, engine.trust_remote_code)
        if engine.draft not in NON_MODEL_DRAFTS:
            check_same_vocabulary(self.tokenizer, load_tokenizer(engine.draft, engine.trust_remote_code),
                                  engine.target, engine.draft)
        model_config = target_config(self.config)
        check_tp_divides(model_config, self.config.tp)
        separate = engine.draft != "none" and not self.config.colocated
        vocab_size = expected_vocab_size(model_config)
        if separate:  # both roles' resources before any model loads
            self._draft_pg = await reserve_draft(self.config)
            if vocab_size is not None:  # the draft loads while the target does
                self.draft = create_draft_worker(self.config, vocab_size, self._draft_pg)
        try:
            self.info = await self.shard_group.start()
        except BaseException:
            if self.draft is not None:
                ray.kill(self.draft, no_restart=True)
            raise
        if separate:
            if self.draft is not None and vocab_size != self.info["vocab_size"]:  # the config did not tell
                ray.kill(self.draft, no_restart=True)
                self.draft = None
            if self.draft is None:
                self.draft = create_draft_worker(self.config, self.info["vocab_size"], self._draft_pg)
            await self.draft.ready.remote()
            if engine.draft != "ngram":  # the separate draft measured its own precision
                calibration = {**self.info["calibration"], "draft_precision": await self.draft.calibration.remote()}
                self.info = {**self.info, "calibration": calibration}
        calibration = self.info["calibration"]
        self.calibration_check = runtime_check(calibration["linear_kernel"], calibration["draft_precision"],
                                               VERIFY_TOKENS)
        self.info = {**self.info, "draft_placement": self.config.draft_placement if engine.draft != "none" else None,
                     "pipeline": self.config.pipeline and separate,
                     "max_batch_size": engine.max_batch_size}
        self.metrics.engine_started(self.info)
        # The scheduler thread's ray.get calls do not block this actor's event loop (as Ray Train's).
        os.environ["RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"] = "0"
        self.prompts = PromptResolver(self.tokenizer, self.info["vocab_size"], self.info["max_context"],
                                      engine.target, tuple(self.info["eos_token_ids"]), engine.trust_remote_code)
        draft = RemoteDraft(self.draft, self.shard_group, pipeline=self.config.pipeline,
                            per_token=engine.draft != "ngram") if self.has_draft else None
        self.scheduler = Scheduler(engine, RemoteTarget(self.shard_group), draft, self.prompts, costs=self.costs,
                                   on_fatal=self._on_fatal, budget=await self._budget())
        self._thread = threading.Thread(target=self._drive, name="specdec-scheduler", daemon=True)
        self._thread.start()
        return self.info

    async def _budget(self):
        """The replica's KV budget (`kv_cache_memory`, a fraction of the memory available once the
        actors have loaded) over the whole target's and the draft's cost per token. On GPUs each of the
        tp shards holds 1/tp of the KV, so the fullest GPU bounds it; on CPUs the shards share the host."""
        from specdec.engine.budget import KVBudget, budget_bytes

        free = self.info.get("available_memory") or [None]
        available = None if None in free else min(free)
        if available is not None and str(self.info.get("device", "")).startswith("cuda"):
            available *= len(free)
        total = budget_bytes(self.config.engine.kv_cache_memory, available)
        if total is None:
            return None
        draft = self.info.get("draft_kv_layout")
        if self.draft is not None:
            draft = await self.draft.kv_layout.remote()
        return KVBudget(total, self.info["kv_layout"], draft)

    @property
    def has_draft(self) -> bool:
        return self.config.engine.draft != "none" and (self.config.colocated or self.draft is not None)

    def _drive(self) -> None:
        """The scheduler's thread: every actor call is submitted from here (see the module docstring)."""
        self.scheduler.drive(stop=lambda: self._stopping, after_step=self._after_step)

    def _after_step(self) -> None:
        self.shard_group.rebuild_if_broken()
        self.calibration_check.after_step(self.costs)

    async def _refresh_gauges(self) -> None:
        """Re-set the metrics' gauges on this event loop (where the request events record them too),
        busy or idle: Ray drops a gauge that is not set again (`actors/metrics.py` says why)."""
        while True:
            await asyncio.sleep(GAUGE_REFRESH_S)
            try:
                if self.scheduler is not None:
                    self.metrics.kv(self.scheduler.kv_usage, self.scheduler.prefix_evictions)
                self.metrics.refresh()
            except Exception:  # noqa: BLE001 - keep refreshing: a stopped task would blank the gauges
                logger.exception("re-setting the metrics' gauges failed")

    def shutdown(self) -> None:
        self._stopping = True
        if self._gauges is not None:
            with contextlib.suppress(RuntimeError):  # its loop is closed: the task went with it
                self._gauges.get_loop().call_soon_threadsafe(self._gauges.cancel)  # shutdown may run off the loop
            self._gauges = None
        if self.scheduler is not None:
            self.scheduler.wake()
        if self.scheduler is not None:
            self.scheduler.fail_all(RuntimeError("the engine is shutting down"))
        self.shard_group.shutdown()
        if self.draft is not None:
            ray.kill(self.draft, no_restart=True)
            self.draft = None
        if self._draft_pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._draft_pg)
            self._draft_pg = None

    # --------------------------------------------------------------------------- inspection

    def handles(self) -> dict:
        group = self.shard_group.group
        shards = list(group.shards) if group else []
        draft = shards[0] if self.config.colocated and shards else self.draft
        return {"draft": draft, "shards": shards}

    def batch_sizes(self) -> dict[int, int]:
        """Steps run so far at each batch size (benchmarks and tests)."""
        return dict(self.scheduler.batch_sizes) if self.scheduler else {}

    async def check_health(self, stall_s: float | None = None, timeout_s: float = 10.0) -> str:
        """Raise if an actor is gone or the engine is stuck; else say how it is: "idle", "busy" or
        "slow". Idle, every actor must answer within `timeout_s` (`request_counts`). Under load a
        ping would queue behind the forwards, so a shard call completed within `stall_s` (default:
        the config's `health_stall_s`) is the proof of life. Failing that, every actor reports its
        `progress` from a thread of its own, mid-forward (`specdec.engine.progress`): one that is dead fails
        the check at once, one silent for `timeout_s` fails it then; a decoder layer finished (or a
        call begun or ended) anywhere within `stall_s` means slow but progressing; none means stuck."""
        stall_s = self.config.health_stall_s if stall_s is None else stall_s
        if self.shard_group.group is None and self.shard_group.rebuilding:
            logger.info("health check during a shard group rebuild (%s): recovering, not failed",
                        self.shard_group.broken)
            return "rebuilding"
        num_active = self.scheduler.num_active if self.scheduler is not None else 0
        if not num_active:
            await self.request_counts(timeout_s)
            return "idle"
        since_call_s = time.monotonic() - self.shard_group.last_progress
        if since_call_s <= stall_s:
            return "busy"
        progress = await self._ask("progress", timeout_s, HEALTH_GROUP)
        quiet_s = min([since_call_s, *(p["quiet_s"] for p in progress.values())])
        layers = ", ".join(f"{name}: {p['num_layers']}" for name, p in progress.items())
        if quiet_s <= stall_s:
            logger.info("no shard call completed for %.0fs with %d requests in flight, but the engine is slow, not "
                        "stuck: its last progress was %.1fs ago (decoder layers run so far: %s)", since_call_s,
                        num_active, quiet_s, layers)
            return "slow"
        running = "; ".join(f"{name} has been in {p['call']} for {p['call_s']:.0f}s"
                            for name, p in progress.items() if p["call"] is not None)
        raise RuntimeError(f"the engine is stuck: no decoder layer finished for {quiet_s:.0f}s (limit {stall_s:.0f}s) "
                           f"with {num_active} requests in flight; {running or 'no actor is running a call'} "
                           f"(decoder layers run so far: {layers})")

    async def request_counts(self, timeout_s: float = 10.0) -> dict:
        """Requests holding state, per place: here (in flight), on each shard (KV caches, and draft
        states when colocated) and in the separate draft worker. Every actor answers, or this raises:
        it doubles as the health check of the group."""
        counts = await self._ask("num_requests", timeout_s)
        return {"coordinator": self.scheduler.num_active if self.scheduler else 0,
                "shards": [n for name, n in counts.items() if name.startswith("target shard")],
                "draft": counts.get("draft worker")}

    async def _ask(self, method: str, timeout_s: float, concurrency_group: str | None = None) -> dict:
        """Every actor's answer to `method`, by name ("target shard <rank>", "draft worker"). Raises a
        RuntimeError naming the actors that are dead (at once) or did not answer within `timeout_s`."""
        group = self.shard_group.group
        if group is None:
            raise TargetShardError("the target shard group is down: a shard failed and the group is being rebuilt "
                                   "(or could not be)")
        actors = {f"target shard {rank}": shard for rank, shard in enumerate(group.shards)}
        if self.draft is not None:
            actors["draft worker"] = self.draft
        futures = {}
        for name, actor in actors.items():
            call = getattr(actor, method)
            call = call.options(concurrency_group=concurrency_group) if concurrency_group else call
            futures[name] = asyncio.wrap_future(call.remote().future())
            futures[name].add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, even if late
        _, pending = await asyncio.wait(futures.values(), timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
        failed = {name: f.exception() for name, f in futures.items() if f.done() and f.exception() is not None}
        if failed:
            raise RuntimeError("; ".join(f"{name} is {'dead' if isinstance(e, _ACTOR_GONE) else 'failing'} "
                                         f"({e.__class__.__name__}: {_first_line(e)})" for name, e in failed.items()))
        if pending:
            silent = [name for name, f in futures.items() if not f.done()]
            raise RuntimeError(f"{', '.join(silent)} did not answer {method} within {timeout_s:.0f}s: a wedged or "
                               "overloaded process")
        return {name: f.result() for name, f in futures.items()}

    # ---------------------------------------------------------------------------- requests

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        """Stream one request's chunks (see `specdec.engine.request.GenerationRequest`). Past its `timeout_s`
        the request raises `RequestTimeout` at its next step."""
        # In a thread: a structured-output request compiles its grammar here (the first one also builds
        # the grammar engine's view of the vocabulary, seconds), off the actor's event loop.
        ids, sampling = await asyncio.to_thread(self.prompts, request)
        if request.pipeline is not None and self.draft is None:
            request.pipeline = False  # pipelining needs a draft in a process of its own
        deadline = time.monotonic() + request.timeout_s if request.timeout_s is not None else None
        record = self.metrics.arrived(request.request_id, request_features(sampling, bool(request.tools)))
        if not self.scheduler.num_active:  # the health check's stall clock starts when work arrives
            self.shard_group.last_progress = time.monotonic()
        finish_reason = None
        try:
            async with contextlib.aclosing(stream_async(self.scheduler, request, ids, sampling,
                                                        observer=_OnLoop(record))) as chunks:
                async for chunk in chunks:
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

    # ------------------------------------------------------------------------------ faults

    def _on_fatal(self, error: Exception) -> Exception:
        """A whole shard call failed (scheduler thread): drop the group if an actor is gone (it is
        rebuilt after the step), and say what failed."""
        if isinstance(error, TargetShardError):
            return error
        if isinstance(error, _ACTOR_GONE):
            self.shard_group.drop(f"{error.__class__.__name__}")
            return TargetShardError(
                f"a target shard failed: its actor is gone ({error.__class__.__name__}: {_first_line(error)}); the "
                "requests of this step were aborted and the shard group is rebuilt for the next ones")
        if isinstance(error, ray.exceptions.RayError):
            return TargetShardError(f"a target shard call failed ({error.__class__.__name__}: {_first_line(error)})")
        return error


class _OnLoop:
    """A request's metrics (`RequestObserver`) told from the scheduler's thread, recorded on the
    actor's event loop, where the request's other events are recorded (metrics stay single-threaded)."""

    def __init__(self, record) -> None:
        self.record, self.loop = record, asyncio.get_running_loop()

    def started(self) -> None:
        self.loop.call_soon_threadsafe(self.record.started)

    def prefilled(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.loop.call_soon_threadsafe(self.record.prefilled, num_prompt_tokens, num_cached_tokens)

    def step(self, info: StepInfo) -> None:
        self.loop.call_soon_threadsafe(self.record.step, info)


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else ""
