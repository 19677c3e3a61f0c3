"""The HTTP service on a real Ray Serve app (built from deployments/serve.yaml's import path and
args, tiny models), driven over HTTP on 127.0.0.1 by the official `openai` client and by httpx.

Two apps share one Serve instance, built once for the module: `specdec` (a draft model, an API
key) and `strict` at /strict (a 4096-token-context target, one request at a time, one queued, a
5 s timeout) for overload and timeouts: its generations of thousands of tokens hold a request in
flight without any hook in the server.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from specdec import SamplingParams, SpeculativeEngine
from tests.deployments.processes import free_port, http_server, serve_yaml_app

KEY = "sk-test-specdec"
MODEL = "tiny"
PROMPT = "w5 w6 w7 w8"



@dataclass
class Service:
    base: str
    client: openai.OpenAI
    target: str
    draft: str

    def counts(self, app: str = "specdec") -> dict:
        from ray import serve

        return serve.get_deployment_handle("SpecdecModel", app_name=app).request_counts.remote().result()

    def wait_idle(self, app: str = "specdec", timeout_s: float = 30) -> dict:
        """Every actor's per-request state is gone (in flight, KV caches, draft states)."""
        deadline = time.time() + timeout_s
        while True:
            counts = self.counts(app)
            idle = counts["coordinator"] == 0 and not any(counts["shards"]) and not counts["draft"]
            if idle or time.time() > deadline:
                return counts
            time.sleep(0.2)


#: The sampling defaults of the `defaults` app's model (its generation_config.json).
MODEL_DEFAULTS = {"temperature": 0.6, "top_k": 10, "top_p": 0.9, "repetition_penalty": 1.3}


@pytest.fixture(scope="module")
def defaults_model(tmp_path_factory, tiny_chat_llama) -> Path:
    """tiny_chat_llama whose generation_config.json carries its "authors'" sampling defaults."""
    import shutil

    path = tmp_path_factory.mktemp("defaults") / "model"
    shutil.copytree(tiny_chat_llama, path)
    config = json.loads((path / "generation_config.json").read_text()) if (path / "generation_config.json").exists() \
        else {}
    (path / "generation_config.json").write_text(json.dumps({**config, "do_sample": True, **MODEL_DEFAULTS}))
    return path


@pytest.fixture(scope="module")
def service(ray_session, tiny_chat_llama, tiny_chat_llama_draft, tiny_long_llama):
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    build_app, args = serve_yaml_app()
    small = {"num_cpus": 0.1}
    args.update(target=str(tiny_chat_llama), draft=str(tiny_chat_llama_draft), num_threads=1, target_role=small,
                draft_role=small, api_key=KEY, served_model_name=MODEL, max_ongoing_requests=8,
                max_queued_requests=16, request_timeout_s=120,
                # A full-precision draft: an int8 one quantizes each linear's input over the whole batch,
                # so seeded samples of concurrent requests (n choices) would depend on their batch-mates.
                draft_precision="none")
    serve.run(build_app(args), name="specdec", route_prefix="/")
    serve.run(build_app({"target": str(tiny_long_llama), "draft": "none", "num_threads": 1, "target_role": small,
                         "served_model_name": "long", "max_ongoing_requests": 1, "max_queued_requests": 1,
                         "request_timeout_s": 5}), name="strict", route_prefix="/strict")
    base = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)
    yield Service(base, client, str(tiny_chat_llama), str(tiny_chat_llama_draft))
    serve.shutdown()


@pytest.fixture(scope="module")
def local(service):
    """The in-process engine with the same models and K: what `specdec generate` runs."""
    return SpeculativeEngine.from_pretrained(service.target, draft=service.draft, num_speculative_tokens=4,
                                             draft_precision="none")


