"""KV caches: one per request and model, rewindable to any committed prefix in O(1).

Speculation writes K/V for proposed tokens that may be rejected; only accepted tokens may stay.
`KVCache.rewind(n)` keeps the first `n` tokens by moving an end index: nothing is copied and the
kept prefix is never recomputed.

Each layer of a request's cache is a `LayerKV`: keys and values of the positions it holds, in a
buffer with spare capacity so an append copies only the new tokens (transformers' `DynamicLayer`
re-concatenates the whole cache on every update). Forwards write new keys/values straight into
these buffers and attention reads them in place (`specdec.models.flat_batch`): a batched forward never
gathers rows into a padded batch.

Sliding-window layers (Mistral, Gemma 2/3 local layers, Qwen2 with `use_sliding_window`) keep only
what the future can read: the last `window` positions, plus `ROLLBACK_TOKENS` so that a rejected
proposal can still be rewound. Older keys are dropped in blocks (amortised O(1) per token), and the
attention masks anything beyond the window. transformers' `DynamicSlidingWindowLayer` cannot be
cropped once the window is full (`crop was called, but ... the sliding window size was already
reached`); this layer can, by up to `ROLLBACK_TOKENS`. A rewind deeper than that is refused
(`can_rewind`), and a draft that needs one starts its cache over.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.config import MAX_SPECULATIVE_TOKENS

#: How far back a sliding-window layer can still be rewound: more than any verify (K + 1 tokens)
#: or an unused pre-drafted block ever drops.
ROLLBACK_TOKENS = 4 * MAX_SPECULATIVE_TOKENS


class LayerKV:
    """Keys and values of one attention layer of one request: positions `[start, length)`.

    `keys`/`values` are `[1, num_kv_heads, length - start, head_dim]` views of buffers with spare
    capacity. `window` is the layer's sliding window (None: full attention); it is learned from the
    model on the first forward, which is when a layer's kind shows.
    """

    __slots__ = ("_k", "_v", "start", "length", "window", "limit")

    def __init__(self, limit: int | None = None) -> None:
        self._k: torch.Tensor | None = None  # [1, num_kv_heads, capacity, head_dim]
        self._v: torch.Tensor | None = None  # [1, num_kv_heads, capacity, head_dim]
        self.start = 0  # absolute position of buffer slot 0
        self.length = 0  # absolute position one past the last held token
        self.window: int | None = None
        self.limit = limit  # the most slots the buffers may grow to (its request's KV reservation)

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[..., : self.length - self.start, :]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[..., : self.length - self.start, :]

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write `[1, num_kv_heads, n, head_dim]` new keys/values at positions `[length, length + n)`."""
        n = key_states.shape[-2]
        if self.window is not None:
            self._drop_unreachable()
        held = self.length - self.start
        self._reserve(key_states, value_states, held + n)
        self._k[..., held : held + n, :] = key_states
        self._v[..., held : held + n, :] = value_states
        self.length += n

    def _drop_unreachable(self) -> None:
        """Drop keys no query can read any more, once enough have piled up to make the copy cheap."""
        keep = self.window + ROLLBACK_TOKENS
        held = self.length - self.start
        if held <= 2 * keep:
            return
        drop = held - keep
        self._k[..., :keep, :] = self._k[..., drop:held, :].clone()
        self._v[..., :keep, :] = self._v[..., drop:held, :].clone()
        self.start += drop

    def _reserve(self, like_k: torch.Tensor, like_v: torch.Tensor, capacity: int) -> None:
        if self._k is not None and self._k.shape[-2] >= capacity:
            return
        size = max(capacity, 2 * (self._k.shape[-2] if self._k is not None else 0), 32)
        if self.limit is not None:
            size = max(capacity, min(size, self.limit))  # doubling stops at the reservation
        k = like_k.new_empty(*like_k.shape[:2], size, like_k.shape[-1])
        v = like_v.new_empty(*like_v.shape[:2], size, like_v.shape[-1])
        held = self.length - self.start
        if self._k is not None and held:
            k[..., :held, :] = self._k[..., :held, :]
            v[..., :held, :] = self._v[..., :held, :]
        self._k, self._v = k, v

    def can_rewind(self, length: int) -> bool:
        """Whether every query after a rewind to `length` still finds the keys it may attend to."""
        if self.start == 0 or length == 0:
            return True
        if self.window is None:
            return length >= self.start
        return length - self.window + 1 >= self.start

    def rewind(self, length: int) -> None:
        if not self.can_rewind(length):
            raise ValueError(f"a sliding-window layer holding positions [{self.start}, {self.length}) cannot be "
                             f"rewound to {length}")
        self.length = min(self.length, length)
        if self.length <= self.start:
            self.start = self.length = 0

    def clear(self) -> None:
        self._k = self._v = None
        self.start = self.length = 0

    @property
    def nbytes(self) -> int:
        """Bytes of its buffers (capacity, not length)."""
        return 0 if self._k is None else self._k.numel() * self._k.element_size() * 2

    def copy_prefix(self, source: "LayerKV", length: int) -> None:
        """Hold `source`'s positions up to `length` (those a query after `length` may read), copied
        into buffers of this layer's own."""
        self.window = source.window
        start = source.start
        if self.window is not None and length > start + self.window + ROLLBACK_TOKENS:
            start = length - self.window - ROLLBACK_TOKENS  # older keys are out of every future query's window
        held = length - start
        if held <= 0:
            self.clear()
            return
        k, v = source._k[..., start - source.start: length - source.start, :], \
            source._v[..., start - source.start: length - source.start, :]
        self._k = self._v = None
        self.start = self.length = start
        self._reserve(k, v, held)
        self._k[..., :held, :] = k
        self._v[..., :held, :] = v
        self.length = length


