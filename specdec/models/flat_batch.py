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

The attention path is chosen by device (`VARLEN_KERNELS`). On the CPU, the per-row loop above. On
CUDA, for half-precision models, one kernel call per layer for the whole batch: torch's
`varlen_attn` (FlashAttention's varlen: `cu_seqlens` from `query_start_loc` and the rows' key
lengths, causal aligned to the bottom right, `window_size=(window - 1, 0)` for sliding layers). It
needs the rows' keys in one tensor, so each layer gathers them (one `cat` per layer: a copy the
per-row loop avoids, paid to replace rows x layers small calls with layers calls; a paged pool with
a block table would remove it). The first batch of each shape also runs the per-row path and
compares: a kernel that fails or differs there is logged and not used again for that shape (a
guard against a kernel wrong in general: alignment, window, grouped heads; `gpu_check` is the
full check). `varlen_reference` is the contract in plain PyTorch,
used to test all of this on the CPU (tests/specdec/test_varlen_attention.py); the CUDA kernel itself
is checked by `benchmarks/gpu_check.py` on a GPU.
"""

from __future__ import annotations

import functools
import itertools
import logging
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
logger = logging.getLogger(__name__)


@dataclass
class FlatBatch:
    """The metadata of one packed forward (cf. vLLM v1 `CommonAttentionMetadata`)."""

    caches: list[KVCache]  # [num_rows] each row's own cache; new keys/values are written into it
    query_start_loc: list[int]  # [num_rows + 1] row i's new tokens are packed tokens [q[i], q[i+1])
    cached_lens: list[int]  # [num_rows] tokens each row's cache held before this forward
    position_ids: torch.Tensor  # [1, num_tokens] position of every packed token in its own row
    # Masks built this forward, shared by the layers that need the same one: (row, start, window) ->
    # [1, 1, num_new, num_keys] bool, True where a query may attend, or None (no mask needed); and
    # the varlen kernel's (cu_q, cu_k) per rows' key lengths ("cu", lengths).
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
    # Our SDPA call where the model's would be plain SDPA; else the model's own function per row.
    use_own = original == "sdpa" and softcap is None and kwargs.get("s_aux") is None \
        and getattr(module, "sinks", None) is None
    for cache in batch.caches:
        layer = cache.layers[layer_idx]
        if sliding_window is not None and layer.window is None:
            layer.window = int(sliding_window)
    kernel = VARLEN_KERNELS.get(query.device.type) if use_own else None
    if kernel is not None and query.dtype in kernel.dtypes:
        out = _varlen(kernel, batch, module, layer_idx, query, scaling)
        if out is not None:
            return out, None
    return _per_row(batch, module, layer_idx, query, use_own, original, scaling, dropout, sliding_window, softcap,
                    **kwargs), None


def _per_row(batch, module, layer_idx, query, use_own, original, scaling, dropout, sliding_window, softcap,
             **kwargs) -> torch.Tensor:
    """Each row's queries against its own cache, one attention call per row (the CPU's path)."""
    starts = batch.query_start_loc
    eager = _eager_of(module) if original == "eager" else None
    outs = []
    for row, cache in enumerate(batch.caches):
        s, e = starts[row], starts[row + 1]
        if e == s:
            continue
        layer = cache.layers[layer_idx]
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
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


# ------------------------------------------------------------------ one call for the whole batch


@dataclass(frozen=True)
class VarlenKernel:
    """Variable-length attention over packed rows (FlashAttention's varlen contract): `q [T, H, d]`,
    `k/v [S, KVH, d]` with rows at `cu_q`/`cu_k` (int32 `[R + 1]`), each row's queries the last of
    its keys (causal aligned to the bottom right), `left` keys of sliding window before each query
    (-1: all) -> `[T, H, d]`."""

    name: str
    fn: object  # (q, k, v, cu_q, cu_k, max_q, max_k, scale, left) -> out
    dtypes: tuple


def varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale, left):
    """The varlen contract in plain PyTorch, one SDPA per row: what a device's kernel is checked
    against, and what tests run on the CPU to exercise the batched path."""
    outs = []
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for r in range(len(cu_q) - 1):
        qi = q[cu_q[r]:cu_q[r + 1]].transpose(0, 1)[None]  # [1, H, n, d]
        ki, vi = (x[cu_k[r]:cu_k[r + 1]].transpose(0, 1)[None] for x in (k, v))  # [1, KVH, L, d]
        n, length = qi.shape[2], ki.shape[2]
        query_at = torch.arange(length - n, length, device=q.device)[:, None]  # bottom-right aligned
        key_at = torch.arange(length, device=q.device)[None, :]
        allowed = key_at <= query_at
        if left >= 0:
            allowed &= query_at - key_at <= left
        out = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=allowed[None, None], scale=scale,
                                             enable_gqa=qi.shape[1] != ki.shape[1])
        outs.append(out[0].transpose(0, 1))  # [n, H, d]
    return torch.cat(outs)


def _flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, left):
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(left, 0),
                       enable_gqa=q.shape[1] != k.shape[1])


#: The batched kernel per device type; a device without one runs the per-row loop (the CPU: its
#: per-row calls read each cache in place, where a batched kernel needs the rows' keys gathered).
#: torch's `varlen_attn` is FlashAttention: CUDA, half precision only.
VARLEN_KERNELS: dict[str, VarlenKernel] = {
    "cuda": VarlenKernel("flash-varlen", _flash_varlen, (torch.float16, torch.bfloat16)),
}
#: (kernel, dtype, heads, kv heads, head dim, window) -> whether the kernel matched the per-row path
#: on its first batch (checked once per shape; a kernel that fails or differs is not used again).
_checked: dict[tuple, bool] = {}
_lock = threading.Lock()


def _varlen(kernel: VarlenKernel, batch: FlatBatch, module, layer_idx: int, query, scaling) -> torch.Tensor | None:
    """The whole batch's attention in one kernel call: `[1, T, H, d]`, or None where the kernel
    is not (or no longer) trusted for this shape. The rows' keys/values are gathered into one packed
    tensor per layer (one copy); the first batch of each shape is also run row by row and compared."""
    starts = batch.query_start_loc
    live = [row for row in range(batch.num_rows) if starts[row + 1] > starts[row]]  # rows with new tokens
    layers = [batch.caches[row].layers[layer_idx] for row in live]
    window = layers[0].window
    _, num_heads, _, head_dim = query.shape
    key = (kernel.name, query.dtype, num_heads, layers[0].keys.shape[1], head_dim, window)
    if _checked.get(key) is False:
        return None
    lengths = tuple(layer.keys.shape[-2] for layer in layers)
    if ("cu", lengths) not in batch.masks:  # made once per forward (per window), not per layer
        batch.masks["cu", lengths] = (
            torch.tensor([starts[row] for row in live] + [starts[-1]], dtype=torch.int32, device=query.device),
            torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=query.device))
    cu_q, cu_k = batch.masks["cu", lengths]
    max_q = max(starts[row + 1] - starts[row] for row in live)
    keys = torch.cat([layer.keys[0].transpose(0, 1) for layer in layers])  # [S, KVH, d]
    values = torch.cat([layer.values[0].transpose(0, 1) for layer in layers])
    scale = scaling if scaling is not None else head_dim ** -0.5
    left = window - 1 if window is not None else -1
    q = query[0].transpose(0, 1)  # [T, H, d]
    try:
        out = kernel.fn(q, keys, values, cu_q, cu_k, max_q, max(lengths), scale, left)[None]  # [1, T, H, d]
    except Exception as e:  # noqa: BLE001 - an unsupported shape or build: the per-row path serves it
        logger.warning("attention kernel %s failed for %s (%s: %s); rows are attended one by one", kernel.name,
                       key, type(e).__name__, e)
        _checked[key] = False
        return None
    if key not in _checked:
        with _lock:
            rows = _per_row(batch, module, layer_idx, query, True, "sdpa", scaling, 0.0, window, None)
            tolerance = 1e-5 if query.dtype == torch.float32 else 2e-2
            _checked[key] = bool(torch.allclose(out.float(), rows.float(), atol=tolerance, rtol=tolerance))
            if not _checked[key]:
                logger.warning("attention kernel %s differs from the per-row path for %s (max difference %.3g); "
                               "rows are attended one by one", kernel.name, key, (out - rows).abs().max().item())
                return rows
    return out


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
