"""Structured output and tools over HTTP: a real Ray Serve app (a tiny target and a separate draft
actor over SmolLM2's byte-level tokenizer, Qwen2.5's chat template), driven by the official `openai`
client and httpx. The separate draft worker builds its own grammar matchers (its own process).

- `response_format` json_schema / json_object and the `structured_outputs` extension give what the
  in-process engine gives with the same constraint (greedy: the same text), on both endpoints,
  streamed and not; a schema that does not compile is a 400 naming `response_format`.
- `tool_choice` required / named give `tool_calls` whose names and arguments match the tools'
  schemas, streamed as tool-call deltas that add up to the same calls; `auto` parses the model's
  own `<tool_call>` blocks; history with assistant tool calls and tool results is accepted.
- `min_tokens` and `stop_token_ids` work; what stays unsupported is refused by name.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from specdec import SamplingParams, SpeculativeEngine
from specdec.engine.request import GenerationRequest
from specdec.constraint import Constraint
from tests.deployments.processes import free_port, serve_yaml_app

MODEL = "tiny-bpe"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def service(ray_session, tiny_bpe_pair):
    from ray import serve

    target, draft = tiny_bpe_pair
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    build_app, args = serve_yaml_app()
    small = {"num_cpus": 0.1}
    args.update(target=str(target), draft=str(draft), num_threads=1, target_role=small, draft_role=small,
                draft_placement="separate", served_model_name=MODEL, draft_precision="none", num_speculative_tokens=4,
                generation_config="none")
    serve.run(build_app(args), name="structured", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    yield base, openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    serve.shutdown()


@pytest.fixture(scope="module")
def local(tiny_bpe_pair):
    target, draft = tiny_bpe_pair
    return SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=4,
                                             draft_precision="none")


def _local_chat(local, constraint, tools=None, **sampling):
    request = GenerationRequest(prompt=MESSAGES, chat=True, tools=tools,
                                sampling=SamplingParams(structured=constraint, **sampling))
    return local.generate(request)


# ------------------------------------------------------------------------------ structured output

def test_json_schema_equals_the_in_process_engine(service, local):
    _, client = service
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}})
    expected = _local_chat(local, Constraint("json_schema", json.dumps(SCHEMA)), max_tokens=40)
    assert out.choices[0].message.content == expected.text
    assert out.model_extra["speculative"]["num_draft_tokens"] > 0
    if out.choices[0].finish_reason == "stop":
        value = json.loads(out.choices[0].message.content)
        assert set(value) == {"city", "days"} and 1 <= value["days"] <= 9


def test_json_object_streamed_equals_not_streamed(service):
    _, client = service
    body = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=30, response_format={"type": "json_object"})
    whole = client.chat.completions.create(**body).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **body)
             if c.choices]
    assert "".join(parts) == whole and whole.startswith("{")


@pytest.mark.parametrize("extension, check", [
    ({"regex": "(yes|no), [0-9]{3}"}, lambda t: t[:3] in ("yes", "no,") and t[-3:].isdigit()),
    ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"grammar": 'start: "x=" NUM\nNUM: /[0-9]{1,3}/'}, lambda t: t.startswith("x=") and t[2:].isdigit()),
    ({"json": SCHEMA}, lambda t: set(json.loads(t)) == {"city", "days"}),
])
def test_structured_outputs_extension_on_completions(service, extension, check):
    _, client = service
    out = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=60, temperature=0.8, seed=5,
                                    extra_body={"structured_outputs": extension})
    assert out.choices[0].finish_reason == "stop", out.choices[0].text
    assert check(out.choices[0].text), out.choices[0].text


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format", "objekt"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
    ({"structured_outputs": {"regex": "(open"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens", "exceeds"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
])
def test_bad_structured_requests_are_400_naming_the_parameter(service, body, param, words):
    base, _ = service
    r = httpx.post(f"{base}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_min_tokens_and_stop_token_ids(service, local):
    _, client = service
    choice = {"structured_outputs": {"choice": ["ok"]}}
    short = client.completions.create(model=MODEL, prompt="Say ok:", max_tokens=20, temperature=0, extra_body=choice)
    assert short.choices[0].text == "ok" and short.usage.completion_tokens == 2  # "ok" then EOS
    ids = local.tokenize("Hello there")
    free = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    tokens = local.tokenize(free.choices[0].text)
    stop_id = local.generate(prompt_token_ids=ids, sampling=SamplingParams(max_tokens=12, ignore_eos=True)).token_ids[4]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                    extra_body={"stop_token_ids": [stop_id], "ignore_eos": True})
    assert out.usage.completion_tokens <= 5 and out.choices[0].finish_reason == "stop", tokens
    held = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                     extra_body={"stop_token_ids": [stop_id], "min_tokens": 8, "ignore_eos": True})
    assert held.usage.completion_tokens >= 8


# ------------------------------------------------------------------------------------ tools

@pytest.mark.parametrize("tool_choice, names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
def test_required_and_named_tool_calls(service, local, tool_choice, names):
    _, client = service
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], temperature=0,
                                         max_tokens=80, tool_choice=tool_choice, parallel_tool_calls=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_time":
        assert arguments["zone"] in ("UTC", "CET")
    else:
        assert set(arguments) == {"city", "days"}
    # The in-process engine renders the same tools and constrains the same way: the same text.
    from deployments.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=tool_choice,
                                    parallel_tool_calls=False, temperature=0, max_tokens=80)
    expected = _local_chat(local, request.constraint(), tools=request.prompts()[0]["tools"], max_tokens=80)
    from deployments.tool_calls import parse

    _, calls = parse(expected.text)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (call.function.name, arguments)]


def test_streamed_tool_calls_add_up_to_the_calls(service):
    _, client = service
    body = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], temperature=0, max_tokens=120,
                tool_choice="required", parallel_tool_calls=False)
    whole = client.chat.completions.create(**body).choices[0]
    calls, finish, content = {}, None, ""
    for chunk in client.chat.completions.create(stream=True, **body):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"name": "", "arguments": "", "id": d.id})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and not content.strip()
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]


def test_history_with_tool_calls_and_results_is_rendered(service, local):
    _, client = service
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], temperature=0, max_tokens=16)
    rendered = local.tokenizer.apply_chat_template(
        [{**m, "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {
            "city": "Paris", "days": 3}}}]} if m.get("tool_calls") else m for m in history],
        tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>' in rendered
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in rendered
    assert out.usage.prompt_tokens == len(local.tokenizer(rendered, add_special_tokens=False)["input_ids"])


def test_tool_choice_none_renders_no_tools(service):
    _, client = service
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=4)
    none = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="none",
                                          temperature=0, max_tokens=4)
    auto = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], temperature=0, max_tokens=4)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert auto.choices[0].message.tool_calls is None  # a tiny random model writes no <tool_call> in 4 tokens
