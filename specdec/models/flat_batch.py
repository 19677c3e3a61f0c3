"""One forward over many requests: their new tokens packed into one sequence, each attending to its own cache.

This is the layout vLLM v1 runs (`query_start_loc`, `seq_lens`; FlashAttention's varlen `cu_seqlens`)
and the one GPU kernels take. A forward of R rows with n_i new tokens each feeds the model
`input_ids` of shape `[1, sum(n_i)]` with per-token `position_ids` (row i's tokens at
`cached_len_i + j`, so RoPE sees the positions the row has alone). The linears run on exactly
sum(n_i) tokens: no padding, and no row's past is copied. Attention is the only part that must
know about rows, so it is the only part replaced:

- `FlatCache.update` (called by every attention layer with the layer's new keys/values) writes
  each row's slice straight into that request's own `LayerKV` (`specdec.models.kv_cache`).
- `flat_attention`, registered in transformers' `AttentionInterface` under `"specdec_flat"`, runs
  each row's queries against that row's keys in place, with the causal rule and the layer's own
  options: sliding window (it masks beyond it, and the layer keeps only the window plus a rewind
  margin), logit soft-capping, attention sinks, scaling and grouped-query heads.

What we took from libraries, and why not more:
- transformers' `AttentionInterface` is the seam: every decoder family in the installed version
  calls `ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, scaling=...,
  sliding_window=..., softcap=..., s_aux=...)`. A name it does not know for masks makes the model
  skip building its own (padded, batch-wide) mask, which we do not need.
- Where the model's attention is `eager` (Gemma 2's soft-capping, attention sinks), each row runs
  the model's own `eager_attention_forward` on its segment with a mask we build, so those options
  are the model's code, not ours. Where it is `sdpa`, each row calls PyTorch's SDPA directly with
  the query heads of a group folded into the query length (as transformers' `pack_gqa` does for
  one token), so grouped-query keys are read in place instead of `repeat_kv`-copied per head.
- transformers' continuous-batching `PagedAttentionCache` also packs a flat batch, but its SDPA
  path gathers every row's blocks into one key tensor with a `[1, 1, T, total]` mask per forward:
  the copy this layout exists to avoid. FlexAttention's paged block masks would read in place,
  but on the CPU they need `torch.compile` per shape. A paged pool (fixed-size blocks, a block
  table per request) would remove the amortised copy a growing buffer makes; with per-request
  buffers that copy is O(1) amortised per token already, so it is left for a GPU backend.

The attention backend is one function chosen by device: a GPU backend takes the same `FlatBatch`
(its `query_start_loc` and `cached_lens` are exactly varlen flash-attention's `cu_seqlens_q` and
`seqused_k`) and replaces the per-row loop with one kernel call.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from specdec.models.kv_cache import KVCache

ATTENTION_NAME = "specdec_flat"


@dataclass
class FlatBatch:
    """The metadata of one packed forward (cf. vLLM v1 `CommonAttentionMetadata`)."""

    caches: list[KVCache]  # [num_rows] each row's own cache; new keys/values are written into it
    query_start_loc: list[int]  # [num_rows + 1] row i's new tokens are packed tokens [q[i], q[i+1])
    cached_lens: list[int]  # [num_rows] tokens each row's cache held before this forward
    position_ids: torch.Tensor  # [1, num_tokens] position of every packed token in its own row
    # Masks built this forward, shared by the layers that need the same one: (row, start, window) ->
    # [1, 1, num_new, num_keys] bool, True where a query may attend, or None (no mask needed).
    masks: dict = field(default_factory=dict)
    # Layers whose keys were written and layers whose attention ran flat: they must match, or the
    # model computed attention some other way (on the new keys alone).
    written: set = field(default_factory=set)
    attended: set = field(default_factory=set)

    @classmethod
    def pack(cls, caches: Sequence[KVCache], token_lists: Sequence[Sequence[int]], device) -> tuple[FlatBatch, torch.Tensor]:
        """The batch metadata and the packed `input_ids` `[1, num_tokens]` for rows appending `token_lists`."""
        starts, positions, ids = [0], [], []
        for cache, tokens in zip(caches, token_lists):
            n, cached = len(tokens), len(cache)
            starts.append(starts[-1] + n)
            positions.extend(range(cached, cached + n))
            ids.extend(int(t) for t in tokens)
        batch = cls(list(caches), starts, [len(c) for c in caches],
                    torch.tensor([positions], dtype=torch.long, device=device))
        return batch, torch.tensor([ids], dtype=torch.long, device=device)

    @property
    def num_rows(self) -> int:
        return len(self.caches)

    def causal_only(self, row: int, start: int, num_keys: int, window: int | None) -> bool:
        """Is row `row`'s mask exactly the causal triangle over its keys (a prefill from empty)?"""
        num_new = self.query_start_loc[row + 1] - self.query_start_loc[row]
        return start == self.cached_lens[row] and num_keys == num_new and (window is None or num_new <= window)

    def mask(self, row: int, start: int, num_keys: int, window: int | None, device) -> torch.Tensor | None:
        """`[1, 1, num_new, num_keys]` bool: may row `row`'s j-th new token attend to the key at absolute
        position `start + i`? None when one new token sees every key it is given."""
        key = (row, start, num_keys, window)
        if key in self.masks:
            return self.masks[key]
        cached = self.cached_lens[row]
        num_new = self.query_start_loc[row + 1] - self.query_start_loc[row]
        if num_new == 1 and (window is None or cached + 1 - start <= window):
            mask = None
        else:
            query_pos = torch.arange(cached, cached + num_new, device=device)[:, None]  # [num_new, 1]
            key_pos = torch.arange(start, start + num_keys, device=device)[None, :]  # [1, num_keys]
            allowed = key_pos <= query_pos
            if window is not None:
                allowed &= query_pos - key_pos < window
            mask = allowed[None, None]
        self.masks[key] = mask
        return mask


