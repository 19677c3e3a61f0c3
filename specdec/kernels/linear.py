"""CPU kernels for linear layers: where a verify pass is won or lost.

Measured on a 2-core Xeon (Sapphire Rapids), fp32, torch 2.13, transformers 5 (the 1.5B Qwen
target, one forward over n new tokens after a 200-token prefix, milliseconds, 2026-12-05):

    n                                  1     3     5     9
    F.linear (MKL), weights mmap'd   384  1124   796   959    transformers 5 maps safetensors
    oneDNN on the mmap'd weights     244   327   338   391    no preparation
    oneDNN, prepacked                247   204   192   255    nearly flat: verification is almost free
    (F.linear on weights in anonymous memory, 2026-12-03: 234 253 470 650)

So the target runs its verify passes through oneDNN with weights reordered once at load time
(~3 s for the 1.5B target here; the reordered layout is opaque to safetensors, so it cannot be
cached on disk). transformers 5 memory-maps float32 safetensors weights, so keeping the originals
(for `stock_linears`, the reference runs) costs page cache, not process memory. `hybrid` also
routes passes of 1-3 rows to MKL, ~10% faster than oneDNN when the weights live in anonymous
memory (a GGUF-converted model), far slower on mapped ones. Both are float32 computations of the
same model, summed in a different order: the same target at the same precision (greedy output
stays identical to target-only decoding; the tests compare with HF `generate()` on stock kernels).

Which kernel wins depends on the CPU (those figures are a Sapphire Rapids with AVX-512 and AMX; an
AVX2-only CPU ranks them differently), so `--linear-kernel auto` measures: the linears are
prepacked with the originals kept, then `settle_linear_kernel` times 1-, 3- and 5-token
forwards of every candidate through the decoding path, interleaved over rounds
(`calibration.py`), and keeps the fastest (`torch` unpacks again). The decision is cached per
(target, threads, CPU model and flags, torch); the first start pays ~10-25 s for it.

A draft only proposes, so it may run at a lower precision (`draft_precision.py` chooses which, by
measurement). The kernels for it live here too (the 0.5B Qwen draft, one token, ms, 2026-12-04):

    float32 F.linear                    119    the reference
    bfloat16, F.linear                   63
    bfloat16, prepacked oneDNN (AMX)     31    agrees with float32's argmax on 97% of positions
    int8 weight-only (bf16 activations)  29    per-channel scales: 95.5%
    int8 dynamic (fbgemm)                26    activations quantized per tensor: 59.5%
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from specdec.config import LINEAR_KERNELS

logger = logging.getLogger(__name__)

_SMALL_BATCH = 3  # rows up to which MKL's sgemm beats the prepacked oneDNN kernel


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(torch.nn.Module):
    """An `nn.Linear` with its float32 or bfloat16 weight prepacked for oneDNN.

    keep_weight=True keeps the original weight too (for `stock=True`, which routes every call
    through plain `F.linear` to run a reference on the unmodified kernels); small_batch_mkl=True
    (hybrid) also uses it for passes of up to 3 rows.
    """

    def __init__(self, linear: torch.nn.Linear, batch_hint: int = 8, keep_weight: bool = True,
                 small_batch_mkl: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.weight = linear.weight if keep_weight or small_batch_mkl else None
        self.bias = linear.bias
        self.small_batch_mkl = small_batch_mkl
        self.stock = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [num_tokens, in_features]
        if self.stock or (self.small_batch_mkl and rows.shape[0] <= _SMALL_BATCH):
            if self.weight is None:
                raise RuntimeError("stock kernels need the original weights (not kept: memory was short)")
            return torch.nn.functional.linear(x, self.weight, self.bias)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        mode = "hybrid" if self.small_batch_mkl else "onednn"
        return f"in_features={self.in_features}, out_features={self.out_features}, {mode}"


def replace_linears(model: torch.nn.Module, make, dtype: torch.dtype = torch.float32) -> int:
    """Replace every CPU `nn.Linear` of `dtype` in `model` by `make(linear)`; returns how many. (Meta
    tensors count as CPU ones: a skeleton built there is filled with prepared CPU weights.)"""
    found = [(name, module) for name, module in model.named_modules()
             if type(module) is torch.nn.Linear and module.weight.device.type in ("cpu", "meta")
             and module.weight.dtype == dtype]
    for name, module in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(module))
    return len(found)


def pack_linears(model: torch.nn.Module, keep_weight: bool = True, batch_hint: int = 8,
                 dtype: torch.dtype = torch.float32, small_batch_mkl: bool = False) -> int:
    """Replace every CPU `nn.Linear` of `dtype` in `model` by a `PackedLinear`; returns how many."""
    return replace_linears(model, lambda m: PackedLinear(m, batch_hint, keep_weight, small_batch_mkl), dtype)


class Int8WeightLinear(torch.nn.Module):
    """Weight-only int8: weights rounded per output channel to int8 with a bfloat16 scale each,
    activations stay bfloat16 (`aten._weight_int8pack_mm`, the CPU kernel gpt-fast's int8 mode uses).
    Half the bytes of bfloat16 weights; unlike dynamic int8, the activations are not quantized."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()  # [out_features, in_features]
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [out_features]
        self.register_buffer("weight_int8", torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(torch.bfloat16))
        bias = linear.bias.detach().to(torch.bfloat16) if linear.bias is not None else None
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [num_tokens, in_features]
        out = torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)  # a float32 model gets float32 back

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