class KVCache:
    """One request's keys/values for every layer of one model, plus the ids of the tokens they hold.
    `limit`: the most tokens its buffers grow to (its request's KV reservation, `KVLayout`)."""

    def __init__(self, limit: int | None = None) -> None:
        self.layers: list[LayerKV] = []  # grown to the model's layer count on the first forward
        self.token_ids: list[int] = []
        self.limit = limit

    def __len__(self) -> int:
        return len(self.token_ids)

    def layer(self, index: int) -> LayerKV:
        while len(self.layers) <= index:
            self.layers.append(LayerKV(self.limit))
        return self.layers[index]

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def serves_from(self) -> int:
        """The shortest prefix `copy_prefix` can take: sliding layers that dropped keys serve only
        lengths whose window they still hold."""
        return max([layer.start + layer.window - 1 for layer in self.layers if layer.start and layer.window]
                   + [1])

    def can_serve(self, length: int) -> bool:
        """Can a copy of its first `length` tokens continue decoding (`copy_prefix`)? Every layer must
        hold what a query at `length` reads: full layers from 0, sliding ones their window."""
        return 0 < length <= len(self.token_ids) and all(
            layer.start == 0 or (layer.window is not None and length - layer.window + 1 >= layer.start)
            for layer in self.layers)

    def copy_prefix(self, source: "KVCache", length: int) -> None:
        """Hold `source`'s first `length` tokens (the caller checked `source.can_serve(length)`), in
        buffers of its own; what it held before is dropped."""
        self.layers = []
        for index, layer in enumerate(source.layers):
            self.layer(index).copy_prefix(layer, length)
        self.token_ids = list(source.token_ids[:length])

    def append(self, token_ids: Sequence[int]) -> None:
        """Record tokens just written by a forward pass over this cache."""
        self.token_ids.extend(int(t) for t in token_ids)

    def can_rewind(self, length: int) -> bool:
        return 0 <= length <= len(self.token_ids) and all(layer.can_rewind(length) for layer in self.layers)

    def rewind(self, length: int) -> None:
        """Keep only the first `length` tokens."""
        if not 0 <= length <= len(self.token_ids):
            raise ValueError(f"cannot rewind a cache of {len(self.token_ids)} tokens to {length}")
        for layer in self.layers:
            layer.rewind(length)
        del self.token_ids[length:]

    def clear(self) -> None:
        """Drop everything and free the buffers."""
        for layer in self.layers:
            layer.clear()
        self.token_ids.clear()

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
        """Drop every cached token that is not part of `token_ids`' prefix; return the kept length.
        Where sliding-window layers cannot go back that far, the cache starts over (returns 0)."""
        keep = self.common_prefix_length(token_ids)
        if not self.can_rewind(keep):
            keep = 0
        self.rewind(keep)
        return keep


@dataclass(frozen=True)
class KVLayout:
    """What a model's KV cache costs: bytes per token over its full-attention layers, over its
    sliding-window layers, and the most tokens a sliding layer holds (window, rewind margin, and the
    piles `LayerKV` lets grow before dropping, plus a prefill chunk). Summed over tensor-parallel
    ranks, it is the whole model's."""

    full_bytes: int
    sliding_bytes: int = 0
    sliding_tokens: int = 0

    def bytes_for(self, tokens: int) -> int:
        """Bytes of one request's cache holding `tokens` tokens, at most."""
        return self.full_bytes * tokens + self.sliding_bytes * min(tokens, self.sliding_tokens)

    def __add__(self, other: "KVLayout") -> "KVLayout":
        return KVLayout(self.full_bytes + other.full_bytes, self.sliding_bytes + other.sliding_bytes,
                        max(self.sliding_tokens, other.sliding_tokens))

    @classmethod
    def of(cls, config, dtype: torch.dtype, max_chunk: int = 512) -> "KVLayout":
        """From a transformers config: layers, KV heads, head size, layer kinds, window."""
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads = getattr(text, "num_attention_heads", 1)
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        per_layer = 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        kinds = list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)
        window = getattr(text, "sliding_window", None)
        sliding = sum(k == "sliding_attention" for k in kinds) if window else 0
        return cls(per_layer * (len(kinds) - sliding), per_layer * sliding,
                   2 * (window + ROLLBACK_TOKENS) + max_chunk if sliding else 0)
