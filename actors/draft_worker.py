"""The draft worker: a proposer (draft model or n-gram lookup) with one state per request.

A plain class; `actors/builder.py`/the coordinator make it a Ray actor, or the rank-0 target shard
hosts one in its own process (colocated placement). It reuses the core's
proposers unchanged: each `propose` rewinds the request's draft cache to the prefix it shares with
the context it is given, so a rejection, or a pre-drafted block that was not used, needs no extra
call; `rewind` exists for eager cache trimming and for tests.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import torch

from specdec.config import EngineConfig, SamplingParams
from specdec.kernels import choose_draft_quantization, quantize_int8
from specdec.model_runner import ModelRunner
from specdec.models import load_model, select_device, set_threads
from specdec.proposers import DraftModelProposer, NgramProposer, Proposal
from specdec.sampling import make_generator

logger = logging.getLogger(__name__)


class DraftWorker:
    def __init__(self, config: EngineConfig, target_vocab_size: int, num_threads: int | None = None) -> None:
        set_threads(num_threads or config.num_threads)
        self.config = config
        if config.draft == "ngram":
            self.proposer = NgramProposer(config.ngram_min, config.ngram_max)
            self.device = torch.device("cpu")
        elif config.draft == "none":
            raise ValueError("draft 'none' needs no draft worker")
        else:
            loaded = load_model(config.draft, select_device(config.device), config.dtype, config.trust_remote_code)
            self.quantization = choose_draft_quantization(config.draft_quantization, loaded.model)
            if self.quantization == "int8":
                loaded = dataclasses.replace(loaded, model=quantize_int8(loaded.model))
            self.proposer = DraftModelProposer(ModelRunner(loaded, vocab_size=target_vocab_size))
            self.device = loaded.device
        self._requests: dict[str, tuple[object, torch.Generator]] = {}

    def ready(self) -> str:
        return self.proposer.name

    def _request(self, request_id: str, seed: int | None):
        if request_id not in self._requests:
            self._requests[request_id] = (self.proposer.new_state(), make_generator(seed, "draft", self.device))
        return self._requests[request_id]

    def propose(self, request_id: str, context_token_ids: Sequence[int], num_tokens: int,
                sampling: SamplingParams) -> Proposal:
        """The proposal carries the seconds it took here, so the caller can tell drafting time from
        the call's round trip (auto-K weighs them differently: one is paid per token, one per step)."""
        start = time.perf_counter()
        state, generator = self._request(request_id, sampling.seed)
        proposal = self.proposer.propose(state, context_token_ids, num_tokens, sampling, generator)
        if proposal.probs is not None:
            proposal.probs = proposal.probs.cpu()
        proposal.seconds = time.perf_counter() - start
        return proposal

    def rewind(self, request_id: str, context_token_ids: Sequence[int]) -> int:
        entry = self._requests.get(request_id)
        if entry is None:
            return 0
        self.proposer.rewind(entry[0], context_token_ids)
        return len(entry[0]) if entry[0] is not None else 0

    def release(self, request_id: str) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            self.proposer.release(entry[0])

    def num_requests(self) -> int:
        return len(self._requests)
