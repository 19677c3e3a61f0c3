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
    return SpeculativeEngine.from_pretrained(str(smollm2_dir), draft="ngram", num_speculative_tokens=4)


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
                          draft_precision="none")
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
