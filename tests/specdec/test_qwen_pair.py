"""The real default pair (Qwen2.5-Coder 1.5B target, 0.5B draft). Slow: pulls ~1.6 GB once and runs
a 1.5B model on the CPU. Run with `python -m pytest -m slow`; prints what it measured."""

import time

import pytest
import torch

from specdec import SamplingParams, SpeculativeEngine
from specdec.config import EngineConfig
from specdec.kernels.linear import stock_linears
from specdec.models.presets import DEFAULT_DRAFT, DEFAULT_TARGET

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that reverses a linked list.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def engines():
    started = time.perf_counter()
    spec = SpeculativeEngine.from_pretrained(DEFAULT_TARGET, draft=DEFAULT_DRAFT, num_speculative_tokens=4)
    print(f"\nload (pull if needed) of the pair: {time.perf_counter() - started:.1f}s")
    plain = SpeculativeEngine(EngineConfig(target=DEFAULT_TARGET, draft="none"), spec.target_model)
    return spec, plain


def test_default_pair_is_lossless_and_accepts_most_tokens(engines):
    spec, plain = engines
    for prompt in PROMPTS:
        ids = spec.tokenize(prompt, chat=True)
        with torch.no_grad(), stock_linears(spec.target_model.model):
            ref = spec.target_model.model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        reference = ref[0, len(ids):].tolist()
        fast = spec.generate(prompt_token_ids=ids, sampling=SamplingParams(max_tokens=MAX_TOKENS))
        slow = plain.generate(prompt_token_ids=ids, sampling=SamplingParams(max_tokens=MAX_TOKENS))
        assert fast.token_ids == reference[: len(fast.token_ids)]
        assert slow.token_ids == fast.token_ids
        s = fast.speculative
        print(f"\n{prompt[:50]!r}: target-only {slow.tokens_per_second:.2f} tok/s, speculative "
              f"{fast.tokens_per_second:.2f} tok/s, acceptance {s.acceptance_rate:.1%}, "
              f"{fast.completion_tokens / s.target_forwards:.2f} tokens/target forward")
        assert s.acceptance_rate > 0.4


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {
        "type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}


def test_tools_and_json_schema_on_the_real_pair(engines):
    """Qwen2.5's chat template renders the tools; with tool_choice required the call is constrained to
    the hermes format and parses (the 1.5B coder model, unconstrained, answers with a fenced JSON
    object instead of a `<tool_call>` block: printed, not asserted); a JSON schema gives valid JSON,
    equal to target-only constrained decoding (the lossless claim on the real pair)."""
    import json

    from deployments.protocol import ChatCompletionRequest
    from deployments.tool_calls import parse
    from specdec.engine.request import GenerationRequest
    from specdec.constraint import Constraint

    spec, _ = engines
    messages = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    auto = spec.generate(GenerationRequest(prompt=messages, chat=True, tools=[WEATHER_TOOL],
                                           sampling=SamplingParams(max_tokens=64)))
    print(f"\ntools auto: {auto.text!r}; acceptance {auto.speculative.acceptance_rate:.2f}")
    required = ChatCompletionRequest(messages=messages, tools=[WEATHER_TOOL], tool_choice="required")
    out = spec.generate(GenerationRequest(prompt=messages, chat=True, tools=[WEATHER_TOOL], sampling=SamplingParams(
        max_tokens=64, structured=required.constraint())))
    content, calls = parse(out.text)
    print(f"tools required: {out.text!r}; acceptance {out.speculative.acceptance_rate:.2f}")
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"])["city"] == "Paris"
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "year": {"type": "integer"}},
              "required": ["name", "year"], "additionalProperties": False}
    ask = [{"role": "user", "content": "Name a programming language and the year it appeared, as JSON."}]
    params = SamplingParams(max_tokens=48, structured=Constraint("json_schema", json.dumps(schema)))
    constrained = spec.generate(ask, chat=True, sampling=params)
    alone = spec.generate(ask, chat=True, sampling=params, num_speculative_tokens=0)
    print(f"json schema: {constrained.text!r}; acceptance {constrained.speculative.acceptance_rate:.2f}")
    assert constrained.token_ids == alone.token_ids
    assert set(json.loads(constrained.text)) == {"name", "year"}
