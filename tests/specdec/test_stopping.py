"""Stopping: max_tokens, EOS and stop strings, token by token even inside a multi-token step."""

import pytest

from specdec import SamplingParams, SpeculativeEngine

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def engine(tiny_llama, tiny_llama_draft):
    return SpeculativeEngine.from_pretrained(str(tiny_llama), draft=str(tiny_llama_draft), num_speculative_tokens=8)


@pytest.fixture(scope="module")
def free_run(engine):
    return engine.generate(prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=60, ignore_eos=True))


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 13])
def test_max_tokens_is_exact(engine, free_run, max_tokens):
    out = engine.generate(prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    assert out.finish_reason == "length"
    assert out.token_ids == free_run.token_ids[:max_tokens]
    assert out.completion_tokens == max_tokens


def test_eos_stops_and_is_the_last_token(engine, free_run, monkeypatch):
    eos = free_run.token_ids[10]
    first = free_run.token_ids.index(eos)
    monkeypatch.setattr(engine.target_model.model.generation_config, "eos_token_id", eos)
    out = engine.generate(prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=60))
    assert out.finish_reason == "stop"
    assert out.token_ids == free_run.token_ids[: first + 1]
    ignored = engine.generate(prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=60, ignore_eos=True))
    assert ignored.token_ids == free_run.token_ids


def test_stop_string_truncates_text_and_tokens(engine, free_run):
    words = free_run.text.split()
    stop = words[12]
    cut = free_run.text.index(stop)
    chunks = list(engine.generate_stream(prompt_token_ids=PROMPT,
                                         sampling=SamplingParams(max_tokens=60, stop=[stop], ignore_eos=True)))
    out = chunks[-1].output
    assert out.finish_reason == "stop"
    assert out.text == free_run.text[:cut]
    assert stop not in out.text
    # Tokens end with the one that completed the stop string.
    assert out.token_ids == free_run.token_ids[: len(out.token_ids)]
    assert engine.tokenizer.decode(out.token_ids).endswith(stop)
    # What streamed is exactly the final text: the stop string never reached the client.
    assert "".join(c.text for c in chunks) == out.text
    assert all(stop not in c.text for c in chunks)


def test_stop_string_spanning_tokens(engine, free_run):
    words = free_run.text.split()
    stop = f"{words[5]} {words[6]}"
    out = engine.generate(prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=60, stop=[stop], ignore_eos=True))
    assert out.text == free_run.text[: free_run.text.index(stop)]


def test_stream_chunks_add_up_to_output(engine):
    chunks = list(engine.generate_stream(prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=30)))
    out = chunks[-1].output
    assert [t for c in chunks for t in c.token_ids] == out.token_ids
    assert "".join(c.text for c in chunks) == out.text
    assert all(c.output is None for c in chunks[:-1])
