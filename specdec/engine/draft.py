"""The draft side of an engine, built from its config: which proposer, at what precision, over what vocabulary.

Both engines build their draft here: the in-process `SpeculativeEngine` (with the target at hand,
so `auto` precision is measured against it) and the Ray draft worker (against the float32 draft);
see `draft_precision.py` for the precisions and `draft_vocab.py` for the reduced vocabulary.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from specdec.config import EngineConfig
from specdec.kernels.calibration import Record as Calibration
from specdec.kernels.draft_precision import VERIFY_SLOPE, Measurement, choose_precision, prepare_draft
from specdec.kernels.linear import VERIFY_TOKENS
from specdec.models.model_runner import ModelRunner
from specdec.models.loading import LoadedModel, check_same_vocabulary
from specdec.decoding.proposers import DraftModelProposer, HybridProposer, NgramProposer
from specdec.startup import stage

logger = logging.getLogger(__name__)


@dataclass
class Draft:
    """A built draft: the proposer and how it was made (for logs, `/v1/models` and benchmarks)."""

    proposer: object | None  # None: draft "none"
    precision: str = "none"  # what the draft model runs in ("none": as loaded)
    vocab_size: int | None = None  # tokens the draft proposes from (None: the full vocabulary)
    measurements: list[Measurement] = field(default_factory=list)  # auto precision's calibration
    model: LoadedModel | None = None  # the prepared draft model
    record: Calibration | None = None  # auto precision's decision: measured now or cached (None: not auto)

    @property
    def device(self) -> torch.device:
        return self.proposer.runner.device if hasattr(self.proposer, "runner") else torch.device("cpu")


def build_draft(config: EngineConfig, draft: LoadedModel | None, target_vocab_size: int,
                target: LoadedModel | None = None, target_kernel: Calibration | None = None) -> Draft:
    """The proposer `config.draft` names: none, n-gram lookup, or a draft model (prepared at
    `config.draft_precision`, over `config.draft_vocab_size` tokens, behind prompt lookup when
    `config.prompt_lookup_min`). `target` (optional) is what `auto` precision measures acceptance and cost
    against; `target_kernel`, the target's kernel calibration, gives the verify pass's cost curve."""
    if config.draft == "none":
        return Draft(None)
    if config.draft == "ngram":
        return Draft(NgramProposer(config.ngram_min, config.ngram_max))
    if draft is None:
        raise ValueError(f"draft {config.draft!r} is a model but none was loaded")
    if target is not None:
        check_same_vocabulary(target.tokenizer, draft.tokenizer, target.spec, draft.spec)
    vocab_ids = None
    if config.draft_vocab_size is not None and config.draft_vocab_size < target_vocab_size:
        from specdec.models.draft_vocab import draft_token_ids

        vocab_ids = draft_token_ids(draft.tokenizer, min(draft.vocab_size, target_vocab_size), config.draft_vocab_size)
    precision, measurements, record = config.draft_precision, [], None
    if precision == "auto":
        slope = VERIFY_SLOPE
        if target_kernel is not None and target_kernel.predicted.get("verify_ratio"):
            slope = max(0.0, (target_kernel.predicted["verify_ratio"] - 1) / (VERIFY_TOKENS - 1))
        with stage("choose draft precision", "auto") as note:
            precision, measurements, record = choose_precision(
                draft, target, vocab_token_ids=vocab_ids, speculative_tokens_limit=config.speculative_tokens_limit, verify_slope=slope,
                target_kernel=target_kernel.choice if target_kernel is not None else "")
            if record is not None:
                note.detail = record.describe()
    with stage("prepare draft", precision + ("" if vocab_ids is None else f", {vocab_ids.numel()}-token vocabulary")):
        model = prepare_draft(draft.model, precision, vocab_ids, source=draft.source)
    prepared = dataclasses.replace(draft, model=model) if model is not draft.model else draft
    proposer = DraftModelProposer(ModelRunner(prepared, vocab_size=target_vocab_size))
    if config.prompt_lookup_min:
        proposer = HybridProposer(proposer, config.prompt_lookup_min, max(config.ngram_max, config.prompt_lookup_min))
    logger.info("draft %s: %s, %s vocabulary%s", config.draft, precision,
                "full" if vocab_ids is None else f"{vocab_ids.numel()}-token",
                f", prompt lookup first (matches of {config.prompt_lookup_min}+)" if config.prompt_lookup_min else "")
    return Draft(proposer, precision, None if vocab_ids is None else int(vocab_ids.numel()), measurements, prepared,
                 record)
