"""Core configuration: what a request asks for (`SamplingParams`) and how the engine runs (`EngineConfig`).

Both are frozen dataclasses validated in `__post_init__`, so a bad value fails where it is made with a
`ValueError` naming the field. HTTP and file configs (pydantic) convert to these in one place.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from specdec.decoding.structured_output import Constraint

#: Temperatures below this sample greedily, as vLLM does: dividing logits by a smaller one overflows
#: float32 (every probability becomes NaN), and the limit of T -> 0 is the argmax anyway.
GREEDY_BELOW_TEMPERATURE = 1e-5

#: Environment variables are read here and nowhere else.
ENV_PREFIX = "SPECDEC_"


def env(name: str, default: str | None = None) -> str | None:
    """Read `SPECDEC_<name>` from the environment."""
    return os.environ.get(ENV_PREFIX + name, default)


def quiet_libraries() -> None:
    """Silence library chatter without importing the libraries (`models list` must not import torch):
    transformers reads TRANSFORMERS_VERBOSITY when it is first imported; a user's own setting wins."""
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")


#: The most alternatives a request may ask log-probabilities of, per token (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20

#: How a sampled request's tokens are drawn (see `sampling.py`).
SAMPLING_MODES = ("invariant", "residual")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. `temperature=0` (or below `GREEDY_BELOW_TEMPERATURE`) is greedy
    (top_k/top_p are then irrelevant)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    max_tokens: int | None = 256  # None: until EOS, a stop string or the end of the context
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # How speculation samples (`sampling.py`): "invariant" (the text depends only on the seed) or
    # "residual" (the most acceptance); None: the engine's `speculative_sampling`.
    speculative_sampling: str | None = None
    # What is done to the logits before warping (`logits_processing.py`), at every position of the
    # target and the draft alike: OpenAI's penalties over the output so far, HF's repetition penalty
    # over prompt and output, and additive biases per token id.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs; a dict is accepted
    # Log-probabilities of each emitted token from the target's verify pass, after the processing
    # and warping above: None (off), or how many of the most likely alternatives to list (0-20).
    logprobs: int | None = None
    # Log-probabilities of the prompt's tokens (vLLM's `prompt_logprobs`): the target's raw
    # log-softmax at each prompt position from the prefill (no penalties or warping: those shape the
    # output, not the prompt); the first token has none (NaN). None (off), or alternatives to list.
    prompt_logprobs: int | None = None
    # What the output must match (`structured_output.py`): a JSON schema, any JSON object, a regex,
    # a Lark grammar or a choice of strings; its mask applies to the target and the draft alike.
    structured: Constraint | None = None
    # No end-of-sequence token (nor `stop_token_ids`) before this many output tokens (HF's
    # MinNewTokensLengthLogitsProcessor: those tokens' logits are -inf).
    min_tokens: int = 0
    # More token ids that end the output (kept in it, as EOS is; OpenAI/vLLM's `stop_token_ids`).
    stop_token_ids: tuple[int, ...] = ()
    # Set by the engine at admission: where the prompt ends (output-only penalties count after it),
    # and the model's end-of-sequence ids (`min_tokens` holds them back).
    prompt_length: int = 0
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(tuple(pair) for pair in pairs))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = disabled), got {self.top_k!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                                            or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if (not isinstance(self.repetition_penalty, (int, float)) or isinstance(self.repetition_penalty, bool)
                or not 0.0 < self.repetition_penalty <= 10.0 or not math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be a number in (0, 10] (1 = off), got {self.repetition_penalty!r}")
        for pair in self.logit_bias:
            if (len(pair) != 2 or not isinstance(pair[0], int) or isinstance(pair[0], bool) or pair[0] < 0
                    or not isinstance(pair[1], (int, float)) or isinstance(pair[1], bool)
                    or not -100.0 <= pair[1] <= 100.0):
                raise ValueError(f"logit_bias must map token ids >= 0 to numbers in [-100, 100], got {pair!r}")
        if len({pair[0] for pair in self.logit_bias}) < len(self.logit_bias):
            raise ValueError("logit_bias: a token id appears twice")
        object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias)))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for token in self.stop_token_ids:
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(f"stop_token_ids must be token ids >= 0, got {token!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.structured is not None and not isinstance(self.structured, Constraint):
            raise ValueError(f"structured must be a structured_output.Constraint, got {type(self.structured).__name__}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (alternatives per token) or None, "
                             f"got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or isinstance(self.prompt_logprobs, bool)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, "
                             f"got {self.prompt_logprobs!r}")
        if self.speculative_sampling is not None and self.speculative_sampling not in SAMPLING_MODES:
            raise ValueError(f"speculative_sampling must be one of {', '.join(SAMPLING_MODES)}, "
                             f"got {self.speculative_sampling!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def processes_logits(self) -> bool:
        """Whether anything is done to the logits before warping (`logits_processing.py`)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.structured is not None or self.min_tokens)

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


#: What the draft model may run in (`draft_precision.py`); `auto` measures at load time.
DRAFT_PRECISIONS = ("auto", "none", "float32", "bfloat16", "int8", "int8-weight")

#: `num_speculative_tokens` accepts an int or this string.
AUTO = "auto"


#: The largest K: sliding-window layers keep 4x this to rewind (`kv_cache.ROLLBACK_TOKENS`).
MAX_SPECULATIVE_TOKENS = 64


@dataclass(frozen=True)
class EngineConfig:
    """How the engine is built: which models, where, and how much it speculates.

    `target` / `draft` are model specs (a local HF directory, a `.gguf` file, a hub id, or — for the
    draft — `ngram` / `none`). `num_speculative_tokens` is K, or `"auto"` to pick K per step.
    """

    target: str
    draft: str = "none"
    num_speculative_tokens: int | str = 4
    max_speculative_tokens: int = 8  # upper bound for k="auto"
    device: str | None = None  # None: cuda if available, else cpu
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    num_threads: int | None = None  # torch intra-op threads; None: leave torch's default
    ngram_min: int = 1
    ngram_max: int = 4
    # Kernels (see kernels/linear.py): how the target's linear layers run, and whether the draft is quantized.
    linear_kernel: str = "auto"  # auto | torch | onednn | hybrid
    draft_quantization: str = "auto"  # auto (measured, on CPU) | none | float32 | bfloat16 | int8 | int8-weight
    # The draft proposes from the N most frequent tokens (FR-Spec; None: the whole vocabulary).
    draft_vocab_size: int | None = None
    # Prompt-lookup matches of at least this many tokens propose before the draft model (0: never).
    ngram_first: int = 0
    trust_remote_code: bool = False  # run a model's own Python code (auto_map)
    allow_pickle_weights: bool = False  # load .bin/.pt pickles when a model has no safetensors
    # Batching (scheduler.py): requests decoded together per step, and the target tokens one step (or
    # one prefill chunk) may feed; requests beyond the batch wait in a queue.
    max_batch_size: int = 8
    max_batch_tokens: int = 512
    # How sampled requests that name no mode sample (SAMPLING_MODES; README "Guarantees").
    speculative_sampling: str = "invariant"

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target.strip():
            raise ValueError("target model must be given (a local directory, a .gguf file or a hub id)")
        k = self.num_speculative_tokens
        if isinstance(k, str):
            if k.strip().lower() == AUTO:
                object.__setattr__(self, "num_speculative_tokens", AUTO)
            else:
                try:
                    k = int(k)
                except ValueError:
                    raise ValueError(f"k must be an integer >= 1 or 'auto', got {k!r}") from None
                object.__setattr__(self, "num_speculative_tokens", k)
        k = self.num_speculative_tokens
        if k != AUTO and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"k must be an integer >= 1 or 'auto', got {k!r}")
        if not isinstance(self.max_speculative_tokens, int) or self.max_speculative_tokens < 1:
            raise ValueError(f"max_speculative_tokens must be >= 1, got {self.max_speculative_tokens!r}")
        if self.k_max > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"k must be at most {MAX_SPECULATIVE_TOKENS}, got {self.k_max}: sliding-window caches "
                             f"keep {MAX_SPECULATIVE_TOKENS * 4} positions to rewind a rejected proposal")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise ValueError(f"threads must be an integer >= 1, got {self.num_threads!r}")
        from specdec.kernels.linear import LINEAR_KERNELS

        if self.linear_kernel not in LINEAR_KERNELS:
            raise ValueError(f"linear kernel must be one of {', '.join(LINEAR_KERNELS)}; got {self.linear_kernel!r}")
        if self.draft_quantization not in DRAFT_PRECISIONS:
            raise ValueError(f"draft quantization must be one of {', '.join(DRAFT_PRECISIONS)}; "
                             f"got {self.draft_quantization!r}")
        for name in ("max_batch_size", "max_batch_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_batch_tokens < self.max_batch_size:
            raise ValueError(f"max_batch_tokens ({self.max_batch_tokens}) must be >= max_batch_size "
                             f"({self.max_batch_size}): every request in the batch feeds at least one token a step")
        if self.draft_vocab_size is not None and (isinstance(self.draft_vocab_size, bool) or not isinstance(
                self.draft_vocab_size, int) or self.draft_vocab_size < 1):
            raise ValueError(f"draft vocabulary size must be an integer >= 1 (or None: all), got {self.draft_vocab_size!r}")
        if self.speculative_sampling not in SAMPLING_MODES:
            raise ValueError(f"speculative_sampling must be one of {', '.join(SAMPLING_MODES)}, "
                             f"got {self.speculative_sampling!r}")
        if isinstance(self.ngram_first, bool) or not isinstance(self.ngram_first, int) or self.ngram_first < 0:
            raise ValueError(f"ngram_first must be an integer >= 0 (0: off), got {self.ngram_first!r}")
        if not (1 <= self.ngram_min <= self.ngram_max):
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")

    @property
    def auto_k(self) -> bool:
        return self.num_speculative_tokens == AUTO

    @property
    def k_max(self) -> int:
        """The largest K any step may use."""
        if self.auto_k:
            return self.max_speculative_tokens
        return int(self.num_speculative_tokens)
