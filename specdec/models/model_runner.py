"""Forward passes of one causal LM over new tokens of one or many requests, each on its own KV cache.

The model is a stock transformers model. Every forward is a flat batch (`specdec.models.flat_batch`): the
new tokens of all its rows packed into one sequence, each row attending to its own cache, so a
single request is a batch of one and a batch costs no copy of anyone's past. The runner returns
the logits of the positions asked for, aligned to a fixed vocabulary size so target and draft
logits can be compared position by position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.models.flat_batch import FlatBatch, check_supported, flat_forward
from specdec.models.kv_cache import KVCache
from specdec.models.loading import LoadedModel


class ModelRunner:
    """Runs `model(new_tokens, cache)` and returns float32 logits `[num_logits, vocab_size]`."""

    def __init__(self, loaded: LoadedModel, vocab_size: int | None = None) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.model_vocab_size = loaded.vocab_size
        # The vocabulary the logits are reported in (the target's, for a draft with padded embeddings).
        self.vocab_size = vocab_size or self.model_vocab_size
        self.max_context = loaded.max_context
        check_supported(self.model.config)

    def new_cache(self, limit: int | None = None) -> KVCache:
        return KVCache(limit)

    def _check_context(self, caches: Sequence[KVCache], token_lists: Sequence[Sequence[int]]) -> None:
        for cache, tokens in zip(caches, token_lists):
            if len(cache) + len(tokens) > self.max_context:
                raise ValueError(f"sequence of {len(cache) + len(tokens)} tokens exceeds the model's context of "
                                 f"{self.max_context}")

    @torch.inference_mode()
    def forward(self, caches: Sequence[KVCache], token_lists: Sequence[Sequence[int]],
                num_logits: Sequence[int]) -> list[torch.Tensor | None]:
        """One flat forward over many requests' caches (a single request is a batch of one): row i
        appends `token_lists[i]` (empty: it sits this one out) to `caches[i]` and gets the float32
        logits of its last `num_logits[i]` new positions, `[num_logits[i], vocab]`, where logits row j
        predicts the token after `token_lists[i][len - num_logits[i] + j]` (None when it sat out).
        Each row's logits are those it gets alone, up to float summation order."""
        self._check_context(caches, token_lists)
        live = [i for i, t in enumerate(token_lists) if t]
        if not live:
            raise ValueError("forward needs at least one new token")
        batch, input_ids = FlatBatch.pack([caches[i] for i in live], [token_lists[i] for i in live], self.device)
        keep = []  # [num_logits_total] packed positions whose logits are returned
        for j, i in enumerate(live):
            end = batch.query_start_loc[j + 1]
            keep.extend(range(end - num_logits[i], end))
        with flat_forward(self.model, batch) as cache:
            out = self.model(input_ids=input_ids, position_ids=batch.position_ids, cache=cache, use_cache=True,
                             logits_to_keep=torch.tensor(keep, dtype=torch.long, device=self.device))
        for i in live:
            caches[i].append(token_lists[i])
        logits = self._to_vocab(out.logits[0].float())  # [num_logits_total, vocab]
        rows: list[torch.Tensor | None] = [None] * len(token_lists)
        offset = 0
        for i in live:
            rows[i] = logits[offset : offset + num_logits[i]]
            offset += num_logits[i]
        return rows

    def _to_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        v, mv = self.vocab_size, logits.shape[-1]
        if mv == v:
            return logits
        if mv > v:
            return logits[:, :v]
        pad = torch.full((logits.shape[0], v - mv), float("-inf"), device=logits.device)
        return torch.cat([logits, pad], dim=-1)
