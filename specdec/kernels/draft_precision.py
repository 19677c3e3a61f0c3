"""What precision the draft runs in, and how `auto` chooses it: by measuring, at load time.

A draft only proposes, so its precision never changes the output (the target verifies every token
at its own precision; greedy output stays the target's, sampling stays exact). It changes two
things that decide the speedup: the draft's cost per token (c, relative to one target forward) and
how often its proposals are accepted (alpha). Candidates (`DRAFT_PRECISIONS`):

- `none`: the draft as loaded (float32 on the CPU, stock `F.linear` on memory-mapped weights);
- `float32`: float32 with the linear layers prepacked for oneDNN, as the target's: the same
  numbers, summed in another order; what wins on a CPU without native bfloat16 (AVX2-only);
- `bfloat16`: bfloat16 weights and activations, linear layers prepacked for oneDNN (AMX on a
  Sapphire Rapids CPU): ~4x cheaper than float32 for the 0.5B Qwen draft, argmax nearly unchanged.
  Measured only where the CPU has bfloat16 instructions (AVX512-BF16 or AMX; `specdec/kernels/cpu.py`):
  elsewhere it is emulated and never cheaper, and the calibration log says it was skipped;
- `int8`: dynamic int8 (fbgemm): weights and each call's activations quantized per tensor;
  cheapest, but the activations' rounding moves the argmax (SmolLM2-135M as its own draft: 38%
  acceptance instead of 100%);
- `int8-weight`: weight-only int8 with per-channel scales, bfloat16 activations;
- `int4`: a GGUF draft's own 4-bit codes (Q4_K), its other tensors (the 0.5B preset's Q5_0, Q8_0, Q6_K)
  rounded to nearest in int4 too (a draft only proposes: speed over closeness); a
  float checkpoint rounded to nearest per group of 32 (`target_precision.apply_precision`).

`auto` (the default on the CPU) calibrates: one target forward over a short built-in text
(code and prose, `CALIBRATION_TEXT`) gives the target's argmax at every position; each candidate
runs the same text (its agreement with the target there estimates its per-token acceptance alpha).
Costs are timed as decoding pays them: single-token forwards through `ModelRunner` on a `KVCache`
(the path the proposer uses), the target's and every candidate's interleaved over rounds, each
taking its minimum (`calibration.py`: load only ever adds time). The figures must be physically
possible (`cost_bound`: a draft with a third of the target's weights cannot cost 0.6 of it) or
they are measured again; if they stay impossible, the prior for the CPU class (`prior_precision`)
is used. The candidate with the best expected speedup (Leviathan et al., arXiv 2211.17192: max over
K of (1 - a^(K+1)) / ((1 - a)(cK + v(K))), with v(K) the verify pass's cost at K+1 tokens relative
to one, from the target kernel's own calibration, ~1 + 0.05 K with prepacked kernels) wins; `none`
is a candidate, so `auto` never picks a precision it expects to lose to the draft as loaded.
Without the target at hand (the Ray draft worker) the reference is the float32 draft itself: alpha
is taken as 0.8 x its agreement, and the target's cost as 3x the float32 draft's. The decision is
cached per (models, settings, CPU model and flags, threads, torch) in `$SPECDEC_CACHE/calibration/`
only when it was measured on a quiet machine, and measured again when serving contradicts it.

On a GPU, `auto` keeps the draft as loaded (bfloat16 there already).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdec.models import model_cache
from specdec.kernels.cpu import cpu_info
from specdec.config import DRAFT_PRECISIONS
from specdec.kernels.linear import Int8WeightLinear, onednn_available, pack_linears, replace_linears
from specdec.speedup import expected_tokens

logger = logging.getLogger(__name__)

#: The candidates `auto` measures, in order of preference on a tie. Dynamic `int8` is never among
#: them: it quantizes each linear's input with one scale over the whole batch, so a row's proposals
#: (and a `residual` request's seeded text) would depend on its batch-mates. Ask for it by name.
CANDIDATES = ("none", "float32", "bfloat16", "int8-weight", "int4")

#: The verify pass of K+1 tokens costs about 1 + VERIFY_SLOPE * K single-token forwards with the
#: prepacked target kernels (linear.py: 5 tokens ~1.06x, 9 ~1.3x).
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


def _convert(draft: torch.nn.Module, precision: str, vocab_token_ids: torch.Tensor | None,
             source: str = "") -> torch.nn.Module:
    """The plain-tensor part of preparing (cacheable): dtype, reduced vocabulary, int8 or int4 weights."""
    if precision in ("bfloat16", "int8-weight"):
        draft.to(torch.bfloat16)
    if vocab_token_ids is not None:
        from specdec.models.draft_vocab import restrict_vocab

        restrict_vocab(draft, vocab_token_ids)
    if precision == "int8-weight":
        replace_linears(draft, Int8WeightLinear, torch.bfloat16)
    elif precision == "int4":
        from specdec.kernels.target_precision import apply_precision, codes_source, iter_codes

        apply_precision(draft, "int4", iter_codes(codes_source(source), draft) if source else (), uncoded="int4")
    return draft


def _finalize(draft: torch.nn.Module, precision: str) -> torch.nn.Module:
    """The in-memory kernel layouts (not cacheable: opaque to safetensors)."""
    if precision == "int8":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao's deprecation notices: the kernels are what we want
            draft = torch.ao.quantization.quantize_dynamic(draft, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    elif precision == "bfloat16" and onednn_available():
        pack_linears(draft, keep_weight=False, batch_hint=1, dtype=torch.bfloat16)
    elif precision == "float32":
        if not onednn_available():
            raise ValueError("the float32 draft precision prepacks for oneDNN, which this torch build lacks")
        pack_linears(draft, keep_weight=False, batch_hint=1, dtype=torch.float32)
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
        from specdec.models import prepared_weights

        key = prepared_weights.key_for(source, precision, vocab_token_ids)
        draft = prepared_weights.load(_convert(shallow_copy(model, "meta"), precision, vocab_token_ids), key)
        if draft is not None:
            return _finalize(draft, precision)
    draft = _convert(shallow_copy(model), precision, vocab_token_ids, source)
    if cache:
        prepared_weights.save(draft, key)
    return _finalize(draft, precision)


@dataclass(frozen=True)
class Measurement:
    """One candidate on the calibration text."""

    precision: str
    agreement: float  # share of positions where its argmax equals the reference's
    alpha: float  # estimated per-token acceptance
    seconds: float  # one single-token decode forward (minimum over the rounds)
    cost_ratio: float  # c: seconds / the target's single-token forward
    speedup: float  # expected, at its best K
    best_k: int


def expected_speedup(alpha: float, c: float, speculative_tokens_limit: int = 8, verify_slope: float = VERIFY_SLOPE) -> tuple[float, int]:
    """max over K of Leviathan's expected speedup with a verify pass costing 1 + verify_slope * K."""
    best = max(range(1, speculative_tokens_limit + 1), key=lambda k: expected_tokens(alpha, k) / (c * k + 1 + verify_slope * k))
    return expected_tokens(alpha, best) / (c * best + 1 + verify_slope * best), best


