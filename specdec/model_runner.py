"""Forward passes of one causal LM over new tokens, on a sequence's KV cache.

The model is a stock transformers model; the runner only feeds it the tokens the cache does not
hold yet and returns the logits of the last `num_logits` positions, aligned to a fixed vocabulary
size so target and draft logits can be compared position by position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.kv_cache import BatchedKV, KVCache
from specdec.models import LoadedModel


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

    def new_cache(self) -> KVCache:
        return KVCache(self.model.config)

    @torch.inference_mode()
    def forward(self, cache: KVCache, token_ids: Sequence[int], num_logits: int = 1) -> torch.Tensor:
        """Append `token_ids` to `cache` and return the logits of its last `num_logits` positions.

        Returns: `[num_logits, vocab_size]` float32 logits; row i predicts the token after
        `token_ids[len(token_ids) - num_logits + i]`.
        """
        if not token_ids:
            raise ValueError("forward needs at least one new token")
        if len(cache) + len(token_ids) > self.max_context:
            raise ValueError(
                f"sequence of {len(cache) + len(token_ids)} tokens exceeds the model's context of {self.max_context}"
            )
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)  # [1, num_new]
        out = self.model(input_ids=input_ids, cache=cache.cache, use_cache=True, logits_to_keep=num_logits)
        cache.append(token_ids)
        logits = out.logits[0, -num_logits:].float()  # [num_logits, model_vocab_size]
        return self._to_vocab(logits)

    def can_batch(self, caches: Sequence[KVCache]) -> bool:
        return len(caches) > 1 and all(c.batchable for c in caches)

    @torch.inference_mode()
    def open_batch(self, caches: Sequence[KVCache], extra: int) -> BatchedKV:
        """Gather `caches` into one padded batch with room for `extra` more positions per row."""
        return BatchedKV(caches, self.model.config, extra)

    @torch.inference_mode()
    def forward_rows(self, batch: BatchedKV, token_lists: Sequence[Sequence[int]],
                     num_logits: Sequence[int]) -> list[torch.Tensor | None]:
        """One forward of every row of `batch`: row i appends `token_lists[i]` (empty: it idles) and
        gets the logits of its last `num_logits[i]` new positions, `[num_logits[i], vocab]` (None when
        it idled). Each row's logits are those it would get alone (up to float summation order)."""
        for cache_len, tokens in zip(batch.lengths, token_lists):
            if cache_len + len(tokens) > self.max_context:
                raise ValueError(f"sequence of {cache_len + len(tokens)} tokens exceeds the model's context of "
                                 f"{self.max_context}")
        kwargs = batch.inputs(token_lists, self.device)
        width = kwargs["input_ids"].shape[1]
        out = self.model(**kwargs, logits_to_keep=width)
        logits = out.logits.float()  # [rows, width, model_vocab]
        rows = []
        for row, (tokens, n) in enumerate(zip(token_lists, num_logits)):
            if not tokens:
                rows.append(None)
                continue
            rows.append(self._to_vocab(logits[row, len(tokens) - n : len(tokens)]))
        return rows

    @torch.inference_mode()
    def forward_batch(self, caches: Sequence[KVCache], token_lists: Sequence[Sequence[int]],
                      num_logits: Sequence[int]) -> list[torch.Tensor]:
        """`forward` of many caches in one batched pass (one alone runs unbatched)."""
        if not self.can_batch(caches):
            return [self.forward(c, t, n) for c, t, n in zip(caches, token_lists, num_logits)]
        batch = self.open_batch(caches, max(len(t) for t in token_lists))
        rows = self.forward_rows(batch, token_lists, num_logits)
        batch.write_back()
        return rows

    def _to_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        v, mv = self.vocab_size, logits.shape[-1]
        if mv == v:
            return logits
        if mv > v:
            return logits[:, :v]
        pad = torch.full((logits.shape[0], v - mv), float("-inf"), device=logits.device)
        return torch.cat([logits, pad], dim=-1)
