"""One request's generation state: committed tokens, stopping, text, stats and random streams.

Shared by the in-process engine and the Ray coordinator: both commit each step's verified tokens
through `RequestState.commit`, which applies the stopping rules token by token (EOS, max_tokens, stop
strings), so a step that overshoots a stop never leaks tokens past it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec.config import SamplingParams
from specdec.engine.detokenizer import IncrementalDetokenizer
from specdec.decoding.stats import SpeculativeStats, TokenLogprob


@dataclass
class StreamChunk:
    """What one step adds to the output; the last chunk has a finish_reason and the whole output."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    output: "GenerationOutput | None" = None
    num_proposed: int = 0  # draft tokens this step verified (K of the step)
    logprobs: list[TokenLogprob] | None = None  # [len(token_ids)] when the request asked for them
    # On the first chunk of a request that asked for `prompt_logprobs`: one per prompt token (the
    # first one's logprob is NaN: nothing comes before it).
    prompt_logprobs: list[TokenLogprob] | None = None
    # The target cache's length on each shard when the step's forward began (after dropping what the
    # step before rejected): the committed length before this step, minus one.
    cache_lengths: list[int] | None = None


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (max_tokens)
    prompt_tokens: int
    completion_tokens: int
    speculative: SpeculativeStats
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    k_history: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # [completion_tokens] when the request asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # [prompt_tokens] with `prompt_logprobs` (first: NaN)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not computed)

    @property
    def tokens_per_second(self) -> float:
        total = self.prefill_seconds + self.decode_seconds
        return self.completion_tokens / total if total > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": list(self.token_ids),
            "finish_reason": self.finish_reason,
            "usage": {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            },
            # JSON has no infinity: a token outside top-k/top-p is listed at -9999 (as vLLM's server).
            **({"logprobs": [{"token": e.token, "logprob": max(e.logprob, -9999.0),
                              "top_logprobs": [{"token": t, "token_id": i, "logprob": max(v, -9999.0)}
                                               for t, (i, v) in zip(e.top_tokens, e.top)]}
                             for e in self.logprobs]} if self.logprobs is not None else {}),
            "speculative": self.speculative.to_dict(),
            "timing": {
                "prefill_seconds": round(self.prefill_seconds, 4),
                "decode_seconds": round(self.decode_seconds, 4),
                "tokens_per_second": round(self.tokens_per_second, 3),
                "tokens_per_target_forward": round(
                    self.completion_tokens / self.speculative.target_forwards, 4
                ) if self.speculative.target_forwards else 0.0,
            },
        }


class RequestState:
    """Committed tokens of one request and everything that decides when it ends."""

    def __init__(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        tokenizer,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling = sampling
        # Token ids that end the output (and are kept in it): EOS unless ignored, and the request's own.
        self.eos_token_ids = (frozenset() if sampling.ignore_eos else eos_token_ids) | set(sampling.stop_token_ids)
        self.detokenizer = IncrementalDetokenizer(tokenizer, self.token_ids, sampling.stop)
        self.stats = SpeculativeStats()
        self.finish_reason: str | None = None
        self.k_history: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob] | None = None
        if sampling.prompt_logprobs is not None:
            self.prompt_logprobs = []
            self.add_prompt_logprobs([TokenLogprob(float("nan"))])
        self._prompt_logprobs_sent = False
        self.started = time.perf_counter()
        self.prefill_seconds = 0.0
        self.cached_tokens = 0  # prompt tokens the prefix cache served (set at admission)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def remaining(self) -> int:
        """Tokens still allowed by max_tokens."""
        return self.sampling.max_tokens - self.num_output_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def clamp_k(self, k: int, max_context: int) -> int:
        """Never propose past max_tokens (the bonus token fills the last slot) or the target's context."""
        return max(0, min(k, self.remaining - 1, max_context - len(self.token_ids)))

    def record_step(self, num_proposed: int, num_accepted: int, draft_forwards: int = 0,
                    draft_seconds: float = 0.0, target_seconds: float = 0.0) -> None:
        """Count one verification step in the request's stats."""
        self.k_history.append(num_proposed)
        self.stats.record_step(num_proposed, num_accepted)
        self.stats.target_forwards += 1
        self.stats.draft_forwards += draft_forwards
        self.stats.draft_seconds += draft_seconds
        self.stats.target_seconds += target_seconds

    def add_prompt_logprobs(self, entries: Sequence[TokenLogprob]) -> None:
        """The next prompt tokens' log-probabilities (from a prefill chunk), their texts filled in."""
        start = len(self.prompt_logprobs)
        decode = self.detokenizer.token_text
        self.prompt_logprobs.extend(
            dataclasses.replace(lp, token=decode(token), top_tokens=tuple(decode(t) for t, _ in lp.top))
            for token, lp in zip(self.token_ids[start:self.num_prompt_tokens], entries))

    def commit(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob] | None = None) -> StreamChunk:
        """Append verified tokens one by one until a stopping rule fires; return what was added (with
        the log-probabilities of the tokens kept, when given)."""
        added: list[int] = []
        text = []
        for token in token_ids:
            if self.finished:
                break
            token = int(token)
            self.token_ids.append(token)
            added.append(token)
            if token in self.eos_token_ids:
                self.finish_reason = "stop"
                break
            text.append(self.detokenizer.add(token))
            if self.detokenizer.stopped:
                self.finish_reason = "stop"
            elif self.remaining <= 0:
                self.finish_reason = "length"
        if self.finished:
            text.append(self.detokenizer.flush())
        kept = None
        if logprobs is not None:
            decode = self.detokenizer.token_text
            kept = [dataclasses.replace(lp, token=decode(token), top_tokens=tuple(decode(t) for t, _ in lp.top))
                    for token, lp in zip(added, logprobs)]
            self.logprobs.extend(kept)
        chunk = StreamChunk(added, "".join(text), self.finish_reason, logprobs=kept)
        if self.prompt_logprobs is not None and not self._prompt_logprobs_sent:
            chunk.prompt_logprobs, self._prompt_logprobs_sent = self.prompt_logprobs, True
        return chunk

    def output(self) -> GenerationOutput:
        decode = time.perf_counter() - self.started - self.prefill_seconds
        return GenerationOutput(
            text=self.detokenizer.text,
            token_ids=self.output_token_ids,
            finish_reason=self.finish_reason or "length",
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.num_output_tokens,
            speculative=self.stats,
            prefill_seconds=self.prefill_seconds,
            decode_seconds=decode,
            k_history=self.k_history,
            logprobs=self.logprobs if self.sampling.logprobs is not None else None,
            prompt_logprobs=self.prompt_logprobs,
            cached_tokens=self.cached_tokens,
        )
