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
from specdec.decoding.sampling import choose


class DraftModelProposer:
    name = "model"
    per_token = True

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.device = runner.device

    def new_state(self) -> KVCache:
        return self.runner.new_cache()

    @torch.inference_mode()
    def propose(
        self,
        state: KVCache,
        context_token_ids: Sequence[int],
        num_tokens: int,
        sampling: SamplingParams,
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
        for j in range(num_tokens):
            logits = self.runner.forward(cache, new_token_ids, num_logits=1)  # [1, vocab]
            token, probs = choose(logits, sampling, len(context_token_ids) + j, prefix=_prefix(
                sampling, context_token_ids, token_ids))
            if probs is not None:
                rows.append(probs)
            token_ids.append(token)
            new_token_ids = [token]
        probs = torch.stack(rows) if rows else None  # [num_tokens, vocab]
        return Proposal(token_ids, probs, num_forwards=num_tokens, num_catchup_tokens=num_catchup,
                        rewound_tokens=rewound, cache_tokens=len(cache))

    @torch.inference_mode()
    def propose_batch(
        self,
        states: Sequence[KVCache],
        contexts: Sequence[Sequence[int]],
        nums_tokens: Sequence[int],
        samplings: Sequence[SamplingParams],
        max_tokens: Sequence[int | None] | None = None,
    ) -> list[Proposal]:
        """`propose` for many sequences at once: one batched draft forward per proposal position (rows
        that need fewer tokens idle in the later ones). A row's random numbers depend on its seed and
        positions only, so it draws exactly what it would draw alone."""
        rows = []
        for cache, context, num_tokens in zip(states, contexts, nums_tokens):
            held = len(cache)
            rewound = held - cache.rewind_to_prefix_of(context)
            if len(cache) == len(context):
                cache.rewind(len(cache) - 1)
            num_tokens = min(num_tokens, self.runner.max_context - len(context))
            rows.append((rewound, max(0, num_tokens), list(context[len(cache):])))
        active = [i for i, (_, n, _) in enumerate(rows) if n > 0]
        proposals = [Proposal([], rewound_tokens=r, cache_tokens=len(c)) for (r, _, _), c in zip(rows, states)]
        if len(active) <= 1 or not self.runner.can_batch([states[i] for i in active]):
            for i in active:
                p = self.propose(states[i], contexts[i], rows[i][1], samplings[i])
                p.rewound_tokens += rows[i][0]
                proposals[i] = p
            return proposals
        width = max(len(rows[i][2]) for i in active)
        steps = max(rows[i][1] for i in active)
        batch = self.runner.open_batch([states[i] for i in active], width + steps - 1)
        feed = [rows[i][2] for i in active]
        tokens: list[list[int]] = [[] for _ in active]
        probs: list[list[torch.Tensor]] = [[] for _ in active]
        for step in range(steps):
            logits = self.runner.forward_rows(batch, feed, [1] * len(active))
            feed = []
            for j, i in enumerate(active):
                if logits[j] is None:
                    feed.append([])
                    continue
                token, p = choose(logits[j], samplings[i], len(contexts[i]) + len(tokens[j]),
                                  prefix=_prefix(samplings[i], contexts[i], tokens[j]))
                if p is not None:
                    probs[j].append(p)
                tokens[j].append(token)
                # The last proposed token is not fed: the cache holds the context + the first K-1.
                feed.append([token] if len(tokens[j]) < rows[i][1] else [])
        batch.write_back()
        for j, i in enumerate(active):
            rewound, num_tokens, new = rows[i]
            proposals[i] = Proposal(tokens[j], torch.stack(probs[j]) if probs[j] else None, num_forwards=num_tokens,
                                    num_catchup_tokens=len(new) - 1, rewound_tokens=rewound,
                                    cache_tokens=len(states[i]))
        return proposals

    def rewind(self, state: KVCache, context_token_ids: Sequence[int]) -> None:
        state.rewind_to_prefix_of(context_token_ids)

    def release(self, state: KVCache) -> None:
        state.rewind(0)


def _prefix(sampling: SamplingParams, context: Sequence[int], proposed: list[int]) -> Sequence[int]:
    """The tokens before the next proposal, for requests that process logits (penalties see them)."""
    return [*context, *proposed] if sampling.processes_logits else ()