class FlatCache(Cache):
    """What the model sees as its cache during a flat forward: it routes each layer's new keys/values
    to the rows' own caches. Built per forward; holds nothing itself. (A transformers `Cache`, since
    models check `isinstance(cache, Cache)`.)"""

    is_compileable = False

    def __init__(self, batch: FlatBatch) -> None:
        super().__init__(layers=[])
        self.batch = batch

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """`[1, num_kv_heads, num_tokens, head_dim]` new keys/values of layer `layer_idx`, packed."""
        starts = self.batch.query_start_loc
        self.batch.written.add(layer_idx)
        for row, cache in enumerate(self.batch.caches):
            s, e = starts[row], starts[row + 1]
            if e > s:
                cache.layer(layer_idx).append(key_states[:, :, s:e], value_states[:, :, s:e])
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come in `position_ids`, per token


_active = threading.local()


def _eager_of(module):
    """The model's own eager attention (soft-capping, sinks and all), from its modeling file."""
    return getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)


def _sdpa_rows(query, key, value, mask, scaling):
    """Torch SDPA on one row: `query [1, H, n, d]`, `key/value [1, KVH, L, d]` -> `[1, n, H, d]`."""
    _, num_heads, num_new, head_dim = query.shape
    num_kv = key.shape[1]
    group = num_heads // num_kv
    if mask is None and num_new > 1:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                             enable_gqa=group > 1)  # [1, H, n, d]
        return out.transpose(1, 2)
    if group > 1:
        # Fold a group's query heads into the query length: keys/values are read once per KV head.
        query = query.reshape(1, num_kv, group * num_new, head_dim)
        if mask is not None:
            mask = mask.expand(1, 1, num_new, mask.shape[-1]).repeat(1, 1, group, 1)  # [1, 1, group*n, L]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)  # [1, KVH, g*n, d]
    return out.reshape(1, num_heads, num_new, head_dim).transpose(1, 2)


def _as_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def flat_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                   sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """The `AttentionInterface` function: `query [1, H, num_tokens, d]` packed -> `[1, num_tokens, H, d]`.
    `key`/`value` are the packed new ones, already written to the rows' caches; each row reads its own."""
    state = _active.__dict__.get("forward")
    if state is None:
        raise RuntimeError("specdec_flat attention runs only inside FlatForward")
    batch, original = state
    layer_idx = module.layer_idx
    batch.attended.add(layer_idx)
    starts = batch.query_start_loc
    # Our SDPA call where the model's would be plain SDPA; else the model's own function per row.
    use_own = original == "sdpa" and softcap is None and kwargs.get("s_aux") is None \
        and getattr(module, "sinks", None) is None
    eager = _eager_of(module) if original == "eager" else None
    outs = []
    for row, cache in enumerate(batch.caches):
        s, e = starts[row], starts[row + 1]
        if e == s:
            continue
        layer = cache.layers[layer_idx]
        if sliding_window is not None and layer.window is None:
            layer.window = int(sliding_window)
        keys, values = layer.keys, layer.values  # [1, KVH, L, d]
        q = query[:, :, s:e]  # [1, H, n, d]
        if use_own:
            causal = e - s > 1 and batch.causal_only(row, layer.start, keys.shape[-2], layer.window)
            mask = None if causal else batch.mask(row, layer.start, keys.shape[-2], layer.window, query.device)
            outs.append(_sdpa_rows(q, keys, values, mask, scaling))
            continue
        mask = batch.mask(row, layer.start, keys.shape[-2], layer.window, query.device)
        if eager is not None:
            out, _ = eager(module, q, keys, values, None if mask is None else _as_additive(mask, q.dtype),
                           scaling=scaling, dropout=dropout, sliding_window=sliding_window, softcap=softcap, **kwargs)
        else:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            out, _ = sdpa_attention_forward(module, q, keys, values, mask, dropout=dropout, scaling=scaling,
                                            is_causal=False, softcap=softcap, **kwargs)
        outs.append(out)
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None


@functools.cache
def _register() -> None:
    """Register the flat attention with transformers (once per process)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, flat_attention)


@contextmanager
def flat_forward(model, batch: FlatBatch):
    """Run `model(...)` inside this to make its attention flat over `batch`; yields the cache to pass."""
    _register()
    config = model.config
    original = config._attn_implementation
    if original == ATTENTION_NAME:
        raise RuntimeError("flat forwards do not nest")
    _active.forward = (batch, original or "eager")
    config._attn_implementation = ATTENTION_NAME
    try:
        yield FlatCache(batch)
    finally:
        config._attn_implementation = original
        _active.forward = None
    if batch.written != batch.attended:
        raise UnsupportedModel(f"{type(model).__name__} does not compute attention through transformers' "
                               "AttentionInterface in every layer, so its rows cannot read their own caches")


#: Layer kinds the flat batch serves (transformers' `config.layer_types`).
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedModel(ValueError):
    """A model whose layers the flat batch cannot serve (linear attention, state-space layers, ...)."""


def check_supported(config) -> None:
    """Refuse, by name, layer kinds with state other than keys/values (Mamba, linear attention, chunked)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kinds = set(getattr(text, "layer_types", None) or ())
    unsupported = sorted(kinds - set(SUPPORTED_LAYER_TYPES))
    if unsupported:
        raise UnsupportedModel(f"model type {getattr(text, 'model_type', '?')!r} has {', '.join(unsupported)} "
                               f"layers; specdec serves only {' and '.join(SUPPORTED_LAYER_TYPES)} layers")
