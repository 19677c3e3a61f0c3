"""What every proposer (the "draft") returns, and the one shape it is called with.

A proposer gets the committed context of a sequence and K, and returns up to K proposed token ids
with the distributions they were drawn from. It may return fewer (n-gram lookup finds no match; the
draft model reaches its context limit); the step then verifies what there is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from specdec.config import SamplingParams


@dataclass
class Proposal:
    token_ids: list[int]  # [num_proposed]
    # [num_proposed, vocab] the warped distributions the ids were sampled from (residual sampling);
    # None when verification needs no q: greedy and invariant sampling compare tokens, and a
    # deterministic proposer (n-gram lookup) has a one-hot q.
    probs: torch.Tensor | None = None
    num_forwards: int = 0  # draft model forward passes it took
    num_catchup_tokens: int = 0  # committed tokens the draft had not seen yet, fed in the first forward
    seconds: float | None = None  # time it took where it ran (set by remote draft workers; None: not timed)
    # The draft's KV cache: tokens dropped before drafting (rejected proposals, an unused pre-drafted
    # block) and tokens held after it (None: the proposer keeps no cache, e.g. n-gram lookup).
    rewound_tokens: int = 0
    cache_tokens: int | None = None

    def __len__(self) -> int:
        return len(self.token_ids)


class Proposer(Protocol):
    """The one shape of a proposer (cf. vLLM v1 `spec_decode/`)."""

    #: `model` or `ngram`; used in logs and stats.
    name: str
    #: Each proposed token costs a forward (a draft model); False: a lookup paid once per step.
    per_token: bool
    #: Where its proposals' distributions live.
    device: torch.device

    def new_state(self, limit: int | None = None) -> Any:
        """Per-sequence state (a draft KV cache of at most `limit` tokens, or None); kept by the
        caller, passed back each call."""

    def propose(
        self,
        state: Any,
        context_token_ids: Sequence[int],
        num_tokens: int,
        sampling: SamplingParams,
    ) -> Proposal:
        """Propose up to `num_tokens` ids continuing `context_token_ids` (the committed sequence).
        `sampling` is resolved (a seed and a mode): token j is decided by `sampling.choose` at
        position len(context) + j, so a proposal does not depend on what was drawn before."""

    def propose_batch(self, states: Sequence[Any], contexts: Sequence[Sequence[int]], nums_tokens: Sequence[int],
                      samplings: Sequence[SamplingParams],
                      max_tokens: Sequence[int | None] | None = None) -> list[Proposal]:
        """`propose` for many sequences at once (a single one is a batch of one). `max_tokens[i]`: a
        proposal that costs no draft forward (a prompt-lookup match) may be this long."""

    def rewind(self, state: Any, context_token_ids: Sequence[int]) -> None:
        """Drop any state beyond the longest prefix shared with `context_token_ids`."""

    def release(self, state: Any) -> None:
        """Free the per-sequence state."""