@contextlib.contextmanager
def stock_linears(model: torch.nn.Module):
    """Run `model` on plain `F.linear` inside the block (a reference on the unmodified kernels)."""
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    for m in packed:
        m.stock = True
    try:
        yield model
    finally:
        for m in packed:
            m.stock = False


def linear_weight_bytes(model: torch.nn.Module) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if type(m) is torch.nn.Linear)


def available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def choose_linear_kernel(kernel: str, model: torch.nn.Module, speculating: bool, tensor_parallel: bool) -> str:
    """Check `kernel` for this model; `auto` stays `auto` where there is a choice to measure (float32
    on the CPU with oneDNN, not tensor-parallel) and becomes `torch` where there is none."""
    if kernel not in LINEAR_KERNELS:
        raise ValueError(f"linear kernel must be one of {', '.join(LINEAR_KERNELS)}; got {kernel!r}")
    param = next(model.parameters())
    if not any(type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 for m in model.modules()):
        return "torch"  # no float32 linear left (an int4 or int8 target): no kernel to choose
    eligible = param.device.type == "cpu" and param.dtype == torch.float32 and not tensor_parallel \
        and onednn_available()
    if kernel in ("onednn", "hybrid") and not eligible:
        raise ValueError(f"the {kernel} linear kernel needs float32 weights on the CPU without tensor parallelism")
    if kernel == "auto" and not eligible:
        return "torch"
    return kernel


def prepare_target(model: torch.nn.Module, kernel: str, speculating: bool, tensor_parallel: bool = False) -> str:
    """Apply `kernel` to this target's linears (prepacking runs in a thread while the tokenizer
    loads); returns the kernel, or `auto` when `settle_linear_kernel` must still measure which wins
    (the linears are then prepacked with their original weights kept, so every candidate can run)."""
    chosen = choose_linear_kernel(kernel, model, speculating=speculating, tensor_parallel=tensor_parallel)
    apply_linear_kernel(model, chosen)
    if chosen == "auto" and not any(m.weight is not None for m in model.modules() if isinstance(m, PackedLinear)):
        return "onednn"  # memory too short to keep the originals: nothing else can run
    return chosen


def apply_linear_kernel(model: torch.nn.Module, kernel: str) -> None:
    """Prepack the linears for `onednn`/`hybrid` (and `auto`, to measure). The original weights stay
    referenced (for the reference runs of `stock_linears`, and for `auto`'s `torch` and `hybrid`
    candidates) when they fit in memory twice with 2 GB to spare: free when they are memory-mapped
    from safetensors; hybrid needs them."""
    if kernel in ("onednn", "hybrid", "auto"):
        from specdec.startup import stage

        free = available_memory_bytes()
        keep = kernel == "hybrid" or free is None or free > linear_weight_bytes(model) + (2 << 30)
        with stage("prepare target", f"{kernel}: prepacking the linear layers for oneDNN"):
            count = pack_linears(model, keep_weight=keep, small_batch_mkl=kernel == "hybrid")
        logger.info("prepacked %d linear layers for oneDNN (%s)", count, kernel)


def set_linear_mode(model: torch.nn.Module, kernel: str) -> None:
    """Route every `PackedLinear` of `model` through `kernel` (`onednn`, `hybrid` or `torch`)."""
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.small_batch_mkl = kernel == "hybrid"
            m.stock = kernel == "torch"


def unpack_linears(model: torch.nn.Module) -> int:
    """Put plain `nn.Linear`s over the original weights back in place of the `PackedLinear`s (frees
    the packed copies); returns how many."""
    def restore(packed: PackedLinear) -> torch.nn.Linear:
        linear = torch.nn.Linear(packed.in_features, packed.out_features, bias=packed.bias is not None,
                                 device="meta")
        linear.weight = packed.weight
        if packed.bias is not None:
            linear.bias = packed.bias
        return linear

    found = [(name, m) for name, m in model.named_modules() if isinstance(m, PackedLinear) and m.weight is not None]
    for name, module in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, restore(module))
    return len(found)


#: `auto` measures these (in this order of preference on a tie within 2%).
KERNEL_CANDIDATES = ("onednn", "hybrid", "torch")
#: The verify pass `auto` times besides the single-token forward: K = 4 proposals + 1.
VERIFY_TOKENS = 5
#: The forward sizes `auto` times and adds up: plain decoding (1), a short proposal (3: where MKL
#: streams the weights once per row, so `hybrid` loses; measured 0.53 s against oneDNN's 0.41 s for
#: the 1.5B target with AVX2 only) and the default verify pass.
KERNEL_SIZES = (1, 3, VERIFY_TOKENS)


