"""The coordinator: drives the core's batch scheduler over remote actors.

The loop is the core's (`specdec.scheduler.Scheduler`: continuous batching, one batched draft call
and one batched verify forward per step, acceptance, commit, rewind); this actor only moves its
inputs and outputs. Its adapters send each scheduler call to the actors that run it: a batched
forward or rewind to every target shard (all shards get the same calls in the same order: one
scheduler thread submits them all, each to every shard before awaiting any), a batched proposal to
the draft worker (or to the rank-0 shard that hosts the draft when colocated). Requests are async
tasks of this actor that feed the scheduler and stream what it commits.

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
from actors.groups import create_draft_worker, create_target_group, kill_target_group, reserve_draft
from actors.metrics import EngineMetrics
from specdec.models import check_same_vocabulary, load_tokenizer
from specdec.presets import short_name
from specdec.prompt import resolve_prompt
from specdec.request import GenerationRequest, RequestTimeout
from specdec.scheduler import Cancelled, Scheduler, received
from specdec.sequence import StreamChunk
from specdec.speculation_length import CostModel

logger = logging.getLogger(__name__)

__all__ = ["Coordinator", "RequestTimeout", "TargetShardError"]


class TargetShardError(RuntimeError):
    """A target shard failed or died; the request cannot complete."""


#: A request cancelled within this many seconds of its deadline counts as a timeout, not a
#: cancellation (the caller enforcing the same deadline cancels it first).
_DEADLINE_SLACK_S = 1.0

#: What means an actor is gone (its process died or cannot be reached), as opposed to a call that raised.
_ACTOR_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


class Coordinator:
    def __init__(self, config: RayEngineConfig, model_name: str | None = None, replica: str = "0") -> None:
        """`model_name` and `replica` label this engine's metrics (`actors/metrics.py`)."""
        self.config = config
        self.metrics = EngineMetrics(model_name or short_name(config.engine.target), replica, config.engine.k_max)
        self.tokenizer = None
        self.draft = None  # the separate draft worker actor (None when colocated or draft="none")
        self._draft_pg = None  # its placement group
        self.group = None  # actors.groups.TargetGroup
        self.info: dict = {}
        self.costs = CostModel()
        self.scheduler: Scheduler | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._last_progress = time.monotonic()  # when a shard call last completed

    async def start(self) -> dict:
        """Load tokenizers, check the pair, start the shard group and the draft worker, then the scheduler."""
        from specdec.cli import quiet_libraries

        quiet_libraries()
        engine = self.config.engine
        self.tokenizer = load_tokenizer(engine.target, engine.trust_remote_code)
        if engine.draft not in ("ngram", "none"):
            check_same_vocabulary(self.tokenizer, load_tokenizer(engine.draft, engine.trust_remote_code),
                                  engine.target, engine.draft)
        separate = engine.draft != "none" and not self.config.colocated
        if separate:  # both roles' resources before any model loads
            self._draft_pg = await reserve_draft(self.config)
        self.group = await create_target_group(self.config)
        self.info = self.group.info
        if separate:
            self.draft = create_draft_worker(self.config, self.info["vocab_size"], self._draft_pg)
            await self.draft.ready.remote()
        self.info = {**self.info, "draft_placement": self.config.draft_placement if engine.draft != "none" else None,
                     "pipeline": self.config.pipeline and separate,
                     "max_batch_size": engine.max_batch_size}
        self._loop = asyncio.get_running_loop()
        # The scheduler thread's ray.get calls do not block this actor's event loop (as Ray Train's).
        os.environ["RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"] = "0"
        self.scheduler = Scheduler(engine, _RemoteTarget(self), _RemoteDraft(self) if self.has_draft else None,
                                   tokenizer=self.tokenizer, eos_token_ids=self.info["eos_token_ids"],
                                   vocab_size=self.info["vocab_size"], max_context=self.info["max_context"],
                                   costs=self.costs, on_fatal=self._on_fatal)
        self._thread = threading.Thread(target=self._drive, name="specdec-scheduler", daemon=True)
        self._thread.start()
        return self.info

    @property
    def has_draft(self) -> bool:
        return self.config.engine.draft != "none" and (self.config.colocated or self.draft is not None)

    def _drive(self) -> None:
        """The scheduler's thread: every actor call is submitted from here (see the module docstring)."""
        while not self._stopping:
            if not self.scheduler.wait_for_work(timeout=1.0):
                continue
            try:
                self.scheduler.run_once()
            except Exception as e:  # noqa: BLE001 - a bug in a step: fail what is held, keep serving
                logger.exception("scheduler step failed")
                self.scheduler.fail_all(e)

    def shutdown(self) -> None:
        self._stopping = True
        if self.scheduler is not None:
            self.scheduler.wake()
        if self.scheduler is not None:
            self.scheduler.fail_all(RuntimeError("the engine is shutting down"))
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

    def batch_sizes(self) -> dict[int, int]:
        """Steps run so far at each batch size (benchmarks and tests)."""
        return dict(self.scheduler.batch_sizes) if self.scheduler else {}

    async def cache_lengths(self, request_id: str) -> list:
        return await asyncio.gather(*[s.cache_length.remote(request_id) for s in self.group.shards])

    async def check_health(self, stall_s: float = 60.0, timeout_s: float = 20.0) -> None:
        """Raise if the engine is stuck or an actor is gone. Under load the shards are busy and a
        ping would queue behind the forwards, so progress (a shard call completed within `stall_s`)
        is the proof of life; idle, every actor must answer a ping within `timeout_s`."""
        if self.scheduler is not None and self.scheduler.num_active:
            stalled = time.monotonic() - self._last_progress
            if stalled > stall_s:
                raise RuntimeError(f"no shard call completed for {stalled:.0f}s with {self.scheduler.num_active} "
                                   "requests in flight")
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
        return {"coordinator": self.scheduler.num_active if self.scheduler else 0,
                "shards": counts[:len(self.group.shards)],
                "draft": counts[len(self.group.shards)] if self.draft is not None else None}

    # ---------------------------------------------------------------------------- requests

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        """Stream one request's chunks (see `specdec.request.GenerationRequest`). Past its `timeout_s`
        the request raises `RequestTimeout` at its next step."""
        ids, sampling = resolve_prompt(self.tokenizer, request.prompt, request.prompt_token_ids, request.chat,
                                       request.sampling, self.info["vocab_size"], self.info["max_context"],
                                       self.config.engine.target)
        if request.pipeline is not None and self.draft is None:
            request.pipeline = False  # pipelining needs a draft in a process of its own
        deadline = time.monotonic() + request.timeout_s if request.timeout_s is not None else None
        out: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        record = self.metrics.arrived(request.request_id)

        def observe(kind: str, data) -> None:  # scheduler thread -> this loop (metrics stay single-threaded)
            loop.call_soon_threadsafe(_observe, record, kind, data)

        item = self.scheduler.submit(request, ids, sampling, lambda x: loop.call_soon_threadsafe(out.put_nowait, x),
                                     observer=observe)
        finish_reason = None
        try:
            while (chunk := received(await out.get())) is not None:
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
            self.scheduler.cancel(item)  # a no-op once the request has ended
            record.finished(finish_reason or "error")

    # ------------------------------------------------------------------------------ shards

    def _on_fatal(self, error: Exception) -> Exception:
        """A whole shard call failed (scheduler thread): rebuild the group if an actor is gone."""
        if isinstance(error, TargetShardError):
            return error
        if isinstance(error, _ACTOR_GONE):
            self._rebuild(f"{error.__class__.__name__}")
            return TargetShardError(
                f"a target shard failed: its actor is gone ({error.__class__.__name__}: {_first_line(error)}); the "
                "requests of this step were aborted and the shard group was rebuilt for the next ones")
        if isinstance(error, ray.exceptions.RayError):
            return TargetShardError(f"a target shard call failed ({error.__class__.__name__}: {_first_line(error)})")
        return error

    def _rebuild(self, reason: str) -> None:
        """Replace the whole shard group (its process group cannot lose a member); blocks the scheduler."""
        logger.warning("rebuilding the target shard group: %s", reason)
        kill_target_group(self.group)
        self.group = None
        try:
            self.group = asyncio.run_coroutine_threadsafe(create_target_group(self.config), self._loop).result()
        except Exception:  # noqa: BLE001 - the next step fails with a clear error and retries
            logger.exception("rebuilding the target shard group failed")

    def _shards(self) -> list:
        if self.group is None:
            self._rebuild("no shard group")
        if self.group is None:
            raise TargetShardError("the target shard group is down and could not be rebuilt")
        return self.group.shards

    def _gather(self, refs: list):
        results = ray.get(refs)
        self._last_progress = time.monotonic()
        return results


