"""The 4-bit codes of a GGUF file's tensors, by the Hugging Face parameter names they load into.

transformers' GGUF loader dequantizes every tensor to float (`modeling_gguf_pytorch_utils`); the
int4 target keeps the codes instead (`specdec.kernels.quantized`). This module reads them from the
file (llama.cpp's `gguf` reader, memory-mapped) for the tensor types whose layout the int4 kernel
takes as it is:
- Q4_K: 256-value blocks of 8 sub-blocks of 32, w = (d * sc) * q - (dmin * m) (6-bit sc and m,
  unpacked with the `gguf` package's own `Q4_K.get_scale_min`);
- Q4_1: 32-value blocks, w = d * q + m.
Names and row order follow transformers' own mapping: `get_gguf_hf_weights_map` for the names, and
the architecture's tensor processor for the rows (llama.cpp permutes the rows of Llama's Q and K
projections for its RoPE layout; the processor's inverse permutation is applied to the row indices,
so the codes move with their rows, exactly). A processor that does anything but reorder rows leaves
that tensor without codes. Tensors of other types (Q6_K, Q8_0, float) are not returned: the caller
takes the float weights transformers loaded for them (the file's own dequantization).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from specdec.kernels.quantized import GROUP_SIZE, Int4Codes

logger = logging.getLogger(__name__)

#: GGML types read as codes, and the bytes of one block of each.
_Q4_1_BYTES, _Q4_K_BYTES = 20, 144


def _q4_1(blocks: np.ndarray):
    """[n, 20] Q4_1 blocks -> q [n, 32], scale [n, 1], minimum [n, 1]."""
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # elements 0..15 in the low nibbles, 16..31 high
    return q, d, -m


def _q4_k(blocks: np.ndarray):
    """[n, 144] Q4_K blocks -> q [n, 256], scale [n, 8], minimum [n, 8]."""
    from gguf.quants import Q4_K

    n = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    qs = blocks[:, 16:].reshape(n, 4, 32)  # each 32 bytes: sub-block 2j in the low nibbles, 2j + 1 high
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 256)
    return q, d * sc.astype(np.float32), dmin * m.astype(np.float32)


_READERS = {"Q4_1": (_q4_1, _Q4_1_BYTES), "Q4_K": (_q4_k, _Q4_K_BYTES)}


def tensor_codes(data: np.ndarray, type_name: str, rows: int, columns: int) -> Int4Codes:
    """The codes of one quantized tensor (`data`: GGUF's `[rows, bytes per row]` uint8)."""
    unpack, block_bytes = _READERS[type_name]
    q, scale, minimum = unpack(np.ascontiguousarray(data).reshape(-1, block_bytes))
    return Int4Codes(torch.from_numpy(q.reshape(rows, columns).astype(np.uint8)),
                     torch.from_numpy(np.ascontiguousarray(scale.reshape(rows, columns // GROUP_SIZE))),
                     torch.from_numpy(np.ascontiguousarray(minimum.reshape(rows, columns // GROUP_SIZE))))


def read_codes(gguf_path: str | Path, model: torch.nn.Module) -> Iterator[tuple[str, Int4Codes]]:
    """(parameter name, e.g. `model.layers.0.mlp.down_proj.weight`, its codes) for every Q4_1 and
    Q4_K weight of the file that `model` (loaded from the same file) has, one tensor at a time."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    reader = GGUFReader(str(gguf_path))
    architecture = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config={
        "num_attention_heads": getattr(text, "num_attention_heads", None),
        "num_key_value_heads": getattr(text, "num_key_value_heads", None)})
    names = get_gguf_hf_weights_map(model, processor)
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in _READERS or tensor.name not in names or len(tensor.shape) != 2:
            continue
        columns, rows = (int(n) for n in tensor.shape)  # GGUF lists the fastest-moving dimension first
        codes = tensor_codes(tensor.data, kind, rows, columns)
        order = np.asarray(processor.process(weights=np.arange(rows, dtype=np.int64)[:, None], name=tensor.name,
                                             tensor_key_mapping=names, parsed_parameters={}).weights).reshape(-1)
        if sorted(order.tolist()) != list(range(rows)):
            logger.info("%s: transformers transforms it beyond a row order; not read as codes", tensor.name)
            continue
        if not np.array_equal(order, np.arange(rows)):
            codes = codes.rows(torch.from_numpy(order))
        yield names[tensor.name], codes


#: The file beside a converted model that keeps its GGUF's 4-bit codes (`save_codes`).
CODES_FILE = "int4-codes.safetensors"


def save_codes(codes: Iterable[tuple[str, Int4Codes]], path: Path) -> int:
    """Write the codes (q two to a byte, scale and minimum in float32) as safetensors; how many weights."""
    from safetensors.torch import save_file

    tensors = {}
    for name, c in codes:
        tensors[f"{name}.q4"] = (c.q[:, 0::2] | (c.q[:, 1::2] << 4)).contiguous()
        tensors[f"{name}.scale"] = c.scale.contiguous()
        tensors[f"{name}.minimum"] = c.minimum.contiguous()
    save_file(tensors, str(path), metadata={"format": "specdec-int4-codes", "group_size": str(GROUP_SIZE)})
    return len(tensors) // 3


def load_codes(path: Path) -> Iterator[tuple[str, Int4Codes]]:
    """The codes `save_codes` wrote, one weight at a time (memory-mapped; each unpacked as it comes)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        if (f.metadata() or {}).get("group_size") != str(GROUP_SIZE):
            raise ValueError(f"{path} holds codes of another group size; pull the model again")
        for key in f.keys():
            if key.endswith(".q4"):
                name = key.removesuffix(".q4")
                packed = f.get_tensor(key)
                q = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
                yield name, Int4Codes(q, f.get_tensor(f"{name}.scale"), f.get_tensor(f"{name}.minimum"))
