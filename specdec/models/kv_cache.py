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

    __slots__ = ("_k", "_v", "start", "length", "window")

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None  # [1, num_kv_heads, capacity, head_dim]
        self._v: torch.Tensor | None = None  # [1, num_kv_heads, capacity, head_dim]
        self.start = 0  # absolute position of buffer slot 0
        self.length = 0  # absolute position one past the last held token
        self.window: int | None = None

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


class KVCache:
    """One request's keys/values for every layer of one model, plus the ids of the tokens they hold."""

    def __init__(self) -> None:
        self.layers: list[LayerKV] = []  # grown to the model's layer count on the first forward
        self.token_ids: list[int] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    def layer(self, index: int) -> LayerKV:
        while len(self.layers) <= index:
            self.layers.append(LayerKV())
        return self.layers[index]

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