def _post(service, path: str, body, key: str | None = KEY, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{service.base}{path}", json=body, headers=headers, timeout=60, **kwargs)


# ------------------------------------------------------------------------------ completions

def test_greedy_completion_equals_specdec_generate(service, local):
    out = service.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0)
    cli = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--target", service.target, "--draft",
                          service.draft, "-k", "4", "--max-tokens", "40", "--num-threads", "1", "--draft-precision",
                          "none", "--json", PROMPT],
                         capture_output=True, text=True, timeout=300, check=True)
    expected = json.loads(cli.stdout)
    assert out.choices[0].text == expected["text"]
    assert out.choices[0].finish_reason == expected["finish_reason"]
    assert out.usage.completion_tokens == expected["usage"]["completion_tokens"]
    assert out.usage.prompt_tokens == expected["usage"]["prompt_tokens"]
    spec = out.model_extra["speculative"]
    for name in ("acceptance_rate", "token_acceptance_rate", "mean_accepted_length", "accepted_per_position",
                 "target_forwards", "pipeline_hits"):
        assert name in spec
    assert spec["num_accepted_tokens"] == expected["speculative"]["num_accepted_tokens"] > 0
    assert out.choices[0].text == local.generate(PROMPT, sampling=SamplingParams(max_tokens=40)).text


def test_streamed_chunks_concatenate_to_the_text(service):
    whole = service.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0)
    chunks = list(service.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                                    stream=True))
    texts = [c.choices[0].text for c in chunks]
    assert "".join(texts) == whole.choices[0].text
    assert sum(bool(t) for t in texts) > 1  # it really streams: one chunk per verification step
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].model_extra["speculative"]["num_draft_tokens"] > 0


def test_stream_usage_chunk_and_done(service):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    r = _post(service, "/v1/completions", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 12
    assert last["speculative"]["num_drafts"] > 0


def test_stop_strings_and_token_id_prompts(service, local):
    params = SamplingParams(max_tokens=40)
    reference = local.generate(PROMPT, sampling=params)
    stop = reference.text.split()[5]
    out = service.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop])
    expected = local.generate(PROMPT, sampling=params.replace(stop=(stop,)))
    assert (out.choices[0].text, out.choices[0].finish_reason) == (expected.text, "stop")
    ids = local.tokenize(PROMPT)
    by_ids = service.client.completions.create(model=MODEL, prompt=ids, max_tokens=40, temperature=0)
    assert by_ids.choices[0].text == reference.text


def test_a_list_of_prompts_gets_one_choice_each(service, local):
    prompts = ["w5 w6 w7 w8", "w3", "w10 w20 w30 w10 w20"]
    out = service.client.completions.create(model=MODEL, prompt=prompts, max_tokens=20, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for prompt, choice in zip(prompts, out.choices):
        assert choice.text == local.generate(prompt, sampling=SamplingParams(max_tokens=20)).text
    assert out.usage.prompt_tokens == sum(len(local.tokenize(p)) for p in prompts)
    assert out.usage.completion_tokens == 60


def test_seeded_sampling_equals_in_process_and_n_choices_use_seed_plus_i(service, local):
    out = service.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0.9, top_p=0.95,
                                            seed=7, n=3, extra_body={"top_k": 50})
    assert len(out.choices) == 3
    for i, choice in enumerate(out.choices):
        params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=30, seed=7 + i)
        assert choice.text == local.generate(PROMPT, sampling=params).text
    assert len({c.text for c in out.choices}) > 1  # independent samples
    streamed = service.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0.9,
                                                 top_p=0.95, seed=7, n=3, extra_body={"top_k": 50}, stream=True)
    texts = ["", "", ""]
    for c in streamed:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in out.choices]


def test_per_request_speculation_overrides(service, local):
    plain = service.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0,
                                              extra_body={"speculative": {"num_speculative_tokens": 0}})
    auto = service.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0,
                                             extra_body={"speculative": {"num_speculative_tokens": "auto"}})
    expected = local.generate(PROMPT, sampling=SamplingParams(max_tokens=30)).text
    assert plain.choices[0].text == auto.choices[0].text == expected
    assert plain.model_extra["speculative"]["num_draft_tokens"] == 0
    assert plain.model_extra["speculative"]["target_forwards"] == 30


