"""Linear-layer kernels: prepacked oneDNN weights compute the same float32 linear maps, the
stock path is exact, and the int8 draft copy leaves the loaded model untouched."""

import pytest
import torch

from specdec import SamplingParams, SpeculativeEngine
from specdec.kernels.draft_precision import prepare_draft
from specdec.kernels.linear import PackedLinear, pack_linears, stock_linears
from specdec.models.loading import load_model


@pytest.mark.parametrize("keep_weight,small_batch_mkl", [(True, True), (True, False), (False, False)],
                         ids=["hybrid", "onednn", "onednn-without-originals"])
def test_packed_linear_matches_f_linear(keep_weight, small_batch_mkl):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    packed = PackedLinear(linear, keep_weight=keep_weight, small_batch_mkl=small_batch_mkl)
    for rows in (1, 2, 3, 4, 5, 9, 17):
        x = torch.randn(1, rows, 64)
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)


def test_stock_mode_is_bit_exact():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8))
    x = torch.randn(7, 32)
    expected = model(x)
    assert pack_linears(model) == 2
    with stock_linears(model):
        assert torch.equal(model(x), expected)


@pytest.mark.parametrize("kernel", ["onednn", "torch"])
def test_greedy_equals_hf_with_every_kernel(tiny_qwen2, tiny_qwen2_draft, kernel):
    from transformers import AutoModelForCausalLM

    reference_model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    prompt = [4, 9, 16, 25]
    with torch.no_grad():
        reference = reference_model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)
    engine = SpeculativeEngine.from_pretrained(str(tiny_qwen2), draft=str(tiny_qwen2_draft), linear_kernel=kernel)
    assert engine.linear_kernel == kernel
    out = engine.generate(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=40))
    assert out.token_ids == reference[0, len(prompt):].tolist()


def test_int8_draft_is_a_copy(tiny_llama):
    loaded = load_model(str(tiny_llama))
    quantized = prepare_draft(loaded.model, "int8")
    assert type(loaded.model.model.layers[0].mlp.up_proj) is torch.nn.Linear
    assert type(quantized.model.layers[0].mlp.up_proj) is not torch.nn.Linear


def test_bad_kernel_options():
    from specdec import EngineConfig

    with pytest.raises(ValueError, match="linear_kernel must be one of"):
        EngineConfig(target="x", linear_kernel="fast")
    with pytest.raises(ValueError, match="draft_precision must be one of"):
        EngineConfig(target="x", draft_precision="int3")
    with pytest.raises(ValueError, match="target_precision must be one of"):
        EngineConfig(target="x", target_precision="int3")
