"""One KV memory budget per engine: the running requests' reservations plus the cached prefixes.

A request reserves, when it enters the batch, the KV its target (and draft) cache may reach: its
prompt, its `max_tokens` (the rest of the context when it has none) and one verify pass of the
largest K (`KVLayout.bytes_for`). Its buffers never grow past that (`KVCache.limit`), so a running
request never needs memory it does not hold and none fails for memory. A request that does not fit
beside the running ones waits at the head of the queue; one that could never fit, even alone, is
refused when submitted, naming its length and the budget. What the reservations leave is the room of
the prefix caches: they evict least recently used entries down to it whenever it shrinks.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.config import parse_memory
from specdec.models.kv_cache import KVLayout


class OverBudget(ValueError):
    """A request whose KV could never fit in the budget, even alone."""


def available_memory(device) -> int | None:
    """Bytes free for KV where `device`'s caches live: the GPU's free memory (`torch.cuda.mem_get_info`),
    else the host's available memory (None: unknown)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    from specdec.kernels.linear import available_memory_bytes

    return available_memory_bytes()


def budget_bytes(setting: str, available: int | None) -> int | None:
    """`kv_cache_memory` in bytes (None: unbounded, where the available memory is unknown)."""
    kind, value = parse_memory(setting)
    if kind == "bytes":
        return int(value)
    return int(value * available) if available else None


@dataclass
class KVBudget:
    total: int  # bytes
    target: KVLayout
    draft: KVLayout | None = None

    def reservation(self, tokens: int) -> int:
        return self.target.bytes_for(tokens) + (self.draft.bytes_for(tokens) if self.draft is not None else 0)

    def check(self, tokens: int, prompt_tokens: int) -> int:
        """A request's reservation in bytes, or `OverBudget` if it exceeds the whole budget."""
        need = self.reservation(tokens)
        if need > self.total:
            raise OverBudget(f"the prompt of {prompt_tokens} tokens with its max_tokens needs a KV cache of up to "
                             f"{tokens} tokens ({need / 2**20:.1f} MiB), more than this server's KV budget of "
                             f"{self.total / 2**20:.1f} MiB (kv_cache_memory); send a shorter prompt or a smaller "
                             "max_tokens")
        return need

    def prefix_room(self, reserved: int) -> tuple[int, int]:
        """The bytes left to the target's and the draft's prefix caches beside `reserved`, split by
        what a token costs each."""
        room = max(0, self.total - reserved)
        target, draft = self.target.bytes_for(1), self.draft.bytes_for(1) if self.draft is not None else 0
        share = target / (target + draft) if target + draft else 1.0
        return int(room * share), room - int(room * share)
