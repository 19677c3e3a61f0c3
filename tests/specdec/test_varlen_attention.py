"""The flat batch's one-call attention path (`flat_batch.VARLEN_KERNELS`, FlashAttention's varlen
contract: packed queries and keys, `cu_seqlens`, causal aligned to the bottom right, a left window).

On a GPU the kernel is torch's `varlen_attn`; no device here has one, so these tests register the
contract's plain-PyTorch reference (`varlen_reference`, masks derived from the bottom-right rule,
not from the per-row path's absolute positions) as the CPU's kernel. That runs everything around
the kernel: gathering the rows' keys per layer, rows without new tokens, sliding windows (the
layers drop old keys mid-test), the first-batch check against the per-row path. Greedy decoding of
each sdpa family, batched and alone, must then equal HF `generate()`. Negative controls: a kernel
that ignores causality is caught by the first-batch check (which falls back, so the output is still
right), and without that check it changes the output.
"""

from __future__ import annotations

import logging

import pytest
import torch

import specdec.models.flat_batch as flat_batch
from specdec import SamplingParams, SpeculativeEngine
from specdec.engine.request import GenerationRequest
from tests.tiny_models import hf_greedy_references, make_family_pair

PROMPTS = [list(range(5, 24)), [3, 4], [10, 20, 30, 10, 20, 30, 10, 20, 11], [40, 41, 42, 43, 44]]
MAX_TOKENS = [40, 25, 33, 12]
SDPA_FAMILIES = ["llama", "qwen2-sliding", "mistral", "starcoder2"]


@pytest.fixture(autouse=True)
def small_rollback(monkeypatch):
    monkeypatch.setattr("specdec.models.kv_cache.ROLLBACK_TOKENS", 12)  # sliding layers drop keys mid-test


def _register(monkeypatch, fn, name="reference") -> dict:
    """`fn` as the CPU's varlen kernel, counted; a fresh first-batch check."""
    calls = {"n": 0}

    def counted(*args):
        calls["n"] += 1
        return fn(*args)

    monkeypatch.setitem(flat_batch.VARLEN_KERNELS, "cpu", flat_batch.VarlenKernel(name, counted, (torch.float32,)))
    monkeypatch.setattr(flat_batch, "_checked", {})
    return calls


def _decode(target, draft) -> list[list[int]]:
    engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=4,
                                               max_batch_size=3, draft_precision="none")
    outs = engine.generate_batch([GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(max_tokens=n))
                                  for p, n in zip(PROMPTS, MAX_TOKENS)])
    alone = engine.generate(prompt_token_ids=PROMPTS[2], sampling=SamplingParams(max_tokens=MAX_TOKENS[2]))
    engine.shutdown()
    return [o.token_ids for o in outs] + [alone.token_ids]


@pytest.fixture(scope="module", params=SDPA_FAMILIES)
def family(request, tmp_path_factory):
    target, draft = make_family_pair(tmp_path_factory.mktemp(request.param), request.param)
    references = hf_greedy_references(target, PROMPTS, MAX_TOKENS)
    return request.param, target, draft, references + [references[2]]


def test_one_call_per_layer_for_the_batch_equals_hf_generate(family, monkeypatch):
    name, target, draft, references = family
    calls = _register(monkeypatch, flat_batch.varlen_reference)
    assert _decode(target, draft) == references, name
    assert calls["n"] > 50, calls  # the batched path served the forwards
    assert flat_batch._checked and all(flat_batch._checked.values()), flat_batch._checked


def _not_causal(q, k, v, cu_q, cu_k, max_q, max_k, scale, left):
    """A wrong kernel: each row's queries also see the keys after them."""
    out = []
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for r in range(len(cu_q) - 1):
        qi = q[cu_q[r]:cu_q[r + 1]].transpose(0, 1)[None]
        ki, vi = (x[cu_k[r]:cu_k[r + 1]].transpose(0, 1)[None] for x in (k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, scale=scale, enable_gqa=qi.shape[1] != ki.shape[1])
        out.append(o[0].transpose(0, 1))
    return torch.cat(out)


def test_negative_control_a_wrong_kernel_is_caught_by_the_first_batch_check(tmp_path, monkeypatch, caplog):
    target, draft = make_family_pair(tmp_path, "llama")
    references = hf_greedy_references(target, PROMPTS, MAX_TOKENS)
    references.append(references[2])
    _register(monkeypatch, _not_causal, "not-causal")
    with caplog.at_level(logging.WARNING, logger="specdec.models.flat_batch"):
        assert _decode(target, draft) == references  # the check fell back to the per-row path
    assert flat_batch._checked and not any(flat_batch._checked.values())
    assert "differs from the per-row path" in caplog.text
    # Without the check (every shape trusted from the start) the same kernel changes the output.
    _register(monkeypatch, _not_causal, "not-causal")
    monkeypatch.setattr(flat_batch, "_checked", _AlwaysTrusted())
    assert _decode(target, draft) != references


class _AlwaysTrusted(dict):
    """A `_checked` that says every shape was checked and matched."""

    def get(self, key, default=None):
        return True

    def __contains__(self, key):
        return True
