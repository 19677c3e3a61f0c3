"""The target's precision: float32 (the exact reference against HF), the GGUF's own 4-bit codes, or
int8 weight-only; `auto` measures which is fastest on this CPU among the forms of the published model.

    float32       the model as loaded; its linears on the measured float32 kernel (`linear.py`)
    int4          4-bit codes in groups of 32 (`quantized.Int4Linear`): a GGUF file's own Q4_K / Q4_1
                  codes (read at pull time, `gguf_codes.py`); a float checkpoint's weights rounded to
                  nearest per group. A GGUF tensor without 4-bit codes (Q6_K, Q8_0) takes int8
                  weight-only per output channel; a Q4 embedding table stays codes (`Int4Embedding`)
    int8-weight   every linear int8 per output channel, bfloat16 activations (`linear.Int8WeightLinear`)

`auto` keeps the precision the model was published at: a model with 4-bit codes (a GGUF preset or
file) measures int4 against float32 and takes the faster; a float checkpoint stays float32 (int4
would change its outputs, which is the user's call: `--target-precision int4`). The measurement
times one decoder layer's linears (a decode forward streams every linear's weights once, so they
are its cost) at 1, 3 and 5 rows for each candidate, in interleaved rounds, and is cached per CPU
like the other decisions (`calibration.py`).

Speculation is exact at every precision: greedy output equals the same target decoding one token
at a time at that precision (each kernel's rows do not depend on the other rows of the call). The
docs give each precision's distance from float32 (perplexity, greedy agreement).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.config import TARGET_PRECISIONS
from specdec.kernels.linear import Int8WeightLinear
from specdec.kernels.quantized import GROUP_SIZE, Int4Codes, Int4Embedding, Int4Linear, fuse_siblings, int4_available

logger = logging.getLogger(__name__)

#: `auto`'s candidates for a model with 4-bit codes, in order of preference on a tie (within 2%).
CODED_CANDIDATES = ("int4", "float32")
#: The row counts `auto` times: plain decoding, a short and the default verify pass.
SIZES = (1, 3, 5)


@dataclass
class Applied:
    """What a precision did to a model: how many weights took each form, and why."""

    precision: str
    forms: Counter = field(default_factory=Counter)  # "int4 (GGUF Q4 codes)" -> number of weights
    fused: int = 0  # groups of int4 siblings (q/k/v, gate/up) run as one kernel call

    def describe(self) -> str:
        return f"{self.precision}: " + (", ".join(f"{n} {form}" for form, n in sorted(self.forms.items()))
                                        or "no weight changed")


def precision_summary(record, precision: str, applied: Applied | None) -> dict:
    """The target's precision as logs, /v1/models and the info metric show it: the choice, what
    `auto` measured (`calibration.Record.summary`), and the form each weight took."""
    from specdec.kernels.calibration import summarize

    summary = summarize(record, precision)
    if applied is not None and applied.forms:
        summary = {**summary, "weights": dict(applied.forms)}
    return summary


def codes_source(source: str) -> Path | None:
    """Where a loaded model's 4-bit codes are: the codes file a preset's pull wrote, or the GGUF file
    itself (read at load); None for a float checkpoint."""
    from specdec.models.gguf_codes import CODES_FILE

    path = Path(source)
    if (path / CODES_FILE).is_file():
        return path / CODES_FILE
    if path.suffix == ".gguf" and path.is_file():
        return path
    return None


def iter_codes(source: Path | None, model: torch.nn.Module) -> Iterator[tuple[str, Int4Codes]]:
    """(parameter name, 4-bit codes) from `codes_source(...)`, one weight at a time (none: a float
    checkpoint)."""
    from specdec.models.gguf_codes import load_codes, read_codes

    if source is None:
        return iter(())
    return read_codes(source, model) if source.suffix == ".gguf" else load_codes(source)


def model_codes(source: Path | None, model: torch.nn.Module) -> dict[str, Int4Codes]:
    """Parameter name -> 4-bit codes, all at once (for measuring one layer, for tests)."""
    return dict(iter_codes(source, model))


def _replace(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def apply_precision(model: torch.nn.Module, precision: str,
                    codes: dict[str, Int4Codes] | Iterable[tuple[str, Int4Codes]] = (),
                    uncoded: str = "int8-weight") -> Applied:
    """Replace `model`'s linears (and a coded embedding table) by the `precision`'s forms, in place.
    `codes`: (parameter name, `Int4Codes`) of the weights that have them, consumed one at a time (a
    float model has none). `uncoded`: what int4 makes of a coded model's other weights (GGUF Q6_K,
    Q5_0, Q8_0): int8-weight, the closest (the target), or int4 rounded to nearest, the fastest (a
    draft, which only proposes). Afterwards nothing of the model refers to the memory-mapped
    checkpoint any more, so the pages read while converting are given back."""
    applied = Applied(precision)
    if precision == "float32":
        return applied
    if precision == "int4" and not int4_available():
        raise ValueError("int4 needs PyTorch's CPU int4 kernel (aten._weight_int4pack_mm_for_cpu), which this "
                         "torch build lacks")
    coded_model = False
    if precision == "int4":
        for weight_name, c in (codes.items() if isinstance(codes, dict) else codes):
            coded_model = True
            name = weight_name.removesuffix(".weight")
            try:
                module = model.get_submodule(name)
            except AttributeError:
                continue
            if tuple(module.weight.shape) != c.shape:
                continue  # the rows changed since the file (a reduced draft vocabulary)
            if isinstance(module, torch.nn.Embedding):
                _replace(model, name, Int4Embedding(c, module.weight.dtype, module.padding_idx))
                applied.forms["embedding int4 (the file's Q4 codes)"] += 1
            elif type(module) is torch.nn.Linear:
                _replace(model, name, Int4Linear(c, module.bias))
                applied.forms["int4 (the file's Q4 codes)"] += 1
    for name, module in list(model.named_modules()):
        if type(module) is torch.nn.Linear:
            form, new = _linear_form(module, precision, coded_model, uncoded)
            if new is not None:
                _replace(model, name, new)
            applied.forms[form] += 1
    if precision == "int4":
        applied.fused = fuse_siblings(model)  # q/k/v and gate/up: one kernel call each, the same numbers
    _own_memory(model)
    return applied


def _own_memory(model: torch.nn.Module) -> None:
    """Copy what is left of the checkpoint's tensors (norms, biases, a float embedding) out of its
    memory map: while one tensor refers to the map, every page of it that was read stays resident."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()


