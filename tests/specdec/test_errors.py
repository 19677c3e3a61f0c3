"""Every bad input gets a ValueError naming the problem."""

import pytest

from specdec import EngineConfig, SamplingParams, SpeculativeEngine
from specdec.models.loading import ModelLoadError, load_model


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": [""]}, "stop"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("k", [0, -3, "many", 2.5])
def test_bad_k(k):
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1 or 'auto'"):
        EngineConfig(target="x", num_speculative_tokens=k)


def test_missing_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "model.gguf"))


def test_directory_without_model(tmp_path):
    with pytest.raises(ModelLoadError, match="not a model directory"):
        load_model(str(tmp_path))


def test_unreachable_hub_fails_fast(monkeypatch, tmp_path):
    # Port 9 on loopback refuses at once; an empty HF cache forces the download path.
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ModelLoadError, match="cannot be reached"):
        load_model("some-org/some-model")


def test_mismatched_tokenizers_are_refused(tiny_llama, tiny_other_vocab):
    with pytest.raises(ValueError, match="do not share a tokenizer.*96 vs 80"):
        SpeculativeEngine.from_pretrained(str(tiny_llama), draft=str(tiny_other_vocab))


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return SpeculativeEngine.from_pretrained(str(tiny_llama), draft="ngram")


def test_empty_prompt(engine):
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate("   ")
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate(prompt_token_ids=[])


def test_prompt_longer_than_context(engine):
    with pytest.raises(ValueError, match="longer than the model's context of 512"):
        engine.generate(prompt_token_ids=[1] * 600)


def test_prompt_plus_max_tokens_over_context(engine):
    with pytest.raises(ValueError, match="set max_tokens to at most 12"):
        engine.generate(prompt_token_ids=[1] * 500, sampling=SamplingParams(max_tokens=100))


def test_token_ids_outside_vocabulary(engine):
    with pytest.raises(ValueError, match=r"\[0, 96\)"):
        engine.generate(prompt_token_ids=[1, 2, 500])


def test_chat_without_template(engine):
    with pytest.raises(ValueError, match="no chat template"):
        engine.generate("w1 w2", chat=True)


def test_prompt_and_ids_together(engine):
    with pytest.raises(ValueError, match="exactly one"):
        engine.generate("w1", prompt_token_ids=[1])
