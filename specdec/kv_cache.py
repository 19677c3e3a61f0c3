"""KV caches: one per sequence, rewindable to any committed prefix, and batched forwards over many.

Speculation writes K/V for proposed tokens that may be rejected; only accepted tokens may stay.
`rewind(n)` crops to the first `n` tokens (transformers' `DynamicCache.crop`, which takes a
negative count of tokens to remove), which is O(1): no recompute of the kept prefix.

Layout under batching (`BatchedKV`): every request keeps its own cache; a batched forward gathers
the rows into one padded batch (row i's keys at positions [0, len_i), padding up to the longest
row P, then the step's new tokens at [P, P+T)), runs the model once with per-row position ids
(len_i + j, so RoPE sees the positions the row has alone) and a 2-D attention mask that hides the
padding, and appends each row's new keys/values back to its own cache. Why this and not one
batched cache with per-row lengths: rows join, leave and rewind by different amounts every step
(a rejection drops a different suffix in each row), which on a shared tensor means holes, a
compaction policy and a mask that remembers them; per-request caches keep rewind an O(1) crop and
admission/eviction free, for one copy of the batch's KV per batched forward. That copy costs what
stock `DynamicCache.update` already pays per forward (it re-concatenates the whole cache), and the
caches here do not pay it any more: their layers (`GrowableLayer`) keep spare capacity, so an
append copies only the new tokens. The gathered batch gets capacity for all of a step's draft
forwards at once (`extra`), so K draft passes gather once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _growable_layer_class():
    from transformers.cache_utils import DynamicLayer

    class GrowableLayer(DynamicLayer):
        """A full-attention layer whose keys/values are views of a buffer with spare capacity
        (`DynamicLayer` re-concatenates the whole cache on every update)."""

        def __init__(self) -> None:
            super().__init__()
            self._k: torch.Tensor | None = None
            self._v: torch.Tensor | None = None
            self.length = 0

        def _views(self) -> None:
            self.keys = self._k[..., : self.length, :]
            self.values = self._v[..., : self.length, :]

        def lazy_initialization(self, key_states, value_states) -> None:
            self.device = key_states.device
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = key_states.shape[-2]
            self.reserve(key_states, value_states, self.length + n)
            self._k[..., self.length : self.length + n, :] = key_states
            self._v[..., self.length : self.length + n, :] = value_states
            self.length += n
            self._views()
            return self.keys, self.values

        def get_seq_length(self, *args) -> int:
            return self.length

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove > 0:
                raise ValueError("crop takes a negative count of tokens to remove")
            if self._k is not None:
                self.length = max(0, self.length + tokens_to_remove)
                self._views()

        def reset(self) -> None:
            self._k = self._v = self.keys = self.values = None
            self.length = 0
            self.is_initialized = False

        def reserve(self, like_k: torch.Tensor, like_v: torch.Tensor, capacity: int) -> None:
            """Room for `capacity` positions of `like_k`'s batch and heads (amortised doubling)."""
            if self._k is not None and self._k.shape[-2] >= capacity and self._k.shape[0] == like_k.shape[0]:
                return
            size = max(capacity, 2 * (self._k.shape[-2] if self._k is not None else 0), 32)
            k = like_k.new_empty(*like_k.shape[:2], size, like_k.shape[-1])
            v = like_v.new_empty(*like_v.shape[:2], size, like_v.shape[-1])
            if self._k is not None and self.length:
                k[..., : self.length, :] = self._k[..., : self.length, :]
                v[..., : self.length, :] = self._v[..., : self.length, :]
            self._k, self._v = k, v
            self.device = k.device
            self.is_initialized = True
            self._views()

    return GrowableLayer


_LAYER_CLASS = None


def _growable_layer():
    global _LAYER_CLASS
    if _LAYER_CLASS is None:
        _LAYER_CLASS = _growable_layer_class()
    return _LAYER_CLASS()


def _full_attention_only(model_config) -> bool:
    text = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        return False
    types = getattr(text, "layer_types", None)
    return not types or all(t == "full_attention" for t in types)


def _num_layers(model_config) -> int:
    text = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    return int(text.num_hidden_layers)


def _new_cache(model_config, num_layers: int | None = None):
    """A `DynamicCache` whose layers are growable (full attention), else the stock one."""
    from transformers import DynamicCache
    from transformers.cache_utils import Cache

    if not _full_attention_only(model_config):
        return DynamicCache(config=model_config), False
    cache = DynamicCache.__new__(DynamicCache)
    Cache.__init__(cache, layers=[_growable_layer() for _ in range(num_layers or _num_layers(model_config))])
    return cache, True


