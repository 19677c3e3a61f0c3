"""Committed KV of earlier requests, found by token prefix, so a new request prefills only what is new.

A chat client resends the whole conversation every turn, an agent the whole transcript after every
tool result, and many clients share a system prompt. The KV of a token sequence depends on nothing
but its tokens (and the model), so one computed for an earlier request serves any later request
whose prompt starts with the same tokens.

How the others do it, and what fits here:
- vLLM v1 (`KVCacheManager`): the KV lives in fixed-size blocks of one shared pool; each full block
  is named by a hash chained over the blocks before it, and a new request takes the cached blocks of
  its longest hashed prefix by reference (no copy), its attention reading them through a block
  table. Partial blocks are not shared.
- SGLang (`RadixCache`): a radix tree over token sequences whose nodes point at KV slots of one
  pool; a match can end anywhere, and eviction is LRU over leaves.
- transformers' continuous batching (`PagedAttentionCache`): paged blocks too, gathered into one key
  tensor per forward for its SDPA path.
specdec keeps each request's KV in its own contiguous buffers (`kv_cache.py`), read in place by the
flat batch's attention (`flat_batch.py`: no gather, no block table, the CPU's fastest layout). So a
hit copies the matched prefix into the new request's own buffers instead of sharing blocks: one
memory copy of the prefix, measured at ~1 ms per 100 tokens for the 1.5B Qwen target on a 2-core
CPU (56 KB of KV per token), where prefilling those tokens costs ~1.3 s (int4) to 2 s (float32). A
paged pool would save that copy and cost a gather in every forward. The index is vLLM's: 16-token
blocks named by a chained hash, each naming the entries that hold it; the match is then extended
token by token past the last full block, so a prefix that ends mid-block hits to its last token
(as SGLang's radix tree does).

Entries are the caches of finished requests (kept whole instead of freed) and of running ones
(registered live: their committed prefix is copied out as it stands; they are not counted here,
their request's reservation holds their bytes). Finished entries are counted and evicted least
recently used first, down to the room the engine's KV budget leaves them (`fit`). An entry salted by
a request's `cache_salt` is found only by requests with the same salt. Sliding-window layers keep
their window: an entry serves a prefix only where every layer still holds what the next query reads
(`KVCache.can_serve`).
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec.models.kv_cache import KVCache

#: Tokens per hashed block of the index.
BLOCK_TOKENS = 16


def block_hashes(token_ids: Sequence[int], salt: str = "") -> list[bytes]:
    """The chained hash of each full block of `token_ids` (block i names blocks 0..i and the salt)."""
    hashes, previous = [], salt.encode()
    for start in range(0, len(token_ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        block = ",".join(map(str, token_ids[start:start + BLOCK_TOKENS])).encode()
        previous = hashlib.blake2b(previous + b"|" + block, digest_size=16).digest()
        hashes.append(previous)
    return hashes


@dataclass
class Entry:
    key: int
    cache: KVCache
    salt: str
    live: bool  # a running request's cache (its reservation holds its bytes)
    hashes: list[bytes] = field(default_factory=list)


@dataclass
class Hit:
    """What a lookup found: `length` tokens of `entry` (0: nothing)."""

    length: int = 0
    entry: Entry | None = None


class PrefixCache:
    def __init__(self) -> None:
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self.index: dict[bytes, set[int]] = {}
        self.live: dict[str, int] = {}  # request id -> its live entry
        self._keys = itertools.count()
        self.evictions = 0  # finished entries dropped for room
        self.hit_tokens = 0  # tokens served by lookups so far

    # ------------------------------------------------------------------------------ entries

    def _add(self, cache: KVCache, salt: str, live: bool, tokens: Sequence[int] | None = None) -> Entry:
        entry = Entry(next(self._keys), cache, salt, live,
                      block_hashes(cache.token_ids if tokens is None else tokens, salt))
        self.entries[entry.key] = entry
        for h in entry.hashes:
            self.index.setdefault(h, set()).add(entry.key)
        return entry

    def _drop(self, entry: Entry) -> None:
        self.entries.pop(entry.key, None)
        for h in entry.hashes:
            keys = self.index.get(h)
            if keys is not None:
                keys.discard(entry.key)
                if not keys:
                    del self.index[h]

    def watch(self, request_id: str, cache: KVCache, salt: str = "", tokens: Sequence[int] = ()) -> None:
        """Index a running request's cache under the tokens it will hold (its prompt): a later request
        copies as much of that prefix as the cache holds by then (a lookup compares what it holds).
        Released, it is indexed under all it holds."""
        self.live[request_id] = self._add(cache, salt, live=True, tokens=tokens).key

    def release(self, request_id: str, cache: KVCache | None, keep: bool = True) -> None:
        """A request ended: its live entry goes; with `keep`, its cache stays as a finished entry
        (the tokens it holds are real inputs, so their KV serves any prompt that starts with them)."""
        key = self.live.pop(request_id, None)
        salt = ""
        if key is not None and key in self.entries:
            salt = self.entries[key].salt
            self._drop(self.entries[key])
        if keep and cache is not None and len(cache) >= BLOCK_TOKENS:
            for other in [e for e in self.entries.values() if not e.live and e.salt == salt
                          and _is_prefix(e.cache.token_ids, cache.token_ids)
                          and cache.serves_from() <= e.cache.serves_from()]:
                self._drop(other)  # a shorter copy of the same text: the new entry serves all it did
                other.cache.clear()
            self._add(cache, salt, live=False)
        elif cache is not None:
            cache.clear()

    # ------------------------------------------------------------------------------ lookup

    def lookup(self, token_ids: Sequence[int], salt: str = "", limit: int | None = None) -> Hit:
        """The longest prefix of `token_ids` (at most `limit` tokens) an entry can serve."""
        limit = len(token_ids) if limit is None else min(limit, len(token_ids))
        candidates: set[int] = set()
        for h in block_hashes(token_ids[:limit], salt):
            keys = self.index.get(h)
            if not keys:
                break
            candidates = keys
        best = Hit()
        for key in candidates:
            entry = self.entries[key]
            held = entry.cache.token_ids
            n = min(limit, len(held))
            length = next((i for i in range(n) if held[i] != token_ids[i]), n)
            if length and not entry.cache.can_serve(length):
                length = 0  # a sliding layer no longer holds that window: nothing from this entry
            if length > best.length:
                best = Hit(length, entry)
        if best.entry is not None and not best.entry.live:
            self.entries.move_to_end(best.entry.key)  # recently used
        self.hit_tokens += best.length
        return best

    # ---------------------------------------------------------------------------- the budget

    @property
    def nbytes(self) -> int:
        """Bytes held by finished entries (live ones are their requests')."""
        return sum(e.cache.nbytes for e in self.entries.values() if not e.live)

    def fit(self, room: int) -> int:
        """Evict finished entries, least recently used first, until they hold at most `room` bytes;
        the bytes they hold then."""
        held = self.nbytes
        for entry in [e for e in self.entries.values() if not e.live]:
            if held <= room:
                break
            held -= entry.cache.nbytes
            self._drop(entry)
            entry.cache.clear()
            self.evictions += 1
        return held

    def clear(self) -> None:
        for entry in list(self.entries.values()):
            if not entry.live:
                entry.cache.clear()
        self.entries.clear()
        self.index.clear()
        self.live.clear()


def _is_prefix(short: Sequence[int], long: Sequence[int]) -> bool:
    return len(short) <= len(long) and list(long[:len(short)]) == list(short)
