"""One sequence's KV cache, with the token ids it holds, so it can rewind to any committed prefix.

Speculation writes K/V for proposed tokens that may be rejected; only accepted tokens may stay.
`rewind(n)` crops to the first `n` tokens (transformers' `DynamicCache.crop`, which takes a
negative count of tokens to remove), which is O(1): no recompute of the kept prefix.
"""

from __future__ import annotations

from collections.abc import Sequence


class KVCache:
    """A transformers `DynamicCache` plus the ids of the tokens whose keys/values it holds."""

    def __init__(self, model_config) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=model_config)
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