def test_a_seed_gives_the_target_only_text_with_or_without_speculation(service):
    """Invariant sampling (the default) over HTTP: the text of a seed is the target-only text, for any
    K, pipelining, streaming or not, alone or in a batch; residual is reproducible too."""
    from concurrent.futures import ThreadPoolExecutor

    def text(stream=False, seed=11, **speculative):
        kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0.8, top_p=0.9, seed=seed,
                      extra_body={"top_k": 20, "speculative": speculative})
        if not stream:
            return service.client.completions.create(**kwargs).choices[0].text
        return "".join(c.choices[0].text for c in service.client.completions.create(stream=True, **kwargs)
                       if c.choices)

    target_only = text(num_speculative_tokens=0)
    variants = [{}, {"num_speculative_tokens": 2}, {"num_speculative_tokens": "auto"}, {"pipeline": False},
                {"sampling": "invariant", "num_speculative_tokens": 6}]
    for speculative in variants:
        assert text(**speculative) == target_only, speculative
        assert text(stream=True, **speculative) == target_only, speculative
    with ThreadPoolExecutor(len(variants)) as pool:  # together: one batch, each with its own K
        assert list(pool.map(lambda s: text(**s), variants)) == [target_only] * len(variants)
    assert text(seed=12, num_speculative_tokens=0) == text(seed=12) != target_only
    residual = text(sampling="residual")
    assert residual == text(stream=True, sampling="residual")


# ------------------------------------------------------------------------------------- chat

def test_chat_completion_applies_the_chat_template(service, local):
    messages = [{"role": "system", "content": "w40 w41"}, {"role": "user", "content": "w5 w6 w7"},
                {"role": "assistant", "content": "w8"}, {"role": "user", "content": "w9 w10"}]
    out = service.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    expected = local.generate(messages, chat=True, sampling=SamplingParams(max_tokens=30))
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    # The reference: HF's own chat templating and greedy generate() of the target alone.
    import torch
    from transformers import AutoModelForCausalLM

    ids = local.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert out.usage.prompt_tokens == len(ids)
    model = AutoModelForCausalLM.from_pretrained(service.target, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False)[0, len(ids):].tolist()
    assert expected.token_ids == hf  # and the service's text is the in-process engine's (above)
    stream = service.client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=30,
                                                    temperature=0, stream=True,
                                                    stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == 30 and chunks[-1].model_extra["speculative"]["num_drafts"] > 0


PROCESSED = {"presence_penalty": 0.6, "frequency_penalty": 0.3, "logit_bias": {"7": 3.0, "12": -100.0}}


def _processed(**kwargs) -> SamplingParams:
    return SamplingParams(presence_penalty=0.6, frequency_penalty=0.3, repetition_penalty=1.2,
                          logit_bias={7: 3.0, 12: -100.0}, **kwargs)


def test_chat_logprobs_and_penalties_equal_in_process(service, local):
    """Greedy and seeded sampling with penalties, biases and log-probabilities: the openai client's
    view (streamed and not) equals the in-process engine's, token for token and within 1e-4."""
    messages = [{"role": "user", "content": "w5 w6 w7 w5 w6"}]
    for sampling in ({"temperature": 0}, {"temperature": 0.8, "top_p": 0.9, "seed": 3}):
        kwargs = dict(model=MODEL, messages=messages, max_tokens=24, logprobs=True, top_logprobs=3,
                      extra_body={"repetition_penalty": 1.2, "ignore_eos": True}, **PROCESSED, **sampling)
        out = service.client.chat.completions.create(**kwargs)
        expected = local.generate(messages, chat=True, sampling=_processed(
            max_tokens=24, logprobs=3, ignore_eos=True, **sampling))
        assert out.choices[0].message.content == expected.text
        got = out.choices[0].logprobs.content
        assert [e.token for e in got] == [e.token for e in expected.logprobs]
        assert [e.logprob for e in got] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
        for g, e in zip(got, expected.logprobs):
            assert [t.token for t in g.top_logprobs] == list(e.top_tokens)
            assert g.bytes == list(g.token.encode("utf-8"))
        streamed = [entry for chunk in service.client.chat.completions.create(stream=True, **kwargs)
                    for choice in chunk.choices if choice.logprobs for entry in choice.logprobs.content]
        assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in got]
        plain = service.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                                       extra_body={"ignore_eos": True}, **sampling)
        assert plain.choices[0].logprobs is None and plain.choices[0].message.content != expected.text


