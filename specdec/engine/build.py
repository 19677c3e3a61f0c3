"""One builder per role: what both engines (in-process, and the Ray shards and draft worker) do to
turn an `EngineConfig` into a ready target and draft.

- `load_target`: load the target (its slice, under tensor parallelism) and prepare its linear kernel,
  prepacking in a thread while the tokenizer loads, then settle `auto` by measuring
  (`kernels/linear.py`).
- `load_draft`: load the draft model (none for `ngram`/`none`) with the target's tokenizer checks,
  then build the proposer at its precision and vocabulary (`draft.build_draft`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.config import EngineConfig
from specdec.decoding.proposers import NON_MODEL_DRAFTS
from specdec.engine.draft import Draft, build_draft
from specdec.kernels.calibration import Record
from specdec.kernels.linear import prepare_target, settle_linear_kernel
from specdec.models.loading import LoadedModel, load_model, select_device


@dataclass
class Target:
    """A loaded target with its linear kernel chosen and applied."""

    loaded: LoadedModel
    linear_kernel: str
    kernel_record: Record | None  # `auto`'s measurement (None: the kernel was named)


def load_target(config: EngineConfig, tensor_parallel: bool = False) -> Target:
    chosen: list[str] = []

    def prepare(model: torch.nn.Module) -> None:  # in a thread, while the tokenizer loads
        chosen.append(prepare_target(model, config.linear_kernel, speculating=config.draft != "none",
                                     tensor_parallel=tensor_parallel))

    loaded = load_model(config.target, select_device(config.device), config.dtype, config.trust_remote_code,
                        tensor_parallel=tensor_parallel, allow_pickle=config.allow_pickle_weights, role="target",
                        prepare=prepare)
    return Target(loaded, *settle_linear_kernel(loaded, chosen[0]))


def prepare_loaded_target(config: EngineConfig, loaded: LoadedModel) -> Target:
    """A target loaded by the caller (benchmarks, tests): prepare and settle its kernel here."""
    kernel = prepare_target(loaded.model, config.linear_kernel, speculating=config.draft != "none")
    return Target(loaded, *settle_linear_kernel(loaded, kernel))


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