class KVCache:
    """A transformers cache plus the ids of the tokens whose keys/values it holds."""

    def __init__(self, model_config) -> None:
        self.cache, self.batchable = _new_cache(model_config)
        self.token_ids: list[int] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    def append(self, token_ids: Sequence[int]) -> None:
        """Record tokens just written by a forward pass over this cache."""
        self.token_ids.extend(int(t) for t in token_ids)

    def rewind(self, length: int) -> None:
        """Keep only the first `length` tokens."""
        if not 0 <= length <= len(self.token_ids):
            raise ValueError(f"cannot rewind a cache of {len(self.token_ids)} tokens to {length}")
        to_remove = len(self.token_ids) - length
        if to_remove:
            self.cache.crop(-to_remove)
            del self.token_ids[length:]
        held = self.cache.get_seq_length()
        if held != length:
            raise RuntimeError(f"KV cache holds {held} positions after rewinding to {length}")

    def common_prefix_length(self, token_ids: Sequence[int]) -> int:
        """Length of the longest common prefix of the cached tokens and `token_ids`."""
        n = min(len(self.token_ids), len(token_ids))
        mine = self.token_ids
        # Fast path: the whole cached sequence is usually still a prefix.
        if n and mine[n - 1] == token_ids[n - 1] and mine[:n] == list(token_ids[:n]):
            return n
        for i in range(n):
            if mine[i] != token_ids[i]:
                return i
        return n

    def rewind_to_prefix_of(self, token_ids: Sequence[int]) -> int:
        """Drop every cached token that is not part of `token_ids`' prefix; return the kept length."""
        keep = self.common_prefix_length(token_ids)
        self.rewind(keep)
        return keep


class BatchedKV:
    """Many sequences' caches as one padded batch for a series of forwards (see the module docstring).

    Usage: `batch = BatchedKV(caches, extra=T_total)`; for each forward, `batch.inputs(token_lists)`
    gives `input_ids`, `attention_mask`, `position_ids` and the batch cache; after the last forward,
    `batch.write_back()` appends each row's kept new positions to its own cache.
    """

    def __init__(self, caches: Sequence[KVCache], model_config, extra: int) -> None:
        if not all(c.batchable for c in caches):
            raise ValueError("batched forwards need full-attention caches")
        self.caches = list(caches)
        self.lengths = [len(c) for c in caches]  # logical length of each row (its tokens so far)
        self.past = max(self.lengths)
        self.num_layers = len(caches[0].cache.layers)
        self.cache, _ = _new_cache(model_config, self.num_layers)
        rows = len(caches)
        if self.past:
            for index, layer in enumerate(self.cache.layers):
                ref = next(c.cache.layers[index] for c in caches if len(c))
                k, v = ref.keys, ref.values
                layer.reserve(k.new_empty(rows, *k.shape[1:]), v.new_empty(rows, *v.shape[1:]), self.past + extra)
                for row, c in enumerate(caches):
                    n = len(c)
                    if n:
                        layer._k[row, :, :n] = c.cache.layers[index]._k[0, :, :n]
                        layer._v[row, :, :n] = c.cache.layers[index]._v[0, :, :n]
                    # Padding is masked, but uninitialised memory may hold NaN (and 0 * NaN is NaN).
                    layer._k[row, :, n : self.past].zero_()
                    layer._v[row, :, n : self.past].zero_()
                layer.length = self.past
                layer._views()
        self._extra = extra
        # Attention mask over the batch's positions: 1 where a row has a real token.
        self.mask = torch.zeros(rows, self.past + extra, dtype=torch.long)
        for row, n in enumerate(self.lengths):
            self.mask[row, :n] = 1
        self.width = self.past  # positions used so far
        self.new_columns: list[list[int]] = [[] for _ in caches]  # per row: batch positions of its new tokens
        self.new_tokens: list[list[int]] = [[] for _ in caches]

    def inputs(self, token_lists: Sequence[Sequence[int]], device, pad_id: int = 0) -> dict:
        """Model kwargs for one forward: row i appends `token_lists[i]` (may be empty: the row idles)."""
        rows, width = len(token_lists), max(len(t) for t in token_lists)
        if self.width + width > self.past + self._extra:
            raise RuntimeError("batched forward exceeds the capacity it was gathered with")
        input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
        position_ids = torch.zeros((rows, width), dtype=torch.long)
        for row, tokens in enumerate(token_lists):
            n = len(tokens)
            input_ids[row, :n] = torch.tensor(list(tokens), dtype=torch.long)
            position_ids[row] = self.lengths[row] + torch.arange(width)
            self.mask[row, self.width : self.width + n] = 1
            self.new_columns[row].extend(range(self.width, self.width + n))
            self.new_tokens[row].extend(int(t) for t in tokens)
            self.lengths[row] += n
        end = self.width = self.width + width
        return {"input_ids": input_ids.to(device), "attention_mask": self.mask[:, :end].to(device),
                "position_ids": position_ids.to(device), "cache": self.cache, "use_cache": True}

    @torch.inference_mode()
    def write_back(self) -> None:
        """Append each row's new tokens' keys/values to its own cache."""
        for row, c in enumerate(self.caches):
            columns = self.new_columns[row]
            if not columns:
                continue
            index = torch.tensor(columns, dtype=torch.long, device=self.cache.layers[0]._k.device)
            for layer, own in zip(self.cache.layers, c.cache.layers):
                own.update(layer._k[row : row + 1].index_select(-2, index),
                           layer._v[row : row + 1].index_select(-2, index))
            c.append(self.new_tokens[row])