def test_completion_logprobs_in_openai_legacy_shape(service, local):
    out = service.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    expected = local.generate(PROMPT, sampling=SamplingParams(max_tokens=16, logprobs=2))
    assert lp.tokens == [e.token for e in expected.logprobs] and len(lp.tokens) == out.usage.completion_tokens
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    assert all(len(top) <= 2 and max(top.values()) >= value - 1e-6 for top, value in zip(lp.top_logprobs,
                                                                                          lp.token_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chunks = list(service.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                                    logprobs=2, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    zero = service.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0)
    assert zero.choices[0].logprobs.top_logprobs is None and len(zero.choices[0].logprobs.token_logprobs) == 4


@pytest.fixture(scope="module")
def defaults_base(defaults_model) -> str:
    """The OpenAI app in front of the in-process engine on `defaults_model` (the defaults are applied
    before a request reaches the engine: Ray adds nothing here); its base URL."""
    from deployments.local import local_app

    app, model = local_app({"target": str(defaults_model), "draft": "none", "served_model_name": "defaults"})
    try:
        with http_server(app) as port:
            yield f"http://127.0.0.1:{port}/v1"
    finally:
        model.shutdown()


def test_omitted_sampling_fields_take_the_models_generation_config(defaults_base, defaults_model):
    """--generation-config auto (the default): what a request omits comes from the model's
    generation_config.json; what it sends wins; /v1/models shows the defaults in effect."""
    client = openai.OpenAI(base_url=defaults_base, api_key="unused", max_retries=0, timeout=120)
    card = client.models.list().data[0].model_extra["specdec"]["sampling_defaults"]
    assert card["values"] == MODEL_DEFAULTS and card["source"].endswith("generation_config.json")
    local = SpeculativeEngine.from_pretrained(str(defaults_model), draft="none")
    out = client.completions.create(model="defaults", prompt=PROMPT, max_tokens=20, seed=4)
    assert out.choices[0].text == local.generate(PROMPT, sampling=SamplingParams(max_tokens=20, seed=4,
                                                                                  **MODEL_DEFAULTS)).text
    greedy = client.completions.create(model="defaults", prompt=PROMPT, max_tokens=20, temperature=0,
                                       extra_body={"repetition_penalty": 1.0})
    assert greedy.choices[0].text == local.generate(PROMPT, sampling=SamplingParams(max_tokens=20)).text
    penalized = client.completions.create(model="defaults", prompt=PROMPT, max_tokens=20, temperature=0)
    assert penalized.choices[0].text == local.generate(PROMPT, sampling=SamplingParams(
        max_tokens=20, repetition_penalty=MODEL_DEFAULTS["repetition_penalty"])).text != greedy.choices[0].text


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(service, local):
    messages = [{"role": "user", "content": "w5 w6"}]
    out = service.client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                 extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.total_tokens == local.target.max_context


# ----------------------------------------------------------------------------- concurrency

def test_eight_concurrent_requests_are_batched_and_equal_sequential_ones(service):
    from ray import serve

    prompts = [f"w{i} w{i + 1} w{i + 2}" for i in range(3, 11)]
    sequential = [service.client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0)
                  .choices[0].text for p in prompts]
    results: dict[int, str] = {}

    def run(i: int) -> None:
        stream = i % 2 == 0
        out = service.client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=24, temperature=0,
                                                stream=stream)
        results[i] = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text

    model = serve.get_deployment_handle("SpecdecModel", app_name="specdec")
    before = model.batch_sizes.remote().result()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [results.get(i) for i in range(8)] == sequential
    assert service.wait_idle()["coordinator"] == 0
    after = model.batch_sizes.remote().result()
    batched = {size: n - before.get(size, 0) for size, n in after.items() if size > 1 and n > before.get(size, 0)}
    assert batched, f"no step decoded more than one request: {after}"  # the replica's engine batched them


def test_disconnect_mid_stream_frees_the_request_everywhere(service):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{service.base}/v1/completions", json=body,
                           headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first.removeprefix("data: "))["choices"][0]["finish_reason"] is None
            busy = service.counts()
            assert busy["coordinator"] == 1 and busy["shards"][0] >= 1  # in flight: a KV cache, a draft state
    counts = service.wait_idle()
    assert counts == {"coordinator": 0, "shards": [0], "draft": None}


# -------------------------------------------------------------------------- models, health

def test_models_lists_the_served_model_with_its_engine(service):
    models = service.client.models.list()
    (card,) = models.data
    assert card.id == MODEL
    info = card.model_extra["specdec"]
    assert info["draft"] == service.draft and info["num_speculative_tokens"] == 4
    assert info["tp"] == 1 and info["draft_placement"] == "colocated" and info["max_context"] == 512


