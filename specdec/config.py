"""Core configuration: what a request asks for (`SamplingParams`) and how the engine runs (`EngineConfig`).

Both are frozen dataclasses validated in `__post_init__`, so a bad value fails where it is made with a
`ValueError` naming the field. HTTP and file configs (pydantic) convert to these in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass

from specdec.constraint import Constraint
from specdec.options import ConfigError, option

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


def parse_logit_bias(text: str) -> tuple[int, float]:
    """`--logit-bias ID=BIAS`."""
    token, sep, value = text.partition("=")
    try:
        if sep:
            return int(token), float(value)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected ID=BIAS (e.g. 42=-100), got {text!r}")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}


def parse_memory(text: str) -> tuple[str, float]:
    """`kv_cache_memory`: ("fraction", f) for auto or a number in (0, 1]; ("bytes", n) for a number
    above 1, with an optional unit (8e9, 8GB, 8GiB)."""
    import re

    if not isinstance(text, str):
        text = str(text)
    value = text.strip().lower()
    if value == "auto":
        return "fraction", 0.5
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?b|b)?", value)
    if not match:
        raise ValueError(f"expected bytes (8e9, 8GB, 8GiB), a fraction of available memory (0.5) or auto, got {text!r}")
    number = float(match.group(1))
    if number <= 0:
        raise ValueError(f"must be positive, got {text!r}")
    if match.group(2) is None and number <= 1:
        return "fraction", number
    return "bytes", number * _UNITS[match.group(2) or ""]


def _check_int(name: str, value, minimum: int | None, maximum: int | None = None, none_ok: bool = False,
               note: str = "") -> None:
    """`value` is an integer (not a bool) in [minimum, maximum] (None: unbounded), or None if `none_ok`."""
    if value is None and none_ok:
        return
    if (isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)):
        bounds = (f" in [{minimum}, {maximum}]" if maximum is not None else
                  f" >= {minimum}" if minimum is not None else "")
        raise ConfigError(name, f"{name} must be an integer{bounds}{note}{' or None' if none_ok else ''}, "
                                f"got {value!r}")


def _check_number(name: str, value, low: float, high: float | None, low_open: bool = False, note: str = "") -> None:
    """`value` is a finite number (not a bool) in [low, high] ((low, high] if `low_open`; high None: unbounded)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (value > low if low_open else value >= low) and (high is None or value <= high)
    if not ok:
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]" if high is not None else None
        raise ConfigError(name, f"{name} must be a number in {bounds}{note}, got {value!r}" if bounds else
                                f"{name} must be a finite number >= {low:g}{note}, got {value!r}")


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(name, f"{name} must be one of {', '.join(choices)}; got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. `temperature=0` (or below `GREEDY_BELOW_TEMPERATURE`) is greedy
    (top_k/top_p are then irrelevant)."""

    temperature: float = option(0.0, help="0 = greedy")
    top_p: float = option(1.0, help="nucleus sampling: keep the most likely tokens up to this mass, in (0, 1]")
    top_k: int = option(0, help="keep the k most likely tokens; 0 = off")
    max_tokens: int | None = option(256, help="tokens to generate at most (None: until EOS, a stop string or the "
                                              "end of the context)")
    seed: int | None = option(None, help="makes sampled output reproducible")
    stop: tuple[str, ...] = option((), append=True, metavar="STR",
                                   help="stop when this string appears (not included in the text); repeatable")
    ignore_eos: bool = option(False, help="keep generating past the end-of-sequence token")
    # How speculation samples (`sampling.py`): "invariant" (the text depends only on the seed) or
    # "residual" (the most acceptance); None: the engine's `speculative_sampling`.
    speculative_sampling: str | None = None
    # What is done to the logits before warping (`logits_processing.py`), at every position of the
    # target and the draft alike: OpenAI's penalties over the output so far, HF's repetition penalty
    # over prompt and output, and additive biases per token id.
    presence_penalty: float = option(0.0, help="subtracted from the logits of tokens already in the output, "
                                               "in [-2, 2]")
    frequency_penalty: float = option(0.0, help="times a token's count in the output, subtracted from its logit, "
                                                "in [-2, 2]")
    repetition_penalty: float = option(1.0, help="HF's: divides positive and multiplies negative logits of tokens "
                                                 "in the prompt or output (1 = off)")
    logit_bias: tuple[tuple[int, float], ...] = option(  # (token id, bias) pairs; a dict is accepted
        (), append=True, parse=parse_logit_bias, metavar="ID=BIAS",
        help="add BIAS in [-100, 100] to token ID's logit; repeatable")
    # Log-probabilities of each emitted token from the target's verify pass, after the processing
    # and warping above: None (off), or how many of the most likely alternatives to list (0-20).
    logprobs: int | None = option(None, metavar="N", help="each token's log-probability and its N most likely "
                                                          "alternatives (0-20; the command line prints them "
                                                          "with --json)")
    # Log-probabilities of the prompt's tokens (vLLM's `prompt_logprobs`): the target's raw
    # log-softmax at each prompt position from the prefill (no penalties or warping: those shape the
    # output, not the prompt); the first token has none (NaN). None (off), or alternatives to list.
    prompt_logprobs: int | None = None
    # What the output must match (`structured_output.py`): a JSON schema, any JSON object, a regex,
    # a Lark grammar or a choice of strings; its mask applies to the target and the draft alike.
    structured: Constraint | None = None
    # No end-of-sequence token (nor `stop_token_ids`) before this many output tokens (HF's
    # MinNewTokensLengthLogitsProcessor: those tokens' logits are -inf).
    min_tokens: int = option(0, metavar="N", help="no end-of-sequence token (nor --stop-token-id) before N "
                                                  "output tokens")
    # More token ids that end the output (kept in it, as EOS is; OpenAI/vLLM's `stop_token_ids`).
    stop_token_ids: tuple[int, ...] = option((), append=True, flag="--stop-token-id", metavar="ID",
                                             help="this token id ends the output (kept in it); repeatable")
    # Set by the engine at admission: where the prompt ends (output-only penalties count after it),
    # and the model's end-of-sequence ids (`min_tokens` holds them back).
    prompt_length: int = 0
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        """Normalize the collections (a dict of biases, one stop string), then check every field with
        the shared checks: a bad value raises `ConfigError` naming its field (a 400 over HTTP)."""
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(tuple(pair) for pair in pairs))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_number("temperature", self.temperature, 0.0, None, note=" (0 = greedy)")
        _check_number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, 0, note=" (0 = disabled)")
        _check_int("max_tokens", self.max_tokens, 1, none_ok=True)
        _check_int("seed", self.seed, None, none_ok=True)
        _check_int("min_tokens", self.min_tokens, 0)
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_number("repetition_penalty", self.repetition_penalty, 0.0, 10.0, low_open=True, note=" (1 = off)")
        _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS, none_ok=True, note=" (alternatives per token)")
        _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS, none_ok=True)
        if self.speculative_sampling is not None:
            _check_choice("speculative_sampling", self.speculative_sampling, SAMPLING_MODES)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError("stop", f"stop strings must be non-empty strings, got {self.stop!r}")
        for token in self.stop_token_ids:
            _check_int("stop_token_ids", token, 0)
        for pair in self.logit_bias:
            if len(pair) != 2:
                raise ConfigError("logit_bias", f"logit_bias must map token ids to biases, got {pair!r}")
            _check_int("logit_bias", pair[0], 0, note=" (token ids)")
            _check_number("logit_bias", pair[1], -100.0, 100.0, note=" (biases)")
        if len({pair[0] for pair in self.logit_bias}) < len(self.logit_bias):
            raise ConfigError("logit_bias", "logit_bias: a token id appears twice")
        object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias)))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ConfigError("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                                            f"({self.max_tokens})")
        if self.structured is not None and not isinstance(self.structured, Constraint):
            raise ConfigError("structured", f"structured must be a specdec.constraint.Constraint, got "
                                            f"{type(self.structured).__name__}")

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


#: What the draft model may run in (`kernels/draft_precision.py`); `auto` measures at load time.
DRAFT_PRECISIONS = ("auto", "none", "float32", "bfloat16", "int8", "int8-weight", "int4")

#: How the target's linear layers run (`kernels/linear.py`); `auto` measures at load time.
LINEAR_KERNELS = ("auto", "torch", "onednn", "hybrid")

#: What the target's weights run as (`kernels/target_precision.py`); `auto` measures at load time.
TARGET_PRECISIONS = ("auto", "float32", "int4", "int8-weight")

DTYPES = ("auto", "float32", "bfloat16", "float16")

#: `num_speculative_tokens` accepts an int or this string.
AUTO = "auto"


#: The largest K: sliding-window layers keep 4x this to rewind (`kv_cache.ROLLBACK_TOKENS`).
MAX_SPECULATIVE_TOKENS = 64


def parse_k(text: str) -> int | str:
    """`--num-speculative-tokens`: an integer or 'auto'."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'auto', got {text!r}") from None


