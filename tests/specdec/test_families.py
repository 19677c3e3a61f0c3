"""Every decoder family users deploy is decoded exactly, alone and batched.

For each family in `tests.tiny_models.FAMILIES` (sliding windows, local/global layers, soft-capping,
attention sinks, experts): greedy speculative output equals HF `generate()` of the target alone,
for K = 1, 4 and auto, with requests of different lengths joining and leaving a batch; and after
every step of flat batched forwards with rewinds, each row's logits and cached keys/values equal a
teacher-forced HF forward of its committed prefix. Prompts plus generations cross the tiny window
(8 tokens), and the rewind margin is shrunk so sliding layers also drop old keys mid-test.
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec import SamplingParams, SpeculativeEngine
from specdec.models.model_runner import ModelRunner
from specdec.models.loading import load_model
from specdec.engine.request import GenerationRequest
from tests.tiny_models import FAMILIES, TINY_WINDOW, hf_greedy_references, make_family_pair

PROMPTS = [list(range(5, 24)), [3, 4], [10, 20, 30, 10, 20, 30, 10, 20, 11], [40, 41, 42, 43, 44]]
MAX_TOKENS = [40, 25, 33, 12]  # requests leave the batch at different steps
#: Rewind margin of sliding layers in these tests: above any rewind here (auto K <= 8: 9 tokens), and
#: small enough that layers drop keys (past 2 * (window + margin) = 40 tokens).
ROLLBACK = 12


@pytest.fixture(autouse=True)
def small_rollback(monkeypatch):
    monkeypatch.setattr("specdec.models.kv_cache.ROLLBACK_TOKENS", ROLLBACK)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    name = request.param
    target, draft = make_family_pair(tmp_path_factory.mktemp(name), name)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    return name, target, draft, hf, hf_greedy_references(target, PROMPTS, MAX_TOKENS)


def test_greedy_equals_hf_generate_alone_and_batched(family):
    name, target, draft, _, references = family
    accepted = rejected = 0
    for k in (1, 4, "auto"):
        # A batch of 3 for 4 requests: one waits and joins when the shortest leaves.
        engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=k,
                                                   max_batch_size=3)
        outs = engine.generate_batch([GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(max_tokens=n))
                                      for p, n in zip(PROMPTS, MAX_TOKENS)])
        assert [o.token_ids for o in outs] == references, f"{name}, K={k}, batched"
        sizes = engine.scheduler.batch_sizes
        assert max(sizes) == 3 and min(sizes) < 3
        accepted += sum(o.speculative.num_accepted_tokens for o in outs)
        rejected += sum(o.speculative.num_draft_tokens - o.speculative.num_accepted_tokens for o in outs)
        alone = engine.generate(prompt_token_ids=PROMPTS[0], sampling=SamplingParams(max_tokens=MAX_TOKENS[0]))
        assert alone.token_ids == references[0], f"{name}, K={k}, alone"
        assert len(engine.target_pool) == len(engine.draft_pool) == 0
    assert accepted > 0 and rejected > 0  # the draft both agreed and disagreed: both paths ran


def _hf_recompute(hf, token_ids: list[int], num_logits: int):
    """Teacher-forced HF forward with a full (never cropped) cache: logits of the last positions and
    every layer's keys/values."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        out = hf(torch.tensor([token_ids]), cache=cache, use_cache=True)
    return out.logits[0, -num_logits:].float(), cache


def test_row_caches_and_logits_equal_hf_recompute_after_every_step(family):
    name, target, _, hf, _ = family
    runner = ModelRunner(load_model(str(target)))
    rng = random.Random(0)
    caches = [runner.new_cache() for _ in PROMPTS[:3]]
    committed = [list(p) for p in PROMPTS[:3]]
    feed = [list(p) for p in PROMPTS[:3]]
    dropped = False
    for step in range(30):
        # Rows append different counts (a prefill chunk, a verify block, one token, or sit out).
        logits = runner.forward(caches, feed, [len(f) if f else 0 for f in feed])
        for row, cache in enumerate(caches):
            sequence = committed[row] if step == 0 else committed[row] + feed[row]
            if not feed[row]:
                continue
            expected, _ = _hf_recompute(hf, sequence, len(feed[row]))
            torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"{name} row {row} step {step}: {m}")
            # Keep a random prefix of the new tokens (a verify that accepted some), as the engine does.
            keep = len(sequence) - rng.randint(0, min(3, len(feed[row]) - 1))
            cache.rewind(keep)
            committed[row] = sequence[:keep]
            _, reference = _hf_recompute(hf, committed[row], 1)
            for index, layer in enumerate(cache.layers):
                dropped |= layer.start > 0
                if layer.window is not None:
                    assert layer.length - layer.start <= 2 * (layer.window + ROLLBACK) + 8
                torch.testing.assert_close(layer.keys, reference.layers[index].keys[..., layer.start:layer.length, :],
                                           rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(layer.values,
                                           reference.layers[index].values[..., layer.start:layer.length, :],
                                           rtol=1e-4, atol=1e-4)
        feed = [[rng.randrange(1, 96) for _ in range(rng.choice([0, 1, 5, 6]))] for _ in caches]
        if not any(feed):
            feed[0] = [7]
    sliding = any(layer.window == TINY_WINDOW for c in caches for layer in c.layers)
    assert sliding == (name in {"qwen2-sliding", "mistral", "gemma2", "gemma3_text", "cohere2", "starcoder2",
                                "gpt_oss"})
    assert dropped == sliding  # sliding layers dropped keys no query can reach; full layers never do