def test_health_needs_no_key_and_everything_else_does(service):
    assert httpx.get(f"{service.base}/health").status_code == 200
    missing = httpx.get(f"{service.base}/v1/models")
    wrong = httpx.get(f"{service.base}/v1/models", headers={"Authorization": "Bearer nope"})
    for r in (missing, wrong):
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{service.base}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{service.base}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


# ------------------------------------------------------------------------------ bad input

BAD = [
    ({"prompt": PROMPT, "temperature": -1}, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p"),
    ({"prompt": PROMPT, "top_p": 1.5}, "top_p"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": PROMPT, "n": 0}, "n"),
    ({"prompt": PROMPT, "n": 9}, "n"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": PROMPT, "max_tokens": 600}, "max_tokens"),
    ({"prompt": [5, 6, 96]}, "prompt"),
    ({"prompt": PROMPT, "model": "gpt-4o"}, "model"),
    ({"prompt": PROMPT, "logprobs": 21}, "logprobs"),
    ({"prompt": PROMPT, "logprobs": True}, "logprobs"),
    ({"prompt": PROMPT, "suffix": "x"}, "suffix"),
    ({"prompt": PROMPT, "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": PROMPT, "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": PROMPT, "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": PROMPT, "logit_bias": {"w5": 10}}, "logit_bias"),
    ({"prompt": PROMPT, "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": PROMPT, "logit_bias": {"96": 1}}, "logit_bias"),
    ({"prompt": PROMPT, "best_of": 3}, "best_of"),
    ({"prompt": PROMPT, "frobnicate": 1}, "frobnicate"),
    ({"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": PROMPT, "stop": ""}, "stop"),
    ({"prompt": PROMPT, "speculative": {"num_speculative_tokens": 99}}, "speculative.num_speculative_tokens"),
    ({"prompt": PROMPT, "speculative": {"num_speculative_tokens": -1}}, "speculative.num_speculative_tokens"),
    ({"prompt": PROMPT, "speculative": {"sampling": "greedy"}}, "speculative.sampling"),
    ({"prompt": PROMPT, "stream": True, "max_tokens": 600}, "max_tokens"),
    ({}, "prompt"),
]


@pytest.mark.parametrize("body, param", BAD, ids=[p + str(i) for i, (_, p) in enumerate(BAD)])
def test_bad_completion_input_gets_a_400_naming_it(service, body, param):
    r = _post(service, "/v1/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param.split(".")[-1] in error["message"] or param == "model", error


CHAT_BAD = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "function", "content": "w5"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": "w5"}], "tools": [{"type": "function"}]}, "tools[0].function"),
    # The tiny models' word-level tokenizer is one the grammar engine cannot read.
    ({"messages": [{"role": "user", "content": "w5"}], "response_format": {"type": "json_object"}},
     "response_format"),
    ({"messages": [{"role": "user", "content": "w5"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
    ({"messages": [{"role": "user", "content": "w5"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "w5"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "w5"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "w5"}], "logprobs": 3}, "logprobs"),
]


@pytest.mark.parametrize("body, param", CHAT_BAD, ids=[p for _, p in CHAT_BAD])
def test_bad_chat_input_gets_a_400_naming_it(service, body, param):
    r = _post(service, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_off_values_of_unsupported_parameters_are_accepted(service):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": None,
            "presence_penalty": 0, "frequency_penalty": 0.0, "echo": False, "best_of": 1, "user": "someone",
            "logit_bias": None, "suffix": None}
    assert _post(service, "/v1/completions", body).status_code == 200


def test_malformed_requests_get_openai_errors_not_422_or_500(service):
    cases = [
        (httpx.post(f"{service.base}/v1/completions", content=b"{not json", headers={
            "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}), 400, "JSON"),
        (httpx.post(f"{service.base}/v1/completions", content=b"[1, 2]", headers={
            "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}), 400, "JSON object"),
        (httpx.get(f"{service.base}/v1/nothing", headers={"Authorization": f"Bearer {KEY}"}), 404, "no route"),
        (httpx.get(f"{service.base}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}), 405, "GET"),
        (_post(service, "/v1/completions", {"prompt": "w5 " * 1_500_000}), 413, "larger than"),
    ]
    for r, status, words in cases:
        assert r.status_code == status, r.text
        assert words in r.json()["error"]["message"]
    # The service keeps serving after all of that.
    assert service.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4).usage.completion_tokens == 4


def test_openai_client_raises_bad_request_with_the_message(service):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        service.client.completions.create(model=MODEL, prompt=PROMPT, temperature=-0.5)


# --------------------------------------------------------------------- overload and timeouts

def test_overload_gets_503_with_retry_after_and_timeouts_408_and_free_everything(service):
    long_body = {"prompt": "w5 w6", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    results: dict[str, httpx.Response] = {}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{service.base}/strict/v1/completions", json={**long_body, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))  # in flight now
            second = threading.Thread(target=lambda: results.update(
                second=httpx.post(f"{service.base}/strict/v1/completions", json=long_body, timeout=60)))
            second.start()
            time.sleep(1.0)  # the second request waits in the queue (the first holds the only slot)
            results["third"] = httpx.post(f"{service.base}/strict/v1/completions", json=long_body, timeout=60)
            rest = [line for line in lines if line.startswith("data: ")]
        second.join(timeout=60)
    assert json.loads(first.removeprefix("data: "))["choices"][0]["finish_reason"] is None
    # One in flight and one queued is the bound: of the two others one was rejected, one waited.
    statuses = sorted(r.status_code for r in results.values())
    assert statuses == [408, 503], {k: r.text for k, r in results.items()}
    rejected = next(r for r in results.values() if r.status_code == 503)
    assert int(rejected.headers["Retry-After"]) >= 1 and rejected.json()["error"]["code"] == "overloaded"
    timed_out = next(r for r in results.values() if r.status_code == 408)
    assert timed_out.json()["error"]["type"] == "timeout_error"
    # The streaming request ran past the 5 s timeout: an error event ends it, not [DONE].
    last = json.loads(rest[-1].removeprefix("data: "))
    assert last["error"]["code"] == "request_timeout" and "[DONE]" not in rest[-1]
    assert service.wait_idle("strict") == {"coordinator": 0, "shards": [0], "draft": None}
    # Once the load is gone, it serves normally.
    ok = httpx.post(f"{service.base}/strict/v1/completions", json={"prompt": "w5 w6", "max_tokens": 8, "temperature": 0,
                                                                         "ignore_eos": True}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8


# ------------------------------------------------------------------------------------- metrics

def _requests_by_reason(model: str) -> dict[str, float]:
    """ray_specdec_requests_total of one served model, by finish_reason, from this node's Ray agent."""
    from prometheus_client.parser import text_string_to_metric_families

    from actors.builder import metrics_export_port

    text = httpx.get(f"http://127.0.0.1:{metrics_export_port()}/metrics", timeout=10).text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "ray_specdec_requests":
            for s in family.samples:
                if s.name.endswith("_total") and s.labels["model_name"] == model:
                    counts[s.labels["finish_reason"]] = counts.get(s.labels["finish_reason"], 0) + s.value
    return counts


def _settled_counts(models: tuple[str, ...], quiet_s: float = 5.0, timeout_s: float = 60) -> list[dict]:
    """The counts once they stop moving: engines report every 2 s, so what earlier requests did
    may still be on its way."""
    last, since, deadline = None, time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        counts = [_requests_by_reason(m) for m in models]
        if counts != last:
            last, since = counts, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return counts
        time.sleep(0.5)
    raise AssertionError(f"request counts kept moving: {last}")


def test_finish_reasons_count_timeouts_disconnects_and_completions(service):
    service.wait_idle()
    service.wait_idle("strict")
    long_before, tiny_before = _settled_counts(("long", MODEL))
    # A request past the strict app's 5 s timeout: a timeout, not a cancellation.
    r = httpx.post(f"{service.base}/strict/v1/completions", json={"prompt": "w5 w6", "max_tokens": 4000,
                                                                 "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 408
    # A client that goes away mid-stream: cancelled. One that reads to the end: length.
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{service.base}/v1/completions", json=body,
                           headers={"Authorization": f"Bearer {KEY}"}) as stream:
            next(line for line in stream.iter_lines() if line.startswith("data: "))
    service.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    service.wait_idle()
    service.wait_idle("strict")
    long_after, tiny_after = _settled_counts(("long", MODEL))
    delta = lambda after, before: {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}  # noqa: E731
    assert delta(long_after, long_before) == {"timeout": 1}
    assert delta(tiny_after, tiny_before) == {"cancelled": 1, "length": 1}


def test_echo_with_prompt_logprobs(service, local):
    """`echo`: the prompt before the completion; with logprobs, the prompt tokens' log-probabilities
    (the target's, from the prefill; the first null) then the completion's; streamed the same."""
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2, echo=True)
    out = service.client.completions.create(**body).choices[0]
    expected = local.generate(PROMPT, sampling=SamplingParams(max_tokens=5, logprobs=2, prompt_logprobs=2))
    assert out.text == PROMPT + expected.text
    lp = out.logprobs
    assert len(lp.tokens) == expected.prompt_tokens + expected.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in expected.prompt_logprobs[1:]] +
                                                  [e.logprob for e in expected.logprobs], abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed = list(service.client.completions.create(stream=True, **body))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.text
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens
    ids = local.tokenize(PROMPT)
    plain = service.client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(local.tokenizer.decode(ids)) and plain.choices[0].logprobs is None


# ---------------------------------------------------------------------------- prefix caching

def test_a_second_chat_turn_reports_its_cached_prompt_tokens(service, local):
    """The OpenAI field `usage.prompt_tokens_details.cached_tokens`: a conversation's second turn
    reuses the first turn's KV (streamed or not), another `cache_salt` shares nothing, and the text
    is what the in-process engine gives the whole history."""
    system = {"role": "system", "content": " ".join(f"w{10 + i % 70}" for i in range(48))}
    first = [system, {"role": "user", "content": "w5 w6 w7"}]
    one = service.client.chat.completions.create(model=MODEL, messages=first, max_tokens=10, temperature=0)
    second = first + [{"role": "assistant", "content": one.choices[0].message.content},
                      {"role": "user", "content": "w9 w10"}]
    two = service.client.chat.completions.create(model=MODEL, messages=second, max_tokens=10, temperature=0)
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert 48 <= cached < two.usage.prompt_tokens
    assert two.choices[0].message.content == local.generate(second, chat=True,
                                                            sampling=SamplingParams(max_tokens=10)).text
    chunks = list(service.client.chat.completions.create(model=MODEL, messages=second, max_tokens=10, temperature=0,
                                                         stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == two.usage.prompt_tokens - 1  # all but the last
    salted = service.client.chat.completions.create(model=MODEL, messages=second, max_tokens=10, temperature=0,
                                                    extra_body={"cache_salt": "tenant-b"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert salted.choices[0].message.content == two.choices[0].message.content


@pytest.fixture(scope="module")
def budget_base(tiny_long_chat_llama):
    """The OpenAI app on the in-process engine with a KV budget of 512 tokens (the context is 4096)."""
    from transformers import AutoConfig

    from deployments.local import local_app
    from specdec.models.kv_cache import KVLayout

    import torch

    budget = KVLayout.of(AutoConfig.from_pretrained(tiny_long_chat_llama), torch.float32, 512).bytes_for(512)
    app, model = local_app({"target": str(tiny_long_chat_llama), "draft": "none", "served_model_name": "budget",
                            "kv_cache_memory": str(budget)})
    try:
        with http_server(app) as port:
            yield f"http://127.0.0.1:{port}/v1"
    finally:
        model.shutdown()


def test_a_request_larger_than_the_kv_budget_gets_a_400_naming_it(budget_base):
    client = openai.OpenAI(base_url=budget_base, api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError, match="KV budget") as raised:
        client.completions.create(model="budget", prompt=PROMPT, max_tokens=1000)
    assert "kv_cache_memory" in str(raised.value) and "max_tokens" in str(raised.value)
    # Chat without max_tokens runs to the end of the context (4096 tokens): that is what it reserves.
    without = httpx.post(f"{budget_base}/chat/completions", timeout=60,
                         json={"model": "budget", "messages": [{"role": "user", "content": PROMPT}]})
    assert without.status_code == 400 and "KV budget" in without.json()["error"]["message"]
    fits = client.completions.create(model="budget", prompt=PROMPT, max_tokens=100, extra_body={"ignore_eos": True})
    assert fits.usage.completion_tokens == 100