@dataclass(frozen=True)
class EngineConfig:
    """How the engine is built: which models, where, and how much it speculates.

    Every option of every interface is declared here once (`specdec.options`): the `specdec`
    flags, `specdec serve`'s options and `specdec bench`'s are derived from these fields.
    """

    target: str = option(help="target model: a preset (see `specdec models list`), a local HF model directory, a "
                              ".gguf file, or a hub id", metavar="MODEL")
    draft: str = option("none", help="draft: a smaller model sharing the target's tokenizer, 'ngram' (prompt "
                                     "lookup) or 'none' (target only); unset: the preset's suggested draft, else "
                                     "ngram", metavar="MODEL|ngram|none")
    num_speculative_tokens: int | str = option(4, short="-k", parse=parse_k, metavar="N|auto",
                                               help="K, the speculative tokens per step, or 'auto' to choose K "
                                                    "per step from measured acceptance and cost")
    max_speculative_tokens: int = option(8, metavar="N", help="the largest K 'auto' may choose")
    device: str | None = option(None, help="cpu, cuda, cuda:1 ... [default: cuda if available]")
    dtype: str = option("auto", choices=DTYPES, help="weights dtype (auto: float32 on CPU, bfloat16 on GPU)")
    num_threads: int | None = option(None, metavar="N", help="torch threads per process (set it to your physical "
                                                             "cores; oversubscription is slow)")
    ngram_min: int = option(1, metavar="N", help="prompt lookup: the shortest n-gram to match")
    ngram_max: int = option(4, metavar="N", help="prompt lookup: the longest n-gram to match")
    linear_kernel: str = option(
        "auto", choices=LINEAR_KERNELS,
        help="CPU kernel of the target's linear layers: oneDNN prepacked weights make verify passes nearly as "
             "cheap as one token (prepacking takes ~3 s for a 1.5B model); hybrid also uses MKL for 1-3 rows; "
             "torch is stock F.linear; auto = the fastest, measured on this CPU at the first load (CPU float32), "
             "cached; torch elsewhere")
    target_precision: str = option(
        "auto", choices=TARGET_PRECISIONS,
        help="what the target's weights run as: float32 (the model as loaded; the exact reference against HF), "
             "int4 (a GGUF file's own 4-bit codes, groups of 32; its Q6_K/Q8_0 tensors int8 weight-only; a float "
             "checkpoint rounded to nearest), int8-weight (per output channel); auto = for a model with 4-bit "
             "codes (the presets, a .gguf file) the faster of int4 and float32, measured on this CPU at the first "
             "load and cached; float32 for a float checkpoint. Speculation is exact at every precision")
    draft_precision: str = option(
        "auto", choices=DRAFT_PRECISIONS,
        help="precision of the draft model (lossless: it only proposes): none (as loaded), float32 (oneDNN "
             "prepacked), bfloat16 (oneDNN; CPUs with native bfloat16), int8 (dynamic), int8-weight (weight-only); "
             "auto = the best expected speedup among all but int8 (its batch-wide activation scales make "
             "proposals depend on batch-mates), measured on this CPU at the first load, cached")
    draft_vocab_size: int | None = option(None, metavar="N",
                                          help="the draft proposes from the N most frequent tokens only (FR-Spec; "
                                               "exact: the target still verifies over the whole vocabulary) "
                                               "[default: the whole vocabulary]")
    prompt_lookup_min: int = option(0, metavar="N", help="a prompt-lookup match of at least N tokens proposes for "
                                                         "free before the draft model (0 = off)")
    trust_remote_code: bool = option(False, help="run Python code shipped with a model (auto_map in its config); "
                                                 "only for code you have read")
    allow_pickle_weights: bool = option(False, help="load .bin/.pt weights (Python pickles: they can run code as "
                                                    "they load) when a model has no safetensors; only for files "
                                                    "you trust [default: safetensors and GGUF only]")
    prefix_caching: bool = option(True, help="reuse the KV of earlier requests' prompts (finished or running) for "
                                             "new prompts that start with the same tokens, so a request prefills "
                                             "only what is new; a hit's speed can tell a client that another "
                                             "one sent the same prefix (docs/serving.md#prefix-caching)")
    kv_cache_memory: str = option(
        "auto", metavar="BYTES|FRACTION",
        help="the KV memory budget of running requests plus cached prefixes, per replica: bytes (8e9, 8GB, "
             "8GiB) or a fraction of the memory available once the models are loaded (0.5); auto = 0.5. A "
             "request waits while the budget is full, one that could never fit gets an error")
    # Batching (engine/scheduler.py): requests beyond the batch wait in a queue.
    max_batch_size: int = option(8, cli=False, help="requests decoded together per step")
    max_batch_tokens: int = option(512, cli=False, help="target tokens one step (or one prefill chunk) may feed")
    speculative_sampling: str = option(
        "invariant", choices=SAMPLING_MODES,
        help="how sampled requests that name no mode sample: invariant (a seed gives the target-only text, "
             "whatever the draft, K or load) or residual (rejection sampling: the most acceptance; the text also "
             "depends on the draft and K)")

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target.strip():
            raise ConfigError("target", "target model must be given (a local directory, a .gguf file or a hub id)")
        k = self.num_speculative_tokens
        if isinstance(k, str):
            try:
                object.__setattr__(self, "num_speculative_tokens", parse_k(k))
            except argparse.ArgumentTypeError:
                raise ConfigError("num_speculative_tokens", f"num_speculative_tokens must be an integer >= 1 or "
                                                            f"'auto', got {k!r}") from None
        if not self.auto_k:
            _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, note=" or 'auto'")
        _check_int("max_speculative_tokens", self.max_speculative_tokens, 1)
        if self.speculative_tokens_limit > MAX_SPECULATIVE_TOKENS:
            name = "max_speculative_tokens" if self.auto_k else "num_speculative_tokens"
            raise ConfigError(name, f"{name} must be at most {MAX_SPECULATIVE_TOKENS}, got "
                                    f"{self.speculative_tokens_limit}: sliding-window caches keep "
                                    f"{MAX_SPECULATIVE_TOKENS * 4} positions to rewind a rejected proposal")
        _check_choice("dtype", self.dtype, DTYPES)
        _check_int("num_threads", self.num_threads, 1, none_ok=True)
        _check_choice("linear_kernel", self.linear_kernel, LINEAR_KERNELS)
        _check_choice("draft_precision", self.draft_precision, DRAFT_PRECISIONS)
        _check_choice("target_precision", self.target_precision, TARGET_PRECISIONS)
        _check_int("max_batch_size", self.max_batch_size, 1)
        _check_int("max_batch_tokens", self.max_batch_tokens, 1)
        if self.max_batch_tokens < self.max_batch_size:
            raise ConfigError("max_batch_tokens", f"max_batch_tokens ({self.max_batch_tokens}) must be >= "
                                                  f"max_batch_size ({self.max_batch_size}): every request in the "
                                                  f"batch feeds at least one token a step")
        _check_int("draft_vocab_size", self.draft_vocab_size, 1, none_ok=True)
        _check_choice("speculative_sampling", self.speculative_sampling, SAMPLING_MODES)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 0, note=" (0: off)")
        try:
            parse_memory(self.kv_cache_memory)
        except ValueError as e:
            raise ConfigError("kv_cache_memory", f"kv_cache_memory: {e}") from None
        _check_int("ngram_min", self.ngram_min, 1)
        if not self.ngram_min <= self.ngram_max:
            raise ConfigError("ngram_max", f"need ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")

    @property
    def auto_k(self) -> bool:
        return self.num_speculative_tokens == AUTO

    @property
    def speculative_tokens_limit(self) -> int:
        """Not an option: the largest K any step may use, `max_speculative_tokens` with 'auto' and
        `num_speculative_tokens` otherwise (it sizes buffers and the sliding-window rewind)."""
        if self.auto_k:
            return self.max_speculative_tokens
        return int(self.num_speculative_tokens)