def _linear_form(linear: torch.nn.Linear, precision: str, coded_model: bool, uncoded: str = "int8-weight"):
    """(what a linear without 4-bit codes becomes, its new module or None to keep it)."""
    if precision == "int8-weight":
        return "int8 weight-only", Int8WeightLinear(linear)
    if coded_model and uncoded == "int8-weight":  # a GGUF tensor stored otherwise (Q6_K, Q8_0): the closest
        return "int8 weight-only (the file's Q6_K/Q8_0/float weights)", Int8WeightLinear(linear)
    if linear.in_features % GROUP_SIZE:
        return f"float32 (in_features {linear.in_features} not a multiple of {GROUP_SIZE})", None
    return "int4 (rounded to nearest)", Int4Linear(Int4Codes.round_to_nearest(linear.weight), linear.bias)


def check_precision(precision: str, tensor_parallel: bool, device: torch.device) -> None:
    if precision not in TARGET_PRECISIONS:
        raise ValueError(f"target precision must be one of {', '.join(TARGET_PRECISIONS)}; got {precision!r}")
    if precision in ("int4", "int8-weight") and device.type != "cpu":
        raise ValueError(f"target precision {precision} runs on the CPU (PyTorch's CPU kernels); the target is on "
                         f"{device}: use --target-precision float32 there")
    if precision in ("int4", "int8-weight") and tensor_parallel:
        raise ValueError(f"target precision {precision} does not shard across tensor-parallel ranks yet: use "
                         "--target-precision float32 with --tp, or --tp 1")


