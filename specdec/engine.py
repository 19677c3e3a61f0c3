"""The in-process speculative decoding engine: prefill, then draft -> verify -> commit -> rewind.

    engine = SpeculativeEngine.from_pretrained(target="path/or.gguf", draft="ngram", num_speculative_tokens=4)
    out = engine.generate(prompt="def fib(n):", sampling=SamplingParams(max_tokens=64))

One step (cf. gpt-fast `speculative_decode`, Leviathan et al. arXiv 2211.17192):
1. the proposer proposes up to K tokens after the committed sequence;
2. the target runs ONE forward over [last committed token, proposals] -> K+1 distributions;
3. verification accepts a prefix and emits a recovered or bonus token (`verify.py`);
4. the tokens are committed through the stopping rules (`sequence.py`);
5. the target cache is rewound to the committed length minus one (the last committed token is the
   next step's first input) and the draft cache to the committed prefix it shares.
The prefill covers the prompt minus its last token, so the first step already speculates.
K = 0 (draft `none`, or k=auto falling back) is plain target decoding through the same loop.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterator, Sequence

import torch

from specdec.config import EngineConfig, SamplingParams
from specdec.kernels import apply_linear_kernel, choose_draft_quantization, choose_linear_kernel, quantize_int8
from specdec.model_runner import ModelRunner
from specdec.models import LoadedModel, check_same_vocabulary, load_model, select_device, set_threads
from specdec.prompt import Prompt, resolve_prompt, tokenize_prompt
from specdec.proposers import DraftModelProposer, NgramProposer, Proposal
from specdec.sequence import GenerationOutput, Sequence as GenSequence, StreamChunk
from specdec.speculation_length import CostModel, make_policy
from specdec.verify import verify_proposal

logger = logging.getLogger(__name__)


def _sync(device: torch.device) -> None:
    """Wait for queued GPU work, so step timings measure the work and not the queueing."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpeculativeEngine:
    """Target model + proposer + verification, one request at a time (the Ray engine runs many)."""

    def __init__(self, config: EngineConfig, target: LoadedModel, draft: LoadedModel | None = None) -> None:
        self.config = config
        self.target_model = target
        self.tokenizer = target.tokenizer
        self.linear_kernel = choose_linear_kernel(config.linear_kernel, target.model,
                                                  speculating=config.draft != "none", tensor_parallel=False)
        apply_linear_kernel(target.model, self.linear_kernel)
        self.target = ModelRunner(target)
        self.draft_model = draft
        self.draft_quantization = "none"
        if config.draft == "none":
            self.proposer = None
        elif config.draft == "ngram":
            self.proposer = NgramProposer(config.ngram_min, config.ngram_max)
        else:
            if draft is None:
                raise ValueError(f"draft {config.draft!r} is a model but none was loaded")
            check_same_vocabulary(target.tokenizer, draft.tokenizer, target.spec, draft.spec)
            self.draft_quantization = choose_draft_quantization(config.draft_quantization, draft.model)
            if self.draft_quantization == "int8":
                # A quantized copy: the loaded draft (possibly the target itself) stays as it was.
                draft = dataclasses.replace(draft, model=quantize_int8(draft.model))
                self.draft_model = draft
            self.proposer = DraftModelProposer(ModelRunner(draft, vocab_size=self.target.vocab_size))
        self.costs = CostModel()
        self._lock = threading.Lock()

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
        device = select_device(config.device)
        target = load_model(config.target, device, config.dtype, config.trust_remote_code)
        draft = None
        if config.draft not in ("ngram", "none"):
            draft = load_model(config.draft, device, config.dtype, config.trust_remote_code)
        return cls(config, target, draft)

    def tokenize(self, prompt: str, chat: bool = False) -> list[int]:
        """Prompt text -> ids (with the tokenizer's chat template when `chat`)."""
        return tokenize_prompt(self.tokenizer, prompt, chat, self.target_model.spec)

    # ------------------------------------------------------------------------------ generation

    def generate(
        self,
        prompt: Prompt | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        sampling: SamplingParams | None = None,
        chat: bool = False,
        num_speculative_tokens: int | str | None = None,
    ) -> GenerationOutput:
        """Generate a completion; returns text, token ids, finish reason, usage and speculation stats.

        `prompt` is text, or with `chat` a list of {"role", "content"} messages.

        `num_speculative_tokens` overrides the engine's K (an int or "auto") for this request.
        """
        last = None
        for last in self.generate_stream(prompt, prompt_token_ids=prompt_token_ids, sampling=sampling, chat=chat,
                                         num_speculative_tokens=num_speculative_tokens):
            pass
        assert last is not None and last.output is not None
        return last.output

    def generate_stream(
        self,
        prompt: Prompt | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        sampling: SamplingParams | None = None,
        chat: bool = False,
        num_speculative_tokens: int | str | None = None,
    ) -> Iterator[StreamChunk]:
        """Yield what each step commits; the last chunk carries the finish reason and the whole output."""
        sampling = sampling or SamplingParams()
        policy = make_policy(self.config, self.costs, num_speculative_tokens, has_draft=self.proposer is not None)
        ids, sampling = resolve_prompt(self.tokenizer, prompt, prompt_token_ids, chat, sampling,
                                       self.target.vocab_size, self.target.max_context, self.target_model.spec)
        with self._lock:
            yield from self._run(ids, sampling, policy)

    def _run(self, prompt_token_ids: list[int], sampling: SamplingParams, policy) -> Iterator[StreamChunk]:
        draft_device = self.proposer.runner.device if isinstance(self.proposer, DraftModelProposer) else "cpu"
        seq = GenSequence(prompt_token_ids, sampling, self.tokenizer, self.target_model.eos_token_ids,
                          self.target.device, draft_device)
        target_cache = self.target.new_cache()
        draft_state = self.proposer.new_state() if self.proposer else None
        try:
            # Prefill all but the last prompt token: the first step feeds it with the first proposal,
            # so even the first generated token is speculated.
            if len(seq.token_ids) > 1:
                self.target.forward(target_cache, seq.token_ids[:-1], num_logits=1)
                _sync(self.target.device)
            seq.prefill_seconds = time.perf_counter() - seq.started
            while not seq.finished:
                yield self._finalize(seq, self._step(seq, target_cache, draft_state, policy))
        finally:
            target_cache.rewind(0)
            if self.proposer is not None:
                self.proposer.release(draft_state)

    def _finalize(self, seq: GenSequence, chunk: StreamChunk) -> StreamChunk:
        if seq.finished:
            chunk.output = seq.output()
        return chunk

    def _step(self, seq: GenSequence, target_cache, draft_state, policy) -> StreamChunk:
        sampling = seq.sampling
        k = seq.clamp_k(policy.next_k(), self.target.max_context)
        t0 = time.perf_counter()
        proposal = Proposal([])
        if k > 0:
            proposal = self.proposer.propose(draft_state, seq.token_ids, k, sampling, seq.draft_generator)
            if isinstance(self.proposer, DraftModelProposer):
                _sync(self.proposer.runner.device)
        t1 = time.perf_counter()
        inputs = [seq.token_ids[-1]] + proposal.token_ids
        logits = self.target.forward(target_cache, inputs, num_logits=len(inputs))  # [K+1, vocab]
        _sync(self.target.device)
        t2 = time.perf_counter()
        result = verify_proposal(proposal.token_ids, proposal.probs, logits, sampling, seq.verify_generator)
        chunk = seq.commit(result.token_ids)
        chunk.num_proposed = len(proposal)
        if not seq.finished:
            target_cache.rewind(len(seq.token_ids) - 1)
            if target_cache.token_ids[-8:] != seq.token_ids[-9:-1]:
                raise RuntimeError("target KV cache diverged from the committed tokens")
            if self.proposer is not None:
                self.proposer.rewind(draft_state, seq.token_ids)
        t3 = time.perf_counter()

        num_proposed = len(proposal)
        seq.record_step(num_proposed, result.num_accepted, proposal.num_forwards, t1 - t0, t2 - t1)
        policy.observe(num_proposed, result.num_accepted)
        self.costs.observe_target(len(inputs), t2 - t1)
        self.costs.observe_overhead(t3 - t2)
        if isinstance(self.proposer, DraftModelProposer):
            # A long catch-up (after steps without drafting) is a small prefill, not a draft step.
            if proposal.num_forwards and proposal.num_catchup_tokens <= 2:
                self.costs.observe_draft(proposal.num_forwards, t1 - t0)
        elif k > 0:
            self.costs.observe_draft(1, t1 - t0)  # model-free proposer: one lookup per step, whatever K
        return chunk
