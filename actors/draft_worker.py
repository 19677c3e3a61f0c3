"""The draft worker: a proposer (draft model or n-gram lookup) with one state per request.

A plain class; `actors/groups.py` makes it a Ray actor, or the rank-0 target shard hosts one in its
own process (colocated placement). It wraps the core's `DraftPool` unchanged: `propose(rows)` drafts
the whole batch (one draft forward per position for a draft model), and each row first rewinds its
draft cache to the prefix it shares with the context it is given, so a rejection, or a pre-drafted
block that was not used, needs no extra call. `progress()` counts its decoder layers, for the
coordinator's health check (`specdec.engine.progress`; a colocated draft counts into the shard's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from actors.wire import WireLog
from specdec.kernels.calibration import Record as Calibration, summarize
from specdec.config import EngineConfig
from specdec.engine.build import Target, load_draft
from specdec.models.loading import set_threads
from specdec.engine.pools import DraftPool, DraftRow
from specdec.engine.progress import ForwardProgress
from specdec.decoding.proposers import Proposal

logger = logging.getLogger(__name__)


class DraftWorker:
    def __init__(self, config: EngineConfig, target_vocab_size: int, num_threads: int | None = None,
                 target: Target | None = None, progress: ForwardProgress | None = None,
                 target_kernel: Calibration | None = None) -> None:
        set_threads(num_threads or config.num_threads)
        self.config = config
        self.forward_progress = progress or ForwardProgress.from_env()
        if config.draft == "none":
            raise ValueError("draft 'none' needs no draft worker")
        built = load_draft(config, target_vocab_size, target, target_kernel)
        self.precision = built.precision
        self.record = built.record
        proposer, device = built.proposer, built.device
        if built.model is not None:
            self.forward_progress.watch(built.model.model)
        self.pool = DraftPool(proposer, device, config.prefix_caching)
        self.model = built.model
        self.wire = WireLog()  # calls and bytes per method, when a test or benchmark asks

    def kv_layout(self):
        """What a token costs the draft's KV cache (`specdec.models.kv_cache.KVLayout`; None: n-gram)."""
        from specdec.models.kv_cache import KVLayout

        if self.model is None:
            return None
        return KVLayout.of(self.model.model.config, self.model.dtype, self.config.max_batch_tokens)

    def fit(self, room: int):
        return self.pool.fit(room)

    def ready(self) -> str:
        return self.pool.name

    def calibration(self) -> dict | None:
        """The draft model's precision and, when `auto` measured it, how (`specdec.kernels.calibration.Record.summary`);
        None for n-gram lookup (no model)."""
        return summarize(self.record, self.precision) if self.config.draft != "ngram" else None

    def propose(self, rows: Sequence[DraftRow]) -> list:
        """Each proposal carries the seconds the batch took here, so the caller can tell drafting time
        from the call's round trip (auto-K weighs them differently: one is paid per token, one per step)."""
        start = time.perf_counter()
        with self.forward_progress.running("propose"):
            proposals = self.pool.propose(rows)
        seconds = time.perf_counter() - start
        for p in proposals:
            if isinstance(p, Proposal):  # not a row's error (`RowError`)
                p.seconds = seconds
                if p.probs is not None:  # q (residual sampling) crosses Ray on the host
                    p.probs = p.probs.cpu()
        return self.wire.record("propose", rows, proposals)

    def wire_log(self, enable: bool | None = None) -> dict:
        """Calls and bytes per method so far (`actors.wire.WireLog`); `enable` turns counting on
        (from zero) or off."""
        return self.wire.snapshot() if enable is None else self.wire.enable(enable)

    def release(self, request_ids: Sequence[str]) -> None:
        self.pool.release(request_ids)

    def num_requests(self) -> int:
        return len(self.pool)

    def progress(self) -> dict:
        """This process's progress (`ForwardProgress.snapshot`); safe to call from another thread."""
        return self.forward_progress.snapshot()
