"""What precision the draft runs in, and how `auto` chooses it: by measuring, at load time.

A draft only proposes, so its precision never changes the output (the target verifies every token
at its own precision; greedy output stays the target's, sampling stays exact). It changes two
things that decide the speedup: the draft's cost per token (c, relative to one target forward) and
how often its proposals are accepted (alpha). Candidates (`DRAFT_PRECISIONS`):

- `none`: the draft as loaded (float32 on the CPU);
- `bfloat16`: bfloat16 weights and activations, linear layers prepacked for oneDNN (AMX on a
  Sapphire Rapids CPU): ~4x cheaper than float32 for the 0.5B Qwen draft, argmax nearly unchanged;
- `int8`: dynamic int8 (fbgemm): weights and each call's activations quantized per tensor;
  cheapest, but the activations' rounding moves the argmax (SmolLM2-135M as its own draft: 38%
  acceptance instead of 100%);
- `int8-weight`: weight-only int8 with per-channel scales, bfloat16 activations.

`auto` (the default on the CPU) calibrates: one target forward over a short built-in text
(code and prose, `CALIBRATION_TEXT`) gives the target's argmax at every position; each candidate
runs the same text (its agreement with the target there estimates its per-token acceptance alpha)
and a few single-token decode steps (its cost). The target's own single-token cost gives c. The
candidate with the best expected speedup (Leviathan et al., arXiv 2211.17192: max over K of
(1 - a^(K+1)) / ((1 - a)(cK + v(K))), with v(K) the verify pass's cost at K+1 tokens relative to
one, ~1 + 0.05 K with the prepacked target kernels) wins; `none` is a candidate, so `auto` never
picks a precision it expects to lose to the unquantized draft. Without the target at hand (the Ray
draft worker) the reference is the float32 draft itself: alpha is taken as 0.8 x its agreement,
and the target's cost as 3x the float32 draft's. The decision is cached per (models, settings,
CPU, torch) in `$SPECDEC_CACHE/calibration/`, so later loads skip the measurement.

On a GPU, `auto` keeps the draft as loaded (bfloat16 there already).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdec import model_cache
from specdec.config import DRAFT_PRECISIONS
from specdec.kernels import Int8WeightLinear, onednn_available, pack_linears, replace_linears
from specdec.speculation_length import expected_tokens

logger = logging.getLogger(__name__)

#: The candidates `auto` measures, in order of preference on a tie.
CANDIDATES = ("none", "bfloat16", "int8-weight", "int8")

#: The verify pass of K+1 tokens costs about 1 + VERIFY_SLOPE * K single-token forwards with the
#: prepacked target kernels (kernels.py: 5 tokens ~1.06x, 9 ~1.3x).
VERIFY_SLOPE = 0.05
#: Without the target (Ray draft worker): the float32 draft's assumed acceptance and cost ratio.
ASSUMED_ALPHA, ASSUMED_COST_RATIO = 0.8, 1 / 3

#: What `auto` measures on: short, mixed (Python, SQL, shell, JSON, English), fixed so decisions are
#: comparable across runs. ~300 tokens with Qwen's tokenizer.
CALIBRATION_TEXT = '''def merge_sorted(left: list[int], right: list[int]) -> list[int]:
    """Merge two sorted lists into one sorted list."""
    result = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    result.extend(left[i:])
    result.extend(right[j:])
    return result

SELECT name, COUNT(*) AS orders FROM customers JOIN orders ON orders.customer_id = customers.id
GROUP BY name ORDER BY orders DESC LIMIT 10;

for f in *.log; do gzip -9 "$f"; done
{"id": 42, "name": "widget", "tags": ["blue", "small"], "price": 9.99}

Speculative decoding lets a small model propose several tokens that the large model then checks
in a single pass, so the answer is exactly the one the large model would have written alone.
'''


def check_precision(precision: str) -> str:
    if precision not in DRAFT_PRECISIONS:
        raise ValueError(f"draft quantization must be one of {', '.join(DRAFT_PRECISIONS)}; got {precision!r}")
    return precision


#: Precisions whose prepared tensors are cached on disk (`prepared_weights.py`): the ones whose
#: preparation computes. int8 dynamic keeps float32 tensors (fbgemm packs them in memory), `none` too.
CACHED_PRECISIONS = ("int8-weight", "bfloat16")


def shallow_copy(model: torch.nn.Module, device: str | None = None) -> torch.nn.Module:
    """A copy of `model`'s modules and config over the SAME parameter tensors (no weight is copied;
    tied parameters stay tied). Converting the copy (`.to`, replacing modules) leaves `model` as it
    is. `device="meta"`: over empty meta tensors instead, a skeleton to load prepared weights into."""
    memo = {}
    for p in model.parameters():
        data = torch.empty_like(p, device="meta") if device == "meta" else p.detach()
        memo[id(p)] = torch.nn.Parameter(data, requires_grad=False)
    return copy.deepcopy(model, memo)


def _convert(draft: torch.nn.Module, precision: str, vocab_token_ids: torch.Tensor | None) -> torch.nn.Module:
    """The plain-tensor part of preparing (cacheable): dtype, reduced vocabulary, int8 weights."""
    if precision in ("bfloat16", "int8-weight"):
        draft.to(torch.bfloat16)
    if vocab_token_ids is not None:
        from specdec.draft_vocab import restrict_vocab

        restrict_vocab(draft, vocab_token_ids)
    if precision == "int8-weight":
        replace_linears(draft, Int8WeightLinear, torch.bfloat16)
    return draft


def _finalize(draft: torch.nn.Module, precision: str) -> torch.nn.Module:
    """The in-memory kernel layouts (not cacheable: opaque to safetensors)."""
    if precision == "int8":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao's deprecation notices: the kernels are what we want
            draft = torch.ao.quantization.quantize_dynamic(draft, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    elif precision == "bfloat16" and onednn_available():
        pack_linears(draft, keep_weight=False, batch_hint=1, dtype=torch.bfloat16)
    return draft.eval()


def prepare_draft(model: torch.nn.Module, precision: str, vocab_token_ids: torch.Tensor | None = None,
                  source: str = "") -> torch.nn.Module:
    """The draft model to propose with: `model` itself (`none`, full vocabulary) or a copy at
    `precision`, its head restricted to `vocab_token_ids` when given. `model` is never modified (it
    may be the target, or shared with other engines). With `source` (the directory `model` was
    loaded from), the prepared tensors are read from / written to the on-disk cache."""
    check_precision(precision)
    if precision == "auto":
        raise ValueError("resolve 'auto' with choose_precision first")
    on_cpu = next(model.parameters()).device.type == "cpu"
    if precision != "none" and not on_cpu:
        raise ValueError(f"the {precision} draft precision runs on the CPU only")
    if precision == "none" and vocab_token_ids is None:
        return model
    cache = bool(source) and precision in CACHED_PRECISIONS and Path(source).is_dir()
    if cache:
        from specdec import prepared_weights

        key = prepared_weights.key_for(source, precision, vocab_token_ids)
        draft = prepared_weights.load(_convert(shallow_copy(model, "meta"), precision, vocab_token_ids), key)
        if draft is not None:
            return _finalize(draft, precision)
    draft = _convert(shallow_copy(model), precision, vocab_token_ids)
    if cache:
        prepared_weights.save(draft, key)
    return _finalize(draft, precision)


@dataclass(frozen=True)
class Measurement:
    """One candidate on the calibration text."""

    precision: str
    agreement: float  # share of positions where its argmax equals the reference's
    alpha: float  # estimated per-token acceptance
    seconds: float  # one single-token decode forward
    cost_ratio: float  # c: seconds / the target's single-token forward
    speedup: float  # expected, at its best K
    best_k: int


def expected_speedup(alpha: float, c: float, k_max: int = 8) -> tuple[float, int]:
    """max over K of Leviathan's expected speedup with a verify pass costing 1 + VERIFY_SLOPE * K."""
    best = max(range(1, k_max + 1), key=lambda k: expected_tokens(alpha, k) / (c * k + 1 + VERIFY_SLOPE * k))
    return expected_tokens(alpha, best) / (c * best + 1 + VERIFY_SLOPE * best), best


