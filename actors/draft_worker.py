"""The draft worker: a proposer (draft model or n-gram lookup) with one state per request.

A plain class; `actors/groups.py` makes it a Ray actor, or the rank-0 target shard hosts one in its
own process (colocated placement). It wraps the core's `DraftPool` unchanged: `propose(rows)` drafts
the whole batch (one draft forward per position for a draft model), and each row first rewinds its
draft cache to the prefix it shares with the context it is given, so a rejection, or a pre-drafted
block that was not used, needs no extra call.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

from specdec.config import EngineConfig
from specdec.kernels import choose_draft_quantization, quantize_int8
from specdec.model_runner import ModelRunner
from specdec.models import load_model, select_device, set_threads
from specdec.pools import DraftPool, DraftRow
from specdec.proposers import DraftModelProposer, NgramProposer, Proposal

logger = logging.getLogger(__name__)


class DraftWorker:
    def __init__(self, config: EngineConfig, target_vocab_size: int, num_threads: int | None = None) -> None:
        set_threads(num_threads or config.num_threads)
        self.config = config
        self.quantization = "none"
        if config.draft == "ngram":
            proposer, device = NgramProposer(config.ngram_min, config.ngram_max), "cpu"
        elif config.draft == "none":
            raise ValueError("draft 'none' needs no draft worker")
        else:
            loaded = load_model(config.draft, select_device(config.device), config.dtype, config.trust_remote_code,
                                allow_pickle=config.allow_pickle_weights)
            self.quantization = choose_draft_quantization(config.draft_quantization, loaded.model)
            if self.quantization == "int8":
                loaded = dataclasses.replace(loaded, model=quantize_int8(loaded.model))
            proposer, device = DraftModelProposer(ModelRunner(loaded, vocab_size=target_vocab_size)), loaded.device
        self.pool = DraftPool(proposer, device)

    def ready(self) -> str:
        return self.pool.name

    def propose(self, rows: Sequence[DraftRow]) -> list[Proposal]:
        """Each proposal carries the seconds the batch took here, so the caller can tell drafting time
        from the call's round trip (auto-K weighs them differently: one is paid per token, one per step)."""
        start = time.perf_counter()
        proposals = self.pool.propose(rows)
        seconds = time.perf_counter() - start
        for p in proposals:
            p.seconds = seconds
        return proposals

    def release(self, request_ids: Sequence[str]) -> None:
        self.pool.release(request_ids)

    def num_requests(self) -> int:
        return len(self.pool)
