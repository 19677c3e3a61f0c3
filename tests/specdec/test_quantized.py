"""The int4 target and draft (`specdec/kernels/quantized.py`, `target_precision.py`, `gguf_codes.py`):
the file's own codes, rows that do not depend on their batch-mates, and speculation exactly equal
to the same int4 target decoding alone, against references we did not write (transformers' GGUF
dequantization, HF `generate()` with the same int4 modules swapped in)."""

from __future__ import annotations

import pytest
import torch

from specdec import EngineConfig, SamplingParams, SpeculativeEngine
from specdec.engine.request import GenerationRequest
from specdec.kernels.quantized import GROUP_SIZE, Int4Codes, Int4Linear, int4_available
from specdec.kernels.target_precision import apply_precision
from tests.tiny_gguf import make_tiny_gguf
from tests.tiny_models import make_family_pair

pytestmark = pytest.mark.skipif(not int4_available(), reason="this torch build has no CPU int4 kernel")

PROMPTS = [list(range(5, 24)), [3, 4], [10, 20, 30, 10, 20, 30, 10, 20, 11], [40, 41, 42, 43, 44]]
MAX_TOKENS = [40, 25, 33, 12]


def _kernel_weight(codes: Int4Codes) -> torch.Tensor:
    """`[N, K]` float32: what the int4 kernel multiplies by, (q - 8) * s + z with bfloat16 s and z."""
    s = codes.scale.to(torch.bfloat16).float()
    z = (8 * codes.scale - codes.minimum).to(torch.bfloat16).float()
    n, k = codes.shape
    q = codes.q.reshape(n, k // GROUP_SIZE, GROUP_SIZE).float()
    return ((q - 8) * s[..., None] + z[..., None]).reshape(n, k)


@pytest.fixture(scope="module")
def tiny_gguf_model(tmp_path_factory):
    """A tiny Llama GGUF (Q4_1, Llama's permuted Q/K rows), loaded by transformers (dequantized)."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return path, model


def test_gguf_codes_dequantize_to_transformers_own_gguf_weights(tiny_gguf_model):
    from specdec.models.gguf_codes import read_codes

    path, model = tiny_gguf_model
    state = model.state_dict()
    codes = dict(read_codes(path, model))
    assert len(codes) == 2 * 7 + 2  # every Q4_1 matrix of the file: 7 per layer, the embedding, the head
    for name, c in codes.items():
        assert torch.equal(c.dequantize(), state[name]), name  # bit for bit, Q/K rows permuted back
    # Negative control: without undoing llama.cpp's Q row permutation, the codes are other weights.
    q_name = "model.layers.0.self_attn.q_proj.weight"
    from specdec.models.gguf_codes import tensor_codes
    from gguf import GGUFReader

    raw = next(t for t in GGUFReader(str(path)).tensors if t.name == "blk.0.attn_q.weight")
    unpermuted = tensor_codes(raw.data, raw.tensor_type.name, *reversed([int(n) for n in raw.shape]))
    assert not torch.equal(unpermuted.dequantize(), state[q_name])


def test_int4_linear_runs_the_codes_within_the_bfloat16_rounding_of_scale_and_zero(tiny_gguf_model):
    from specdec.models.gguf_codes import read_codes

    path, model = tiny_gguf_model
    for name, c in read_codes(path, model):
        file_weight, kernel = c.dequantize(), _kernel_weight(c)
        s, z = c.scale, 8 * c.scale - c.minimum
        bound = ((c.q.float() - 8).abs().reshape(*c.scale.shape, GROUP_SIZE)
                 * (s - s.to(torch.bfloat16).float()).abs()[..., None]
                 + (z - z.to(torch.bfloat16).float()).abs()[..., None]).reshape(c.shape)
        assert ((kernel - file_weight).abs() <= bound + 1e-6).all(), name
        linear = Int4Linear(c)
        x = torch.randn(5, c.shape[1]).to(torch.bfloat16)
        expected = x.float() @ kernel.t()
        torch.testing.assert_close(linear(x.float()), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


def rows_independent(module: torch.nn.Module, x: torch.Tensor) -> bool:
    """Is each row of `module(x)` bit-identical to the module run on that row alone, for every
    number of rows up to len(x)?"""
    with torch.no_grad():
        alone = torch.cat([module(x[i:i + 1]) for i in range(len(x))])
        return all(torch.equal(module(x[:n]), alone[:n]) for n in range(1, len(x) + 1))


def test_each_int4_row_is_the_same_whatever_the_number_of_rows():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 320)
    x = torch.randn(9, 256)
    assert rows_independent(Int4Linear(Int4Codes.round_to_nearest(linear.weight), linear.bias), x)
    # Negative control: dynamic int8 quantizes a call's activations with one scale for all its rows.
    dynamic = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(linear), {torch.nn.Linear},
                                                     dtype=torch.qint8)
    assert not rows_independent(dynamic, x * torch.linspace(0.1, 10, 9)[:, None])


@pytest.fixture(scope="module")
def int4_family(tmp_path_factory):
    """A tiny Qwen2 target and draft, and the references: HF `generate()` of the target with the same
    int4 modules the engine uses swapped in (rounded to nearest: a float checkpoint)."""
    from transformers import AutoModelForCausalLM

    target, draft = make_family_pair(tmp_path_factory.mktemp("int4"), "qwen2")
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    applied = apply_precision(hf, "int4", {})
    assert applied.forms == {"int4 (rounded to nearest)": 2 * 7 + 1}
    with torch.no_grad():
        references = [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
                      for p, n in zip(PROMPTS, MAX_TOKENS)]
    float_references = None
    return target, draft, references, float_references


def test_int4_speculation_equals_the_int4_target_alone_and_hf_generate(int4_family):
    target, draft, references, _ = int4_family
    plain = SpeculativeEngine.from_pretrained(str(target), draft="none", target_precision="int4")
    alone = [plain.generate(prompt_token_ids=p, sampling=SamplingParams(max_tokens=n)).token_ids
             for p, n in zip(PROMPTS, MAX_TOKENS)]
    assert alone == references  # our target-only path = HF generate with the same modules
    accepted = rejected = 0
    for k in (1, 4, "auto"):
        engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=k,
                                                   target_precision="int4", max_batch_size=3)
        assert engine.target_precision == "int4"
        outs = engine.generate_batch([GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(max_tokens=n))
                                      for p, n in zip(PROMPTS, MAX_TOKENS)])
        assert [o.token_ids for o in outs] == references, f"K={k}, batched"
        solo = engine.generate(prompt_token_ids=PROMPTS[0], sampling=SamplingParams(max_tokens=MAX_TOKENS[0]))
        assert solo.token_ids == references[0], f"K={k}, alone"
        accepted += sum(o.speculative.num_accepted_tokens for o in outs)
        rejected += sum(o.speculative.num_draft_tokens - o.speculative.num_accepted_tokens for o in outs)
    assert accepted > 0 and rejected > 0


def test_int4_is_a_different_model_than_float32(int4_family):
    """The control for the test above: the int4 references are not the float32 target's text (the
    comparison would pass on a target that silently stayed float32)."""
    from tests.tiny_models import hf_greedy_references

    target, _, references, _ = int4_family
    assert hf_greedy_references(target, PROMPTS, MAX_TOKENS) != references
    engine = SpeculativeEngine.from_pretrained(str(target), draft="none", target_precision="float32")
    assert [engine.generate(prompt_token_ids=p, sampling=SamplingParams(max_tokens=n)).token_ids
            for p, n in zip(PROMPTS, MAX_TOKENS)] != references


def test_a_float_checkpoint_stays_float32_under_auto(int4_family):
    target, _, _, _ = int4_family
    engine = SpeculativeEngine.from_config(EngineConfig(target=str(target), draft="none"))
    assert engine.target_precision == "float32"
    assert engine.calibration["target_precision"]["choice"] == "float32"


def test_int4_and_tensor_parallelism_are_refused_by_name():
    from actors.config import RayEngineConfig
    from specdec.kernels.target_precision import check_precision
    from specdec.options import ConfigError

    with pytest.raises(ValueError, match="int4 does not shard across tensor-parallel ranks"):
        check_precision("int4", tensor_parallel=True, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="target_precision int4 does not shard") as e:  # before any actor starts
        RayEngineConfig(engine=EngineConfig(target="x", target_precision="int4"), tp=2)
    assert e.value.field == "target_precision"
    RayEngineConfig(engine=EngineConfig(target="x", target_precision="auto"), tp=2)  # auto: float32 under tp


def test_auto_measures_int4_against_float32_for_a_coded_model_and_names_the_choice(tiny_gguf_model, tmp_path,
                                                                                     monkeypatch, trust_any_machine):
    """A .gguf target has 4-bit codes: `auto` times one layer's linears in both forms, caches the
    decision, and the engine says what it chose and what each weight became."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    path, _ = tiny_gguf_model
    engine = SpeculativeEngine.from_pretrained(str(path), draft="none")
    summary = engine.calibration["target_precision"]
    assert engine.target_precision == summary["choice"] in ("int4", "float32")
    assert summary["predicted"]["verify_ratio"] > 0 and summary["cached"]  # measured, and cached
    again = SpeculativeEngine.from_pretrained(str(path), draft="none")  # read from the cache
    assert again.target_precision == engine.target_precision
    if engine.target_precision == "int4":  # every matrix of the file is Q4_1: all of them from its codes
        assert summary["weights"] == {"int4 (the file's Q4 codes)": 15, "embedding int4 (the file's Q4 codes)": 1}