@torch.inference_mode()
def _run(model: torch.nn.Module, input_ids: torch.Tensor, decode_steps: int) -> tuple[torch.Tensor, float]:
    """Argmax at every position of `input_ids` `[1, T]` -> `[T]`, and the median single-token decode time."""
    from transformers import DynamicCache

    cache = DynamicCache()
    out = model(input_ids=input_ids, past_key_values=cache, use_cache=True)
    argmax = out.logits[0].float().argmax(dim=-1)  # [T]
    token = argmax[-1:].view(1, 1)
    times = []
    for step in range(decode_steps + 1):  # the first builds kernels (oneDNN primitives)
        start = time.perf_counter()
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        if step >= 1:
            times.append(time.perf_counter() - start)
        token = out.logits[:, -1:].float().argmax(dim=-1)
    times.sort()
    return argmax, times[len(times) // 2]


def calibration_ids(tokenizer, vocab_size: int, max_tokens: int = 128) -> torch.Tensor:
    """`CALIBRATION_TEXT` tokenized, `[1, T]`; a tokenizer that cannot spell it (a tiny test
    vocabulary) gets a fixed pseudo-random id sequence instead."""
    ids = [i for i in tokenizer(CALIBRATION_TEXT, add_special_tokens=False)["input_ids"] if 0 <= i < vocab_size]
    if len(ids) < 16:
        ids = torch.randint(0, vocab_size, (max_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    return torch.tensor([ids[:max_tokens]], dtype=torch.long)


def measure(candidates: dict[str, torch.nn.Module], input_ids: torch.Tensor, target: torch.nn.Module | None,
            decode_steps: int = 4, k_max: int = 8) -> list[Measurement]:
    """Measure every candidate on `input_ids` against `target` (or, without it, the `none` candidate)."""
    if target is not None:
        reference, target_seconds = _run(target, input_ids, decode_steps)
    else:
        reference, target_seconds = None, None
    runs = {}
    for name, model in candidates.items():
        try:
            runs[name] = _run(model, input_ids, decode_steps)
        except (RuntimeError, NotImplementedError) as e:  # a kernel this CPU or torch build lacks
            if name == "none":
                raise
            logger.info("draft precision %s does not run here: %s", name, e)
    if reference is None:
        reference = runs["none"][0]
        target_seconds = runs["none"][1] / ASSUMED_COST_RATIO
    results = []
    for name, (argmax, seconds) in runs.items():
        # Position t predicts token t+1: compare the predictions, the last one included.
        agreement = float((argmax == reference).float().mean())
        alpha = agreement if target is not None else ASSUMED_ALPHA * agreement
        c = seconds / target_seconds
        speedup, best_k = expected_speedup(min(alpha, 0.999), c, k_max)
        results.append(Measurement(name, agreement, alpha, seconds, c, speedup, best_k))
    return results


def pick(measurements: list[Measurement]) -> Measurement:
    """The best expected speedup; on a tie (within 1%), the earlier candidate in `CANDIDATES`."""
    best = max(m.speedup for m in measurements)
    return min((m for m in measurements if m.speedup >= 0.99 * best), key=lambda m: CANDIDATES.index(m.precision))


def _decision_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return model_cache.cache_root() / "calibration" / f"{digest}.json"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return hashlib.sha256(line.encode()).hexdigest()[:12]
    except OSError:
        pass
    return platform.machine()


def choose_precision(draft_model: torch.nn.Module, tokenizer, *, draft_source: str = "",
                     target_model: torch.nn.Module | None = None, target_source: str = "",
                     vocab_token_ids: torch.Tensor | None = None, k_max: int = 8,
                     use_cache: bool = True) -> tuple[str, list[Measurement]]:
    """Resolve `auto`: the candidate with the best expected speedup (module docstring), and the
    measurements (empty when the decision came from the cache or there was nothing to measure)."""
    if next(draft_model.parameters()).device.type != "cpu":
        return "none", []
    key = {"draft": model_cache.weights_id(draft_source),
           "target": model_cache.weights_id(target_source) if target_model is not None else None,
           "vocab": None if vocab_token_ids is None else int(vocab_token_ids.numel()),
           "threads": torch.get_num_threads(), "cpu": _cpu_flags(), "torch": torch.__version__,
           "onednn": onednn_available(), "candidates": CANDIDATES, "version": 1}
    path = _decision_path(key)
    if use_cache and draft_source:
        try:
            cached = json.loads(path.read_text())
            if cached.get("key") == json.loads(json.dumps(key)) and cached.get("precision") in CANDIDATES:
                logger.info("draft precision %s (measured before: %s)", cached["precision"], path)
                return cached["precision"], []
        except (OSError, ValueError):
            pass
    start = time.perf_counter()
    candidates = {}
    for name in CANDIDATES:
        try:
            candidates[name] = prepare_draft(draft_model, name, vocab_token_ids)
        except (RuntimeError, ValueError) as e:  # a kernel this CPU or build lacks
            logger.info("draft precision %s is not available here: %s", name, e)
    vocab_size = draft_model.get_output_embeddings().out_features
    measurements = measure(candidates, calibration_ids(tokenizer, vocab_size), target_model, k_max=k_max)
    del candidates
    chosen = pick(measurements)
    logger.info("draft precision %s chosen in %.1fs: %s", chosen.precision, time.perf_counter() - start,
                "; ".join(f"{m.precision} agreement {m.agreement:.2f} c {m.cost_ratio:.3f} "
                          f"speedup {m.speedup:.2f}" for m in measurements))
    if use_cache and draft_source:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"key": key, "precision": chosen.precision,
                           "measurements": [asdict(m) for m in measurements]}, f, indent=1)
            os.replace(tmp, path)
        except OSError as e:
            logger.warning("could not cache the draft precision decision in %s: %s", path, e)
    return chosen.precision, measurements
