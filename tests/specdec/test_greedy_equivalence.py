"""Greedy speculative output equals Hugging Face `generate()` (the reference we did not write)
token for token, for every proposer and K, on tiny random Llama and Qwen2 models loaded from disk."""

import pytest
import torch

from specdec import SamplingParams, SpeculativeEngine
from specdec.kernels.linear import KERNEL_CANDIDATES

PROMPTS = [[5, 6, 7, 8, 9], [3], [10, 20, 30, 10, 20, 30, 10, 20]]
MAX_TOKENS = 48


def hf_greedy(model, prompt, max_new_tokens):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def models(arch, request):
    target = request.getfixturevalue(f"tiny_{arch}")
    draft = request.getfixturevalue(f"tiny_{arch}_draft")
    return target, draft


@pytest.fixture(scope="module")
def references(models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32).eval()
    return [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("draft_kind", ["model", "ngram", "none", "self"])
def test_greedy_equals_hf_generate(models, references, draft_kind, k):
    target, draft = models
    draft_spec = {"model": str(draft), "self": str(target)}.get(draft_kind, draft_kind)
    # The self-draft stays full precision (then every proposal must be accepted); the model draft
    # is int8-quantized (the CPU default), which changes proposals, never the output.
    engine = SpeculativeEngine.from_pretrained(str(target), draft=draft_spec, num_speculative_tokens=k,
                                               draft_precision="none" if draft_kind == "self" else "auto")
    # On the CPU in float32 the target's kernel is measured (kernels.settle_linear_kernel): any of them is exact.
    assert engine.linear_kernel in KERNEL_CANDIDATES
    assert engine.calibration["linear_kernel"]["choice"] == engine.linear_kernel
    total_proposed = 0
    for prompt, expected in zip(PROMPTS, references):
        out = engine.generate(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=MAX_TOKENS))
        assert out.token_ids == expected
        total_proposed += out.speculative.num_draft_tokens
        if draft_kind == "self":
            assert out.speculative.acceptance_rate == 1.0
        if draft_kind == "none":
            assert out.speculative.target_forwards == len(out.token_ids)
    if draft_kind in ("model", "self"):
        assert total_proposed > 0


def test_greedy_auto_k_equals_hf_generate(models, references):
    target, draft = models
    engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens="auto")
    for prompt, expected in zip(PROMPTS, references):
        out = engine.generate(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=MAX_TOKENS))
        assert out.token_ids == expected


def test_draft_model_accepts_some_and_rejects_some(models):
    """The perturbed draft is a meaningful test partner: both paths of verification run."""
    target, draft = models
    engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=4)
    out = engine.generate(prompt_token_ids=PROMPTS[0], sampling=SamplingParams(max_tokens=MAX_TOKENS))
    assert 0.1 < out.speculative.acceptance_rate < 0.95
