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
from specdec.models.kv_cache import KVCache
from specdec.models.model_runner import ModelRunner
from specdec.decoding.proposers.base import Proposal
from specdec.decoding.sampling import choose, defers_sync


class DraftModelProposer:
    name = "model"
    per_token = True

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.device = runner.device
        # Off the CPU, each row's token stays on the device until one sync per position reads the
        # batch's (`sampling.choose(on_device=True)`); on the CPU a sync costs nothing and the sparse
        # Gumbel path is cheaper.
        self.defer_sync = defers_sync(self.device)

    def new_state(self, limit: int | None = None) -> KVCache:
        return self.runner.new_cache(limit)

    def propose(self, state: KVCache, context_token_ids: Sequence[int], num_tokens: int,
                sampling: SamplingParams) -> Proposal:
        return self.propose_batch([state], [context_token_ids], [num_tokens], [sampling])[0]

    @torch.inference_mode()
    def propose_batch(
        self,
        states: Sequence[KVCache],
        contexts: Sequence[Sequence[int]],
        nums_tokens: Sequence[int],
        samplings: Sequence[SamplingParams],
        max_tokens: Sequence[int | None] | None = None,
    ) -> list[Proposal]:
        """Propose for many sequences at once (a single one is a batch of one): one batched draft
        forward per proposal position, rows that need fewer tokens sitting the later ones out. A row's
        random numbers depend on its seed and positions only, so it draws exactly what it would draw
        alone. `max_tokens` is for proposers whose matches cost no forward; a model ignores it."""
        catchups, rewound, wanted = [], [], []
        for cache, context, num_tokens in zip(states, contexts, nums_tokens):
            rewound.append(len(cache) - cache.rewind_to_prefix_of(context))
            if len(cache) == len(context):
                cache.rewind(len(cache) - 1)  # the last committed token is fed to get the next distribution
            catchups.append(list(context[len(cache):]))  # [num_catchup + 1] what the draft has not seen
            wanted.append(max(0, min(num_tokens, self.runner.max_context - len(context))))  # its own context
        tokens: list[list[int]] = [[] for _ in states]
        probs: list[list[torch.Tensor]] = [[] for _ in states]
        feed = [catchups[i] if wanted[i] else [] for i in range(len(states))]
        for _ in range(max(wanted, default=0)):
            logits = self.runner.forward(states, feed, [1] * len(states))
            chosen = {}  # row -> its token (an int; a 0-d device tensor when deferred)
            for i, row_logits in enumerate(logits):
                if row_logits is None:
                    continue
                chosen[i], p = choose(row_logits, samplings[i], len(contexts[i]) + len(tokens[i]),
                                      prefix=_prefix(samplings[i], contexts[i], tokens[i]), on_device=self.defer_sync)
                if p is not None:
                    probs[i].append(p)
            if self.defer_sync and chosen:  # one host sync per position for the whole batch
                chosen = dict(zip(chosen, torch.stack(list(chosen.values())).tolist()))
            for i, token in chosen.items():
                tokens[i].append(token)
                # The last proposed token is not fed: the cache holds the context + the first K-1.
                feed[i] = [token] if len(tokens[i]) < wanted[i] else []
        return [Proposal(tokens[i], torch.stack(probs[i]) if probs[i] else None, num_forwards=wanted[i],
                         num_catchup_tokens=len(catchups[i]) - 1 if wanted[i] else 0, rewound_tokens=rewound[i],
                         cache_tokens=len(states[i]))
                for i in range(len(states))]

    def rewind(self, state: KVCache, context_token_ids: Sequence[int]) -> None:
        state.rewind_to_prefix_of(context_token_ids)

    def release(self, state: KVCache) -> None:
        state.rewind(0)


def _prefix(sampling: SamplingParams, context: Sequence[int], proposed: list[int]) -> Sequence[int]:
    """The tokens before the next proposal, for requests that process logits (penalties see them)."""
    return [*context, *proposed] if sampling.processes_logits else ()
