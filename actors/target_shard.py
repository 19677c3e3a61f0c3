"""One tensor-parallel shard of the target model, with the KV caches of its attention heads.

All shards of a group receive the same calls in the same order (the coordinator submits each call
to every shard before awaiting any) and run every batched forward together (the core's `TargetPool`
holds the per-request KV caches of this shard's heads and runs the batch); transformers' built-in tensor
parallelism (`tp_plan="auto"`, as in gpt-fast's `tp.py` the model file knows nothing about it)
reduces through a torch.distributed process group among the shard actors: gloo on CPU, NCCL on GPU.
Rank 0 returns the result; the others return None. tp_size 1 is a plain single-process target.
With the colocated draft placement, rank 0 also hosts the draft worker (`propose`).

`progress()` reports the decoder layers this process has run (`specdec.engine.progress`); the coordinator's
health check asks for it while a forward runs (the actor gives it a thread of its own, see
`actors/groups.py`), which tells a slow forward from a stuck one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections.abc import Sequence
from datetime import timedelta

import torch

from actors.wire import WireLog
from specdec import startup
from specdec.config import EngineConfig
from specdec.kernels.calibration import summarize
from specdec.kernels.target_precision import precision_summary
from specdec.engine.budget import available_memory
from specdec.engine.build import load_target
from specdec.models.kv_cache import KVLayout
from specdec.models.model_runner import ModelRunner
from specdec.models.loading import select_device, set_threads
from specdec.engine.pools import TargetPool, TargetRow
from specdec.engine.progress import ForwardProgress

logger = logging.getLogger(__name__)


class TargetShard:
    def __init__(self, config: EngineConfig, rank: int, world_size: int, num_threads: int | None = None,
                 host_draft: bool = False) -> None:
        set_threads(num_threads or config.num_threads)
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.host_draft = host_draft
        self.draft = None  # actors.draft_worker.DraftWorker, when the draft is colocated here
        self.runner: ModelRunner | None = None
        self.pool: TargetPool | None = None
        self.startup_seconds: dict[str, float] = {}
        self.kernel_record = None  # the target kernel's calibration (specdec.kernels.calibration.Record), when measured
        self.forward_progress = ForwardProgress.from_env()  # the target's layers, and a colocated draft's
        self.wire = WireLog()  # calls and bytes per method, when a test or benchmark asks

    # ------------------------------------------------------------------------------- set-up

    def address(self) -> tuple[str, int]:
        """Rank 0's address and a free port for the process group's rendezvous."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        try:
            import ray

            host = ray.util.get_node_ip_address()
        except Exception:  # noqa: BLE001 - outside Ray (tests of the plain class)
            host = "127.0.0.1"
        return host, port

    def setup(self, master_addr: str, master_port: int, timeout_s: float = 120.0) -> dict:
        """Join the process group (tp > 1) and load this rank's slice of the target."""
        with startup.recording() as self.startup_seconds:
            self._setup(master_addr, master_port, timeout_s)
        return self.describe()

    def _setup(self, master_addr: str, master_port: int, timeout_s: float) -> None:
        device = select_device(self.config.device)
        if self.world_size > 1:
            import torch.distributed as dist

            os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",
                              MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, rank=self.rank, world_size=self.world_size,
                                    timeout=timedelta(seconds=timeout_s))
        target = load_target(self.config, tensor_parallel=self.world_size > 1)
        loaded, self.linear_kernel, self.kernel_record = target.loaded, target.linear_kernel, target.kernel_record
        self.target_precision = precision_summary(target.precision_record, target.precision, target.applied)
        self.forward_progress.watch(loaded.model)
        self.runner = ModelRunner(loaded)
        self.pool = TargetPool(self.runner, self.config.prefix_caching)
        if self.host_draft:
            from actors.draft_worker import DraftWorker

            # Same process, same thread pool: the draft and the target never run at once here. An
            # unsharded target is at hand for `auto` draft precision to measure acceptance against.
            self.draft = DraftWorker(self.config, self.runner.vocab_size, torch.get_num_threads(),
                                     target=target if self.world_size == 1 else None, progress=self.forward_progress,
                                     target_kernel=self.kernel_record)

    def describe(self) -> dict:
        loaded = self.runner.loaded
        return {
            "vocab_size": self.runner.vocab_size,
            "max_context": self.runner.max_context,
            "eos_token_ids": sorted(loaded.eos_token_ids),
            "device": str(self.runner.device),
            "dtype": str(loaded.dtype),
            "rank": self.rank,
            "linear_kernel": self.linear_kernel,
            "target_precision": self.target_precision["choice"],
            "world_size": self.world_size,
            "draft": self.draft.ready() if self.draft is not None else None,
            # What load-time measurement chose (`specdec/kernels/calibration.py`): the kernel here, the
            # colocated draft's precision (a separate draft worker reports its own).
            "calibration": {"target_precision": self.target_precision,
                            "linear_kernel": summarize(self.kernel_record, self.linear_kernel),
                            "draft_precision": self.draft.calibration() if self.draft is not None else None},
            "startup_seconds": dict(self.startup_seconds),  # stage -> seconds (`specdec/startup.py`)
            # What a token costs the whole model's KV (every rank's heads), and the colocated draft's.
            "kv_layout": KVLayout.of(loaded.model.config, loaded.dtype, self.config.max_batch_tokens),
            "draft_kv_layout": self.draft.kv_layout() if self.draft is not None else None,
            "available_memory": available_memory(self.runner.device),  # for KV, once loaded
        }

    # ------------------------------------------------------------------------------ serving

    def forward(self, rows: Sequence[TargetRow]):
        """One batched forward over every row (`TargetPool.forward`: each cache first drops the last
        step's rejected tokens); rank 0 verifies the proposals where the logits are and returns per
        row `[num_logits]` argmax ids (greedy), the `VerifyResult`, `[num_logits, vocab]` float32
        logits on the CPU (prompt log-probabilities) or that row's error; the other ranks run the
        same forward (the collectives need them), verify nothing and return only their cache lengths."""
        sent = rows
        if self.rank != 0:
            rows = [dataclasses.replace(r, argmax_only=True, verify=None) for r in rows]
        with self.forward_progress.running("forward"):
            reply = self.pool.forward(rows)
        if self.rank != 0:  # the coordinator reads rank 0's results; a row that failed only here shows
            reply = dataclasses.replace(reply, results=None)  # as a cache length that disagrees
        return self.wire.record("forward", sent, reply)

    def wire_log(self, enable: bool | None = None) -> dict:
        """Calls and bytes per method so far (`actors.wire.WireLog`); `enable` turns counting on
        (from zero) or off."""
        return self.wire.snapshot() if enable is None else self.wire.enable(enable)

    def admit(self, rows):
        """Make the entering requests' caches from their longest cached prefixes (this rank's heads);
        per row the tokens held."""
        return self.pool.admit(rows)

    def fit(self, room: int):
        """Evict this rank's cached prefixes down to `room` bytes."""
        return self.pool.fit(room)

    def fit_draft(self, room: int):
        """Evict the colocated draft's cached prefixes down to `room` bytes."""
        return self.draft.fit(room)

    def release(self, request_ids: Sequence[str]) -> None:
        self.pool.release(request_ids)
        if self.draft is not None:
            self.draft.release(request_ids)

    # ------------------------------------------------------------------- colocated draft

    def propose(self, rows):
        """The colocated draft's proposals (same contract as `DraftWorker.propose`)."""
        if self.draft is None:
            raise RuntimeError(f"shard {self.rank} hosts no draft")
        return self.wire.record("propose", rows, self.draft.propose(rows))

    def ready(self) -> str:
        return self.draft.ready() if self.draft is not None else "target"

    def num_requests(self) -> int:
        """Requests holding state here: KV caches, and draft states when the draft is colocated."""
        return len(self.pool) + (self.draft.num_requests() if self.draft is not None else 0)

    def progress(self) -> dict:
        """This process's progress (`ForwardProgress.snapshot`); safe to call from another thread
        while a forward runs."""
        return self.forward_progress.snapshot()
