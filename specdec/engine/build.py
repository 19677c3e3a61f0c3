"""One builder per role: what both engines (in-process, and the Ray shards and draft worker) do to
turn an `EngineConfig` into a ready target and draft.

- `load_target`: load the target (its slice, under tensor parallelism), put its weights at their
  precision (`kernels/target_precision.py`: float32, the GGUF's own 4-bit codes, int8) and prepare
  the float32 linears' kernel, in a thread while the tokenizer loads, then settle `auto` by
  measuring (`kernels/linear.py`).
- `load_draft`: load the draft model (none for `ngram`/`none`) with the target's tokenizer checks,
  then build the proposer at its precision and vocabulary (`draft.build_draft`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from specdec.config import EngineConfig
from specdec.decoding.proposers import NON_MODEL_DRAFTS
from specdec.engine.draft import Draft, build_draft
from specdec.kernels.calibration import Record
from specdec.kernels.linear import prepare_target, settle_linear_kernel
from specdec.kernels.target_precision import Applied, prepare_precision
from specdec.models.loading import LoadedModel, load_model, select_device


@dataclass
class Target:
    """A loaded target with its precision and linear kernel chosen and applied."""

    loaded: LoadedModel
    linear_kernel: str
    kernel_record: Record | None  # `auto`'s measurement (None: the kernel was named)
    precision: str = "float32"
    precision_record: Record | None = None  # `auto`'s measurement of the precision
    applied: Applied | None = None  # what the precision did to each weight


def _prepare(config: EngineConfig, model: torch.nn.Module, source: str, tensor_parallel: bool) -> tuple:
    """The precision, then the float32 linears' kernel: (precision, its record, applied, kernel)."""
    precision, applied, record = prepare_precision(model, config.target_precision, source, tensor_parallel)
    kernel = prepare_target(model, config.linear_kernel, speculating=config.draft != "none",
                            tensor_parallel=tensor_parallel)
    return precision, record, applied, kernel


def load_target(config: EngineConfig, tensor_parallel: bool = False) -> Target:
    from specdec.models.loading import materialize, resolve_spec

    source = materialize(resolve_spec(config.target))
    source = f"{source.path}/{source.gguf_file}" if source.gguf_file else source.path
    prepared: list[tuple] = []

    def prepare(model: torch.nn.Module) -> None:  # in a thread, while the tokenizer loads
        prepared.append(_prepare(config, model, source, tensor_parallel))

    loaded = load_model(config.target, select_device(config.device), config.dtype, config.trust_remote_code,
                        tensor_parallel=tensor_parallel, allow_pickle=config.allow_pickle_weights, role="target",
                        prepare=prepare)
    precision, record, applied, kernel = prepared[0]
    return Target(loaded, *settle_linear_kernel(loaded, kernel), precision, record, applied)


def prepare_loaded_target(config: EngineConfig, loaded: LoadedModel) -> Target:
    """A target loaded by the caller (benchmarks, tests): prepare its precision and settle its kernel
    here. A precision other than float32 goes on a copy of the modules (sharing the weights), so the
    caller's model, which other engines or HF's `generate()` may run, keeps its float32 linears."""
    if config.target_precision != "float32":
        from specdec.kernels.draft_precision import shallow_copy
        from specdec.kernels.linear import PackedLinear

        if any(isinstance(m, PackedLinear) for m in loaded.model.modules()):
            raise ValueError("this target's linears were prepacked for oneDNN by another engine: load it again for "
                             f"target_precision {config.target_precision} (or give this engine float32)")
        loaded = dataclasses.replace(loaded, model=shallow_copy(loaded.model))
    precision, record, applied, kernel = _prepare(config, loaded.model, loaded.source, tensor_parallel=False)
    return Target(loaded, *settle_linear_kernel(loaded, kernel), precision, record, applied)


def load_draft_model(config: EngineConfig, target: LoadedModel | None = None) -> LoadedModel | None:
    """The draft model `config.draft` names, or None for `ngram` / `none`. `target` (when at hand)
    lends its tokenizer for the vocabulary check."""
    if config.draft in NON_MODEL_DRAFTS:
        return None
    return load_model(config.draft, select_device(config.device), config.dtype, config.trust_remote_code,
                      allow_pickle=config.allow_pickle_weights, tokenizer_of=target, role="draft")


def load_draft(config: EngineConfig, target_vocab_size: int, target: Target | None = None,
               target_kernel: Record | None = None) -> Draft:
    """Load and build the draft. `target` (unsharded, in this process) is what `auto` precision
    measures against; `target_kernel` gives the verify pass's cost curve."""
    loaded = target.loaded if target is not None else None
    return build_draft(config, load_draft_model(config, loaded), target_vocab_size, target=loaded,
                       target_kernel=target_kernel if target_kernel is not None else
                       (target.kernel_record if target is not None else None))
