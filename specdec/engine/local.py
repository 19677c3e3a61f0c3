"""The in-process speculative decoding engine: models, proposer and the batch scheduler in one process.

    engine = SpeculativeEngine.from_pretrained(target="path/or.gguf", draft="ngram", num_speculative_tokens=4)
    out = engine.generate(prompt="def fib(n):", sampling=SamplingParams(max_tokens=64))
    outs = engine.generate_batch(["def fib(n):", "def sort(xs):"])   # decoded together, one batch

One step (cf. gpt-fast `speculative_decode`, Leviathan et al. arXiv 2211.17192), for every request
of the running batch at once (`scheduler.py`):
1. the proposer proposes up to K tokens after the committed sequence;
2. the target runs ONE forward over [last committed token, proposals] -> K+1 distributions;
3. verification accepts a prefix and emits a recovered or bonus token (`verify.py`);
4. the tokens are committed through the stopping rules (`request_state.py`);
5. the target cache is rewound to the committed length minus one (the last committed token is the
   next step's first input) and the draft cache to the committed prefix it shares.
The prefill covers the prompt minus its last token, so the first step already speculates.
K = 0 (draft `none`, or k=auto falling back) is plain target decoding through the same loop.

Concurrent `generate` / `generate_stream` calls (threads) share one scheduler, driven by one
background thread: they are batched, up to `max_batch_size` requests per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator, Iterator, Sequence

import torch

from specdec import startup
from specdec.engine.backends import DraftCapabilities
from specdec.config import EngineConfig, SamplingParams
from specdec.engine.build import Target, load_draft, load_target, prepare_loaded_target
from specdec.engine.draft import Draft, build_draft
from specdec.kernels.calibration import runtime_check, summarize
from specdec.kernels.linear import VERIFY_TOKENS
from specdec.kernels.target_precision import precision_summary
from specdec.models.model_runner import ModelRunner
from specdec.models.loading import LoadedModel, set_threads
from specdec.engine.pools import DraftPool, TargetPool
from specdec.engine.prompt import Prompt, PromptResolver, tokenize_prompt
from specdec.engine.api import Engine, last_chunk
from specdec.engine.request import GenerationRequest, as_request, as_requests
from specdec.engine.budget import KVBudget, available_memory, budget_bytes
from specdec.engine.scheduler import Scheduler
from specdec.models.kv_cache import KVLayout
from specdec.engine.streams import received, stream_async
from specdec.engine.request_state import GenerationOutput, StreamChunk
from specdec.decoding.speculation_length import CostModel

logger = logging.getLogger(__name__)


def _sync(device: torch.device) -> None:
    """Wait for queued GPU work, so step timings measure the work and not the queueing."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpeculativeEngine(Engine):
    """Target model + proposer + the batch scheduler, in this process; thread-safe (concurrent calls batch)."""

    def __init__(self, config: EngineConfig, target: LoadedModel | Target,
                 draft: LoadedModel | Draft | None = None) -> None:
        """`target`: a loaded target (its kernel is prepared here) or one `build.load_target` prepared;
        `draft`: a loaded draft model (built here), a built `Draft`, or None (n-gram lookup, none)."""
        self.config = config
        self.startup_seconds: dict[str, float] = {}  # stage -> seconds (`startup.py`), by from_config
        if not isinstance(target, Target):
            target = prepare_loaded_target(config, target)
        self.linear_kernel, self.kernel_record = target.linear_kernel, target.kernel_record
        self.target_precision, self.precision_record = target.precision, target.precision_record
        self.precision_applied = target.applied
        target = target.loaded
        self.target_model = target
        self.tokenizer = target.tokenizer
        self.target = ModelRunner(target)
        self.prompts = PromptResolver(self.tokenizer, self.target.vocab_size, self.target.max_context, target.spec,
                                      lambda: target.eos_token_ids, config.trust_remote_code)
        built = draft if isinstance(draft, Draft) else build_draft(config, draft, self.target.vocab_size,
                                                                     target=target, target_kernel=self.kernel_record)
        self.proposer = built.proposer
        self.draft_precision = built.precision
        self.draft_vocab_size = built.vocab_size
        self.draft_calibration = built.measurements
        self.draft_record = built.record
        self.draft_model = built.model
        self.costs = CostModel()
        self.calibration_check = runtime_check(summarize(self.kernel_record, self.linear_kernel),
                                               summarize(self.draft_record, self.draft_precision), VERIFY_TOKENS)
        pool = TargetPool(self.target, config.prefix_caching)
        self.target_pool = pool
        self.draft_pool = (DraftPool(self.proposer, self.draft_device, config.prefix_caching)
                           if self.proposer is not None else None)
        self.scheduler = Scheduler(config, LocalTarget(pool, self.target.device),
                                   LocalDraft(self.draft_pool, self.draft_device) if self.draft_pool is not None else None,
                                   self.prompts, costs=self.costs, budget=self._budget())
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()
        self._stop = False

    def _budget(self) -> KVBudget | None:
        """The KV budget (`kv_cache_memory`) over what a token costs the target and the draft model."""
        total = budget_bytes(self.config.kv_cache_memory, available_memory(self.target_model.device))
        if total is None:
            return None
        chunk = self.config.max_batch_tokens
        draft = self.draft_model
        return KVBudget(total, KVLayout.of(self.target_model.model.config, self.target_model.dtype, chunk),
                        KVLayout.of(draft.model.config, draft.dtype, chunk) if draft is not None else None)

    @property
    def calibration(self) -> dict:
        """What the load-time measurements chose and from what (`calibration.Record.summary`)."""
        return {"target_precision": precision_summary(self.precision_record, self.target_precision,
                                                      self.precision_applied),
                "linear_kernel": summarize(self.kernel_record, self.linear_kernel),
                "draft_precision": summarize(self.draft_record, self.draft_precision),
                "contradicted": dict(self.calibration_check.contradicted)}

    @property
    def draft_device(self) -> torch.device:
        return self.proposer.device

    @classmethod
    def from_pretrained(
        cls,
        target: str,
        draft: str = "none",
        num_speculative_tokens: int | str = 4,
        **config_kwargs,
    ) -> "SpeculativeEngine":
        """Load the target (and a draft model, unless draft is `ngram` or `none`) and build an engine.

        Extra keyword arguments are `EngineConfig` fields (device, dtype, num_threads, ...).
        """
        config = EngineConfig(target=target, draft=draft, num_speculative_tokens=num_speculative_tokens,
                              **config_kwargs)
        return cls.from_config(config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "SpeculativeEngine":
        set_threads(config.num_threads)
        with startup.recording() as seconds:
            target = load_target(config)
            draft = load_draft(config, target.loaded.vocab_size, target)
            engine = cls(config, target, draft)
        engine.startup_seconds = seconds
        return engine

    def sibling(self, **changes) -> "SpeculativeEngine":
        """Another engine on this one's prepared target and draft (no copy: they are only read),
        with `EngineConfig` fields changed that do not change the weights (`prefix_caching`,
        `kv_cache_memory`, batching): benchmarks compare settings on one copy of the models. Its
        own caches, scheduler and thread; run the two one after the other, not at once (a cancelled
        request's step may still be running: let a request end before the sibling starts)."""
        built = {"target", "draft", "target_precision", "draft_precision", "linear_kernel", "device", "dtype",
                 "draft_vocab_size", "prompt_lookup_min", "ngram_min", "ngram_max"} & changes.keys()
        if built:
            raise ValueError(f"a sibling shares the models and the proposer; cannot change {', '.join(sorted(built))}")
        target = Target(self.target_model, self.linear_kernel, self.kernel_record, self.target_precision,
                        self.precision_record, self.precision_applied)
        draft = Draft(self.proposer, self.draft_precision, self.draft_vocab_size, self.draft_calibration,
                      self.draft_model, self.draft_record)
        return type(self)(dataclasses.replace(self.config, **changes), target, draft)

    def tokenize(self, prompt: str, chat: bool = False) -> list[int]:
        """Prompt text -> ids (with the tokenizer's chat template when `chat`)."""
        return tokenize_prompt(self.tokenizer, prompt, chat, self.target_model.spec)

    # ------------------------------------------------------------------------------ generation

    def generate_stream(self, prompt: Prompt | GenerationRequest | None = None, **fields) -> Iterator[StreamChunk]:
        """Yield what each step commits; the last chunk carries the finish reason and the whole output.
        Closing the iterator early cancels the request and frees its caches."""
        request = as_request(prompt, **fields)
        return self._stream(*self._submit(request, *self.prompts(request)))

    async def generate_async(self, prompt: Prompt | GenerationRequest | None = None,
                             **fields) -> AsyncIterator[StreamChunk]:
        """`generate_stream` for asyncio: chunks arrive on the running event loop (the scheduler runs
        in its own thread), so many requests stream from one loop. Closing or cancelling the stream
        cancels the request and frees its caches."""
        request = as_request(prompt, **fields)
        ids, sampling = await asyncio.to_thread(self.prompts, request)  # a grammar may compile: off the loop
        async with contextlib.aclosing(stream_async(self.scheduler, request, ids, sampling,
                                                    submitted=lambda item: self._ensure_thread())) as chunks:
            async for chunk in chunks:
                yield chunk

    def generate_batch(self, requests: Sequence[GenerationRequest | Prompt]) -> list[GenerationOutput]:
        """Generate many completions together (one batch, `max_batch_size` rows at a time); outputs in
        the order of `requests`. Each is what it would be alone (greedy: token for token)."""
        requests = as_requests(requests)
        resolved = [self.prompts(r) for r in requests]  # every request is valid before any starts
        submitted = [self._submit(r, *ids_sampling) for r, ids_sampling in zip(requests, resolved)]
        return [last_chunk(self._stream(*s)).output for s in submitted]

    def _submit(self, request: GenerationRequest, ids: list[int], sampling: SamplingParams):
        out: queue.SimpleQueue = queue.SimpleQueue()
        item = self.scheduler.submit(request, ids, sampling, out.put)
        self._ensure_thread()
        return item, out

    def _stream(self, item, out: queue.SimpleQueue) -> Iterator[StreamChunk]:
        try:
            while (chunk := received(out.get())) is not None:
                yield chunk
        finally:
            self.scheduler.cancel(item)  # a no-op once the request has ended

    def shutdown(self) -> None:
        """Fail what is still running and stop the scheduler's thread (the engine can start it again)."""
        self.scheduler.fail_all(RuntimeError("the engine was shut down"))
        with self._thread_lock:
            thread, self._stop = self._thread, True
        self.scheduler.wake()
        if thread is not None:
            thread.join(timeout=30)
        self._stop = False

    def _ensure_thread(self) -> None:
        with self._thread_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="specdec-scheduler", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        self.scheduler.drive(stop=lambda: self._stop, after_step=lambda: self.calibration_check.after_step(self.costs),
                             idle_s=30.0, on_idle=self._retire)
        with self._thread_lock:
            if self._stop:
                self._thread = None

    def _retire(self) -> bool:
        """Idle: end the thread unless work arrived meanwhile (the next request starts a new one)."""
        with self._thread_lock:
            if not self.scheduler.num_active:
                self._thread = None
                return True
        return False


class LocalTarget:
    """The scheduler's target calls on an in-process `TargetPool` (results are ready at once)."""

    def __init__(self, pool: TargetPool, device: torch.device) -> None:
        self.pool, self.device = pool, device

    def admit(self, rows):
        return self.pool.admit(rows)

    def fit(self, room):
        return self.pool.fit(room)

    def submit_forward(self, rows):
        reply = self.pool.forward(rows)
        _sync(self.device)
        return lambda: reply

    def release(self, request_ids):
        self.pool.release(request_ids)


class LocalDraft:
    """The scheduler's draft calls on an in-process `DraftPool`. It shares the target's cores, so
    pre-drafting would not overlap anything (`concurrent` False)."""

    def __init__(self, pool: DraftPool, device: torch.device) -> None:
        self.pool, self.device = pool, device
        self.capabilities = DraftCapabilities(concurrent=False, per_token=pool.proposer.per_token)

    def submit_propose(self, rows):
        results = self.pool.propose(rows)
        _sync(self.device)
        return lambda: results

    def fit(self, room):
        return self.pool.fit(room)

    def release(self, request_ids):
        self.pool.release(request_ids)
