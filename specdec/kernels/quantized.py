"""4-bit linear layers and embeddings from a GGUF file's own codes (or rounded to nearest, group-wise).

Decoding on a CPU streams every weight once per token, so the bytes a weight takes are its speed. A
GGUF Q4_K (Qwen2.5 presets) or Q4_1 (SmolLM2) tensor stores, per group of 32 input columns of each
output row, 4-bit codes q in 0..15, a scale and a minimum: w = scale * q - minimum (`Int4Codes`;
Q4_K's scale is d * sc and its minimum dmin * m, both per 32-column sub-block of a 256 block). That
is exactly the weight layout of PyTorch's CPU int4 kernel (`aten._weight_int4pack_mm_for_cpu`, the
kernel torchao's and gpt-fast's int4 CPU paths call), which computes w = (q - 8) * s + z per group
of 32 with bfloat16 s and z: s = scale, z = 8 * scale - minimum. So `Int4Linear` runs the file's own
codes, unchanged; the only difference from the file's dequantized weights is the bfloat16 rounding
of s and z (relative 2^-9 of a group's scale; `tests/specdec/test_quantized.py` measures it).
Activations go in as bfloat16 and the outputs come back in the model's dtype.

The kernel works in blocks of rows, and a row's result does not depend on the other rows of the call
(checked bit for bit in the tests, with a negative control): a verify pass of K + 1 tokens computes
what K + 1 one-token passes would, so speculation stays exactly equal to the same target decoding
one token at a time. Unlike oneDNN's float32 kernel, a 5-row call is not nearly free: the cost
model learns the verify curve from what it measures (`speculation_length.CostModel`).

`Int4Embedding` keeps a Q4 embedding table as codes and dequantizes the looked-up rows in float32
with the file's own formula (bit-equal to the file's dequantization). Weights without 4-bit codes
(GGUF Q6_K, Q8_0, float tensors) take int8 weight-only (`linear.Int8WeightLinear`, per output
channel) or stay as they are: `target_precision.py` decides, and says which.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Input columns per group of codes (Q4_1's block, Q4_K's sub-block; a group size the kernel takes).
GROUP_SIZE = 32


def int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


@dataclass
class Int4Codes:
    """The 4-bit codes of one `[out_features, in_features]` weight, in groups of `GROUP_SIZE` input
    columns: w = scale * q - minimum."""

    q: torch.Tensor  # [N, K] uint8, 0..15
    scale: torch.Tensor  # [N, K // GROUP_SIZE] float32
    minimum: torch.Tensor  # [N, K // GROUP_SIZE] float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """`[N, K]` float32: the weight the codes stand for (as the file's own dequantization computes it)."""
        n, k = self.q.shape
        q = self.q.reshape(n, k // GROUP_SIZE, GROUP_SIZE).float()
        return (self.scale[..., None] * q - self.minimum[..., None]).reshape(n, k)

    def rows(self, index: torch.Tensor) -> "Int4Codes":
        """These codes with their rows reordered (a GGUF file's Q/K row permutation undone)."""
        return Int4Codes(self.q[index], self.scale[index], self.minimum[index])

    @classmethod
    def round_to_nearest(cls, weight: torch.Tensor) -> "Int4Codes":
        """Codes for a float weight, rounded to nearest in each group between its minimum and maximum
        (Q4_1's rule, gpt-fast's int4), for models that come without 4-bit codes."""
        n, k = weight.shape
        if k % GROUP_SIZE:
            raise ValueError(f"int4 needs in_features divisible by {GROUP_SIZE}, got {k}")
        groups = weight.detach().float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = ((high - low) / 15).clamp(min=1e-12)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
        return cls(q.reshape(n, k), scale, -low)


class Int4Linear(torch.nn.Module):
    """An `nn.Linear` whose weight is 4-bit codes in groups of `GROUP_SIZE` (the module docstring)."""

    def __init__(self, codes: Int4Codes, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        n, k = codes.shape
        if k % GROUP_SIZE:
            raise ValueError(f"int4 needs in_features divisible by {GROUP_SIZE}, got {k}")
        self.in_features, self.out_features = k, n
        pad = -n % 16  # the kernel packs rows in blocks of 16: zero rows, their outputs sliced off
        q, scale, zero = codes.q, codes.scale, 8 * codes.scale - codes.minimum  # zero: [N, K // G]
        if pad:
            q, scale, zero = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (q, scale, zero))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)
        scale_and_zero = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        self.register_buffer("packed_weight", packed)  # [N, K // 2] uint8
        self.register_buffer("scale_and_zero", scale_and_zero)  # [K // G, N, 2] bfloat16
        self.register_buffer("bias", bias.detach().float().clone() if bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [num_tokens, in_features]
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed_weight, GROUP_SIZE, self.scale_and_zero)
        out = out[:, :self.out_features].to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {GROUP_SIZE}"


class Int4Embedding(torch.nn.Module):
    """An `nn.Embedding` held as 4-bit codes: the looked-up rows are dequantized with the file's own
    formula, in float32 (or the model's dtype)."""

    def __init__(self, codes: Int4Codes, dtype: torch.dtype = torch.float32, padding_idx: int | None = None) -> None:
        super().__init__()
        n, k = codes.shape
        self.num_embeddings, self.embedding_dim, self.dtype, self.padding_idx = n, k, dtype, padding_idx
        low, high = codes.q[:, 0::2], codes.q[:, 1::2]
        self.register_buffer("packed", (low | (high << 4)).contiguous())  # [V, D // 2] uint8
        self.register_buffer("scale", codes.scale.clone())  # [V, D // G] float32 (not a view of a file map)
        self.register_buffer("minimum", codes.minimum.clone())  # [V, D // G] float32

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        packed = self.packed[ids]  # [..., D // 2]
        q = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*ids.shape, -1, GROUP_SIZE).float()
        rows = self.scale[ids][..., None] * q - self.minimum[ids][..., None]  # [..., D // G, G]
        return rows.reshape(*ids.shape, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int4 group {GROUP_SIZE}"


#: Sibling projections that read the same input, fused into one int4 call when all are int4.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class Int4Group(torch.nn.Module):
    """Several `Int4Linear`s that multiply the same input, as one kernel call: their packed rows and
    scales concatenated along the output dimension (the kernel's packing is per row, so every output
    column is bit-identical to its own module's). `Int4Part`s stand in for the originals: the first
    one called computes every part and the others take theirs, as long as they are handed the same
    input tensor (HF's attention and MLP pass one tensor to q/k/v and to gate/up); otherwise a part
    computes the group again."""

    def __init__(self, linears: list[Int4Linear]) -> None:
        super().__init__()
        self.in_features = linears[0].in_features
        self.register_buffer("packed_weight", torch.cat([m.packed_weight for m in linears]))
        self.register_buffer("scale_and_zero", torch.cat([m.scale_and_zero for m in linears], dim=1))
        has_bias = [m.bias is not None for m in linears]
        self.register_buffer("bias", torch.cat([m.bias if m.bias is not None else
                                                torch.zeros(m.out_features) for m in linears])
                             if any(has_bias) else None)
        starts, offset = [], 0  # where each part's columns start (the packed rows include padding)
        for m in linears:
            starts.append(offset)
            offset += m.packed_weight.shape[0]
        self.slices = [(s, s + m.out_features) for s, m in zip(starts, linears)]
        self.bias_slices, offset = [], 0
        for m in linears:
            self.bias_slices.append((offset, offset + m.out_features))
            offset += m.out_features
        self._cached: tuple | None = None  # (input, its outputs, the parts handed out)

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Part `index` of the group's output for `x`: computed with the others on the first call,
        handed out once each (a part asked again, or for another input, computes the group again, so
        nothing stale is ever returned)."""
        cached = self._cached
        if cached is None or cached[0] is not x or index in cached[2]:
            cached = self._cached = (x, self._outputs(x), set())
        cached[2].add(index)
        if len(cached[2]) == len(self.slices):
            self._cached = None  # every part served: hold nothing between forwards
        return cached[1][index]

    def _outputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed_weight, GROUP_SIZE, self.scale_and_zero)
        parts = []
        for (start, end), (b0, b1) in zip(self.slices, self.bias_slices):
            part = out[:, start:end].to(x.dtype)
            if self.bias is not None:
                part = part + self.bias[b0:b1].to(x.dtype)
            parts.append(part.reshape(*x.shape[:-1], end - start))
        return parts


class Int4Part(torch.nn.Module):
    """One member of an `Int4Group`, in its original module's place."""

    def __init__(self, group: Int4Group, index: int) -> None:
        super().__init__()
        object.__setattr__(self, "group", group)  # not a submodule: the group's buffers are counted once
        self.index = index
        self.in_features = group.in_features
        start, end = group.slices[index]
        self.out_features = end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.index)

    def extra_repr(self) -> str:
        return f"part {self.index} of a fused int4 group, out_features={self.out_features}"


def fuse_siblings(model: torch.nn.Module) -> int:
    """Fuse each set of `SIBLINGS` that are all `Int4Linear` over the same input width; how many."""
    fused = 0
    for parent in list(model.modules()):
        for names in SIBLINGS:
            members = [getattr(parent, n, None) for n in names]
            if all(isinstance(m, Int4Linear) for m in members) and len({m.in_features for m in members}) == 1:
                group = Int4Group(members)
                parent.add_module(f"int4_{names[0]}_group", group)  # owns the buffers (state, memory accounting)
                for index, name in enumerate(names):
                    setattr(parent, name, Int4Part(group, index))
                fused += 1
    return fused