class _RemoteTarget:
    """The scheduler's target calls, sent to every shard (rank 0 answers)."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.c = coordinator

    def submit_forward(self, rows):
        refs = [s.forward.remote(rows) for s in self.c._shards()]
        return lambda: self.c._gather(refs)[0]

    def rewind(self, rows):
        per_shard = self.c._gather([s.rewind.remote(rows) for s in self.c._shards()])
        per_row = [list(lengths) for lengths in zip(*per_shard)]
        for (request_id, length), lengths in zip(rows, per_row):
            if any(n != length for n in lengths):
                self.c._rebuild(f"cache lengths {lengths} after rewinding {request_id} to {length}")
                raise TargetShardError(f"target shards disagree after a rewind: cache lengths {lengths}, committed "
                                       f"length {length}; the shard group was rebuilt")
        return per_row

    def release(self, request_ids):
        if self.c.group is not None:
            for s in self.c.group.shards:
                s.release.remote(request_ids)


class _RemoteDraft:
    """The scheduler's draft calls: the separate draft worker, or the rank-0 shard (colocated)."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.c = coordinator
        self.concurrent = coordinator.draft is not None  # its own process: pre-drafting overlaps the verify
        self.pipeline = coordinator.config.pipeline
        self.per_token = coordinator.config.engine.draft != "ngram"

    def submit_propose(self, rows):
        actor = self.c.draft if self.c.draft is not None else self.c._shards()[0]
        ref = actor.propose.remote(rows)
        return lambda: ray.get(ref)

    def release(self, request_ids):
        if self.c.draft is not None:
            self.c.draft.release.remote(request_ids)


def _observe(record, kind: str, data) -> None:
    if kind == "started":
        record.started()
    elif kind == "prefilled":
        record.prefilled(data[0], data[1])
    elif kind == "step":
        record.step(data)


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else ""


__all__ += ["Cancelled"]