def prepare_precision(model: torch.nn.Module, precision: str, source: str, tensor_parallel: bool = False,
                      use_cache: bool = True):
    """Resolve and apply the target's precision. Returns (precision, Applied, calibration Record or None)."""
    from specdec.startup import stage

    device = next(model.parameters()).device
    check_precision(precision, tensor_parallel, device)
    codes_at = codes_source(source)
    record = None
    if precision == "auto":
        if tensor_parallel or device.type != "cpu" or codes_at is None or not int4_available():
            precision = "float32"
        else:
            with stage("choose target precision") as note:
                precision, record = _settle(model, codes_at, source, use_cache)
                note.detail = record.describe()
    if precision == "float32":  # the model as loaded: nothing to prepare
        return precision, Applied(precision), record
    with stage("prepare target precision", precision):
        applied = apply_precision(model, precision, iter_codes(codes_at, model) if precision == "int4" else ())
    logger.info("target precision %s", applied.describe())
    return precision, applied, record


def _layer_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """One decoder layer's linears (the middle one: first and last layers may be stored otherwise)."""
    names = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear and ".layers." in n]
    layers = sorted({n.split(".layers.")[1].split(".")[0] for n in names}, key=int)
    middle = layers[len(layers) // 2] if layers else None
    return {n: model.get_submodule(n) for n in names if n.split(".layers.")[1].split(".")[0] == middle}


def _settle(model: torch.nn.Module, codes_at: Path, source: str, use_cache: bool):
    from specdec.kernels import calibration
    from specdec.models import model_cache

    key = {**calibration.base_key("target-precision"), "target": model_cache.weights_id(source),
           "candidates": CODED_CANDIDATES, "sizes": SIZES}
    record = calibration.load_record(key) if use_cache else None
    if record is None:
        linears = _layer_linears(model)
        codes = {name: c for name, c in iter_codes(codes_at, model) if name.removesuffix(".weight") in linears}
        record = _measure(linears, codes, key)
        if use_cache:
            calibration.cache_if_trusted(record)
    logger.info("target precision %s", record.describe())
    return record.choice, record


def _problems(minima: dict[str, float]) -> list[str]:
    """Physical checks: a kernel's 5-row pass cannot cost much less than its 1-row pass."""
    return [f"{c}: {SIZES[-1]} rows measured {minima[f'{c}/{SIZES[-1]}'] / minima[f'{c}/1']:.2f}x one row"
            for c in CODED_CANDIDATES if minima[f"{c}/{SIZES[-1]}"] < 0.7 * minima[f"{c}/1"]]


@torch.inference_mode()
def _measure(linears: dict[str, torch.nn.Linear], codes: dict[str, Int4Codes], key: dict):
    """Time one decoder layer's linears in each candidate's form at `SIZES` rows."""
    from specdec.kernels import calibration
    from specdec.kernels.linear import PackedLinear

    forms = {"float32": [PackedLinear(m, keep_weight=False) for m in linears.values()],
             "int4": [Int4Linear(codes[f"{n}.weight"], m.bias) if f"{n}.weight" in codes
                      else _linear_form(m, "int4", bool(codes))[1] or m for n, m in linears.items()]}
    width = {m.in_features for m in linears.values()}
    inputs = {(n, k): torch.randn(n, k) for n in SIZES for k in width}

    def timer(candidate: str, n: int):
        def once() -> float:
            start = time.perf_counter()
            for module in forms[candidate]:
                module(inputs[(n, module.in_features)])
            return time.perf_counter() - start
        return once

    timers = {f"{c}/{n}": timer(c, n) for c in CODED_CANDIDATES for n in SIZES}
    for t in timers.values():
        t()  # the first call at each shape builds kernels

    choose = calibration.fastest(CODED_CANDIDATES, SIZES)
    minima, conditions = calibration.calibrate(timers, _problems, rounds=5, attempts=2, choose=choose)
    choice = choose(minima)
    measurements = calibration.by_size(minima, CODED_CANDIDATES, SIZES, "precision", "layer_seconds")
    chosen = next(m for m in measurements if m["precision"] == choice)
    calibration.log_sizes("target precisions", conditions, measurements, "precision", "layer_seconds", SIZES, "rows")
    return calibration.new_record(key, choice, measurements, conditions,
                                  predicted={"verify_ratio": chosen["verify_ratio"]})