def _path(kernel: str, num_tokens: int) -> str:
    """The library that runs `kernel`'s forward of `num_tokens` rows: hybrid sends up to
    `_SMALL_BATCH` rows to MKL and the rest to oneDNN, so its 1- and 5-token passes are two kernels."""
    if kernel == "torch" or (kernel == "hybrid" and num_tokens <= _SMALL_BATCH):
        return "mkl"
    return "onednn"


def _kernel_problems(minima: dict[str, float]) -> list[str]:
    """Physical checks: one library's verify pass of 5 tokens cannot cost much less than the same
    library's single-token forward (whichever candidate ran it). A candidate whose two sizes run on
    different libraries (hybrid) may well be faster at 5 tokens than at 1: that is a property of the
    CPU, not load (hybrid's 5 tokens measured 0.59x its 1 token on an AMD EPYC Zen 4)."""
    problems = []
    for path in ("onednn", "mkl"):
        ones = [minima[f"{k}/1"] for k in KERNEL_CANDIDATES if f"{k}/1" in minima and _path(k, 1) == path]
        verifies = [minima[f"{k}/{VERIFY_TOKENS}"] for k in KERNEL_CANDIDATES
                    if f"{k}/{VERIFY_TOKENS}" in minima and _path(k, VERIFY_TOKENS) == path]
        if ones and verifies and min(verifies) < 0.7 * min(ones):
            problems.append(f"{path}: {VERIFY_TOKENS} tokens measured {min(verifies) / min(ones):.2f}x one token")
    return problems


def settle_linear_kernel(loaded, kernel: str, use_cache: bool = True):
    """Resolve a pending `auto` (`prepare_target` returned it) by measuring each candidate on this
    CPU: one forward of each of `KERNEL_SIZES` new tokens after a 128-token prefix, through the
    runner decoding uses, interleaved over rounds (`calibration.calibrate`); the smallest sum wins.
    The decision is cached per (target, threads, CPU, torch) unless it was measured under load.
    Returns (kernel, calibration.Record or None). Other kernels are returned as they are."""
    if kernel != "auto":
        return kernel, None
    from specdec.kernels import calibration
    from specdec.models import model_cache
    from specdec.models.model_runner import ModelRunner
    from specdec.startup import stage

    model = loaded.model
    key = {**calibration.base_key("linear-kernel"), "target": model_cache.weights_id(loaded.source),
           "candidates": KERNEL_CANDIDATES, "sizes": KERNEL_SIZES}
    with stage("choose target kernel") as note:
        record = calibration.load_record(key) if use_cache and loaded.source else None
        if record is None:
            record = _measure_kernels(ModelRunner(loaded), key)
            if use_cache and loaded.source:
                calibration.cache_if_trusted(record)
        note.detail = record.describe()
    set_linear_mode(model, record.choice)
    if record.choice == "torch":
        unpack_linears(model)
    logger.info("target linear kernel %s", note.detail)
    return record.choice, record


@torch.inference_mode()
def _measure_kernels(runner, key: dict):
    from specdec.kernels import calibration

    model = runner.model
    candidates = [k for k in KERNEL_CANDIDATES
                  if k == "onednn" or all(m.weight is not None for m in model.modules() if isinstance(m, PackedLinear))]
    vocab = runner.model_vocab_size
    ids = torch.randint(0, vocab, (128 + VERIFY_TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()
    prefix, tail = ids[:128], ids[128:]
    cache = runner.new_cache()
    runner.forward([cache], [prefix], [1])

    def timer(kernel: str, n: int):
        def once() -> float:
            set_linear_mode(model, kernel)
            start = time.perf_counter()
            runner.forward([cache], [tail[:n]], [n])
            seconds = time.perf_counter() - start
            cache.rewind(len(prefix))
            return seconds
        return once

    timers = {f"{k}/{n}": timer(k, n) for k in candidates for n in KERNEL_SIZES}
    for t in timers.values():  # the first call at each shape builds kernels (oneDNN primitives)
        t()
    choose = calibration.fastest(candidates, KERNEL_SIZES)
    minima, conditions = calibration.calibrate(timers, _kernel_problems, rounds=4, attempts=2, choose=choose)
    cache.rewind(0)
    choice = choose(minima)
    if not conditions.consistent:
        choice = "onednn"  # the prior where figures cannot be trusted: it won on every CPU measured so far
    measurements = calibration.by_size(minima, candidates, KERNEL_SIZES, "kernel", "seconds")
    chosen = next(m for m in measurements if m["kernel"] == choice)
    calibration.log_sizes("target kernels", conditions, measurements, "kernel", "seconds", KERNEL_SIZES, "tokens")
    return calibration.new_record(key, choice, measurements, conditions,
                                  predicted={"verify_ratio": chosen["verify_ratio"],
                                             "target_seconds_1": chosen["seconds_1"]})