def calibration_ids(tokenizer, vocab_size: int, max_tokens: int = 128) -> torch.Tensor:
    """`CALIBRATION_TEXT` tokenized, `[1, T]`; a tokenizer that cannot spell it (a tiny test
    vocabulary, which spells it as a few unknown tokens) gets a fixed pseudo-random id sequence instead."""
    ids = [i for i in tokenizer(CALIBRATION_TEXT, add_special_tokens=False)["input_ids"] if 0 <= i < vocab_size]
    if len(set(ids)) < 16:
        ids = torch.randint(0, vocab_size, (max_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    return torch.tensor([ids[:max_tokens]], dtype=torch.long)


def candidates_here(device: torch.device) -> tuple[list[str], dict[str, str]]:
    """The candidates `auto` measures on this CPU, and the ones it skips with the reason."""
    skipped = {}
    info = cpu_info()
    if not info.native_bfloat16:
        skipped["bfloat16"] = f"no native bfloat16 on this CPU ({info.describe()}): emulated, never cheaper"
    if not onednn_available():
        skipped["float32"] = "this torch build has no oneDNN linear kernel"
    return [c for c in CANDIDATES if c not in skipped], skipped


def prior_precision(measured: list[str]) -> str:
    """The choice where measurements cannot be trusted, by CPU class (what won where we measured):
    int8 weight-only with native bfloat16 (Sapphire Rapids: 3.9x HF), prepacked float32 on an
    AVX2/AVX-512 CPU without it (AMD EPYC Zen 1: float32 won), else the draft as loaded."""
    for choice in (("int8-weight",) if cpu_info().native_bfloat16 else ()) + ("float32", "none"):
        if choice in measured:
            return choice
    return "none"


def _linear_params(model: torch.nn.Module) -> int:
    return sum(m.in_features * m.out_features for m in model.modules()
               if hasattr(m, "in_features") and hasattr(m, "out_features"))


def cost_bound(size_ratio: float) -> float:
    """The most a draft with `size_ratio` of the target's linear parameters can cost relative to one
    target forward on a quiet machine: a decode forward streams its weights, so cost follows size;
    1.5x the size ratio (plus a fixed 0.05 for per-layer overheads) leaves room for a slower kernel,
    and no smaller draft may cost more than the target itself."""
    return min(1.5 * size_ratio + 0.05, max(1.0, 1.2 * size_ratio))


def _decode_timer(runner, prefix: list[int], token: int, argmax: bool):
    """A timer of one single-token decode forward after `prefix` through `runner` (the path decoding
    uses: ModelRunner over a KVCache), argmax included for a draft; the cache is rewound after each."""
    cache = runner.new_cache()
    runner.forward([cache], [prefix], [1])

    def once() -> float:
        start = time.perf_counter()
        logits = runner.forward([cache], [[token]], [1])[0]
        if argmax:
            int(logits[0].argmax())
        seconds = time.perf_counter() - start
        cache.rewind(len(prefix))
        return seconds

    once()  # the first call at this shape builds kernels (oneDNN primitives, allocator pools)
    return once


@torch.inference_mode()
def measure(candidates: dict, input_ids: torch.Tensor, target=None, speculative_tokens_limit: int = 8,
            verify_slope: float = VERIFY_SLOPE, rounds: int = 5, attempts: int = 3):
    """Measure every candidate (name -> LoadedModel) against `target` (a LoadedModel, or None: the
    `none` candidate is the reference). Agreement from one forward over `input_ids` `[1, T]`; costs
    from single-token decode forwards timed in interleaved rounds with the target's
    (`calibration.calibrate`). Returns (measurements, conditions)."""
    from specdec.kernels import calibration
    from specdec.models.model_runner import ModelRunner

    vocab = target.vocab_size if target is not None else next(iter(candidates.values())).vocab_size
    ids = input_ids[0].tolist()
    runners, argmaxes = {}, {}
    for name, loaded in candidates.items():
        runner = ModelRunner(loaded, vocab_size=vocab)
        try:
            argmaxes[name] = runner.forward([runner.new_cache()], [ids], [len(ids)])[0].argmax(dim=-1)  # [T]
            runners[name] = runner
        except (RuntimeError, NotImplementedError) as e:  # a kernel this CPU or torch build lacks
            if name == "none":
                raise
            logger.info("draft precision %s does not run here: %s", name, e)
    if target is not None:
        target_runner = ModelRunner(target)
        reference = target_runner.forward([target_runner.new_cache()], [ids], [len(ids)])[0].argmax(dim=-1)
    else:
        reference = argmaxes["none"]
    prefix, token = ids[:-1], ids[-1]
    timers = {name: _decode_timer(runner, prefix, token, argmax=True) for name, runner in runners.items()}
    if target is not None:
        timers["target"] = _decode_timer(target_runner, prefix, token, argmax=False)
        size_ratio = _linear_params(candidates["none"].model) / max(1, _linear_params(target.model))
    bound = cost_bound(size_ratio) if target is not None else None

    def problems(minima: dict[str, float]) -> list[str]:
        """A candidate may be slow on this CPU (an emulated kernel), but the cheapest one cannot cost
        more than the draft's size allows: if it does, load inflated the measurement."""
        if target is None:
            return []
        cheapest = min(runners, key=lambda name: minima[name])
        c = minima[cheapest] / minima["target"]
        if c <= bound:
            return []
        return [f"the cheapest draft ({cheapest}) measured c = {c:.2f}, more than its size allows ({bound:.2f}: "
                f"{size_ratio:.2f} of the target's linear weights)"]

    # Agreement is measured once; the costs, and with them each candidate's expected speedup, come
    # from the timings (the minima, or the medians when `calibrate` checks the choice is robust).
    agreement = {name: float((argmaxes[name] == reference).float().mean()) for name in runners}

    def results(figures: dict[str, float]) -> list[Measurement]:
        target_seconds = figures["target"] if target is not None else figures["none"] / ASSUMED_COST_RATIO
        out = []
        for name in runners:
            # Position t predicts token t+1: compare the predictions, the last one included.
            alpha = agreement[name] if target is not None else ASSUMED_ALPHA * agreement[name]
            c = figures[name] / target_seconds
            speedup, best_k = expected_speedup(min(alpha, 0.999), c, speculative_tokens_limit, verify_slope)
            out.append(Measurement(name, agreement[name], alpha, figures[name], c, speedup, best_k))
        return out

    minima, conditions = calibration.calibrate(timers, problems, rounds=rounds, attempts=attempts,
                                               choose=lambda figures: pick(results(figures)).precision)
    return results(minima), conditions


def pick(measurements: list[Measurement]) -> Measurement:
    """The best expected speedup; on a tie (within 1%), the earlier candidate in `CANDIDATES`."""
    best = max(m.speedup for m in measurements)
    return min((m for m in measurements if m.speedup >= 0.99 * best), key=lambda m: CANDIDATES.index(m.precision))


def choose_precision(draft, target=None, *, vocab_token_ids: torch.Tensor | None = None, speculative_tokens_limit: int = 8,
                     verify_slope: float = VERIFY_SLOPE, target_kernel: str = "", use_cache: bool = True):
    """Resolve `auto` for the `draft` LoadedModel (against the `target` LoadedModel when at hand):
    the candidate with the best expected speedup (module docstring). Returns (precision,
    measurements, record): measurements are empty when the decision came from the cache; record is
    the `calibration.Record` (None on a GPU, where nothing is measured)."""
    from specdec.kernels import calibration

    if draft.device.type != "cpu":
        return "none", [], None
    names, skipped = candidates_here(draft.device)
    key = {**calibration.base_key("draft-precision"), "draft": model_cache.weights_id(draft.source),
           "target": model_cache.weights_id(target.source) if target is not None else None,
           "target_kernel": target_kernel, "vocab": None if vocab_token_ids is None else int(vocab_token_ids.numel()),
           "speculative_tokens_limit": speculative_tokens_limit, "candidates": names}
    if use_cache and draft.source:
        record = calibration.load_record(key)
        if record is not None and record.choice in names:
            logger.info("draft precision %s", record.describe())
            return record.choice, [], record
    for name, reason in skipped.items():
        logger.info("draft precision %s not measured: %s", name, reason)
    candidates = {}
    for name in names:
        try:
            candidates[name] = dataclasses.replace(draft, model=prepare_draft(draft.model, name, vocab_token_ids,
                                                                              source=draft.source))
        except (RuntimeError, ValueError) as e:  # a kernel this CPU or build lacks
            logger.info("draft precision %s is not available here: %s", name, e)
    vocab_size = draft.model.get_output_embeddings().out_features
    measurements, conditions = measure(candidates, calibration_ids(draft.tokenizer, vocab_size), target, speculative_tokens_limit=speculative_tokens_limit,
                                       verify_slope=verify_slope)
    del candidates
    chosen = pick(measurements)
    if not conditions.consistent:
        prior = prior_precision([m.precision for m in measurements])
        logger.warning("draft precision: the figures stayed inconsistent (%s); using the prior for this CPU class, "
                       "%s, instead of %s", "; ".join(conditions.problems), prior, chosen.precision)
        chosen = next(m for m in measurements if m.precision == prior)
    record = calibration.new_record(key, chosen.precision, [asdict(m) for m in measurements], conditions,
                                    predicted={"cost_ratio": chosen.cost_ratio, "agreement": chosen.agreement,
                                               "speedup": chosen.speedup})
    record.notes = [f"{name} not measured: {reason}" for name, reason in skipped.items()]
    logger.info("draft precision %s chosen (%s): %s", chosen.precision, conditions.describe(),
                "; ".join(f"{m.precision} agreement {m.agreement:.2f} c {m.cost_ratio:.3f} "
                          f"speedup {m.speedup:.2f}" for m in measurements))
    if use_cache and draft.source:
        calibration.cache_if_trusted(record)
    return chosen.precision, measurements, record
