"""A small causal LM of the target's family proposes K tokens autoregressively, on its own KV cache.

Each call first rewinds the draft cache to the longest prefix it shares with the committed context,
then feeds what it has not seen (usually the one token the target emitted, two when the whole
proposal was accepted) together with the first draft step, so catching up costs no extra forward.
After proposing, the cache holds the context plus the first K-1 proposed tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.config import SamplingParams
from specdec.kv_cache import KVCache
from specdec.model_runner import ModelRunner
from specdec.proposers.base import Proposal
from specdec.sampling import logits_to_probs, sample


class DraftModelProposer:
    name = "model"

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def new_state(self) -> KVCache:
        return self.runner.new_cache()

    @torch.inference_mode()
    def propose(
        self,
        state: KVCache,
        context_token_ids: Sequence[int],
        num_tokens: int,
        sampling: SamplingParams,
        generator: torch.Generator,
    ) -> Proposal:
        cache = state
        held = len(cache)
        rewound = held - cache.rewind_to_prefix_of(context_token_ids)
        if len(cache) == len(context_token_ids):
            # The last committed token must be fed to get the next distribution.
            cache.rewind(len(cache) - 1)
        # Stay inside the draft's context (the target's may be longer).
        num_tokens = min(num_tokens, self.runner.max_context - len(context_token_ids))
        if num_tokens <= 0:
            return Proposal([], rewound_tokens=rewound, cache_tokens=len(cache))
        new_token_ids = list(context_token_ids[len(cache) :])
        num_catchup = len(new_token_ids) - 1
        token_ids: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(num_tokens):
            logits = self.runner.forward(cache, new_token_ids, num_logits=1)  # [1, vocab]
            if sampling.greedy:
                token = int(logits[0].argmax())
            else:
                probs = logits_to_probs(logits, sampling)  # [1, vocab]
                token = int(sample(probs, generator)[0])
                rows.append(probs[0])
            token_ids.append(token)
            new_token_ids = [token]
        probs = torch.stack(rows) if rows else None  # [num_tokens, vocab]
        return Proposal(token_ids, probs, num_forwards=num_tokens, num_catchup_tokens=num_catchup,
                        rewound_tokens=rewound, cache_tokens=len(cache))

    def rewind(self, state: KVCache, context_token_ids: Sequence[int]) -> None:
        state.rewind_to_prefix_of(context_token_ids)

    def release(self, state: KVCache) -> None:
        state.rewind(0)
