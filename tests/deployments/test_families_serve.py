"""Every decoder family is served exactly over HTTP, driven by the official `openai` client with
concurrent requests, so rows of different lengths share batched steps. Greedy completions equal HF
`generate()` of the target alone, token for token, with prompts and generations crossing the sliding
windows.

Each family runs the real OpenAI app (the router's FastAPI app, with serve.yaml's options) in front of
the in-process engine (`deployments.local`), on a real HTTP server: what a family changes is the
model code the engine runs, the same in a Ray shard as in process (`tests/actors/test_ray_families.py`
runs sliding-window families on sharded Ray actors). One sliding-window family also goes through a
real Ray Serve app, as users deploy it. (A Serve app per family took ~14 s to start here, three actor
processes importing torch: 17 families were 5 minutes of CI.)"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.deployments.processes import free_port, http_server, serve_yaml_app
from tests.tiny_models import FAMILIES, hf_greedy_references, make_family_pair

PROMPTS = [list(range(5, 24)), [3, 4], [10, 20, 30, 10, 20, 30, 10, 20, 11]]
MAX_TOKENS = [30, 22, 26]


@pytest.fixture(scope="module")
def serve_port(ray_session):
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()


def _check_served_exactly(port: int, family: str, references) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)

    def complete(i: int) -> list[str]:
        # Token-id prompts: transformers loads its own tokenizer class for some model types (Qwen2's
        # byte-level one for `qwen2`), which does not split the tiny word vocabulary's text.
        out = client.completions.create(model=family, prompt=PROMPTS[i], max_tokens=MAX_TOKENS[i], temperature=0)
        return re.findall(r"w\d+", out.choices[0].text)  # one word per token, with or without spaces

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # together: they share batched steps
        texts = list(pool.map(complete, range(len(PROMPTS))))
    assert texts == [[f"w{t}" for t in ref] for ref in references]
    assert complete(0) == [f"w{t}" for t in references[0]]  # and alone


def _family_args(target, draft, family: str) -> dict:
    _, args = serve_yaml_app()
    args.update(target=str(target), draft=str(draft), served_model_name=family, draft_precision="none",
                linear_kernel="torch", request_timeout_s=120)
    return args


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_served_exactly_and_batched(tmp_path, family):
    from deployments.local import local_app

    target, draft = make_family_pair(tmp_path, family)
    references = hf_greedy_references(target, PROMPTS, MAX_TOKENS)
    app, model = local_app(_family_args(target, draft, family))
    try:
        with http_server(app) as port:
            _check_served_exactly(port, family, references)
        assert model.engine.scheduler.num_active == 0  # every request ended and was freed
    finally:
        model.shutdown()


def test_a_sliding_window_family_on_ray_serve(serve_port, tmp_path):
    """The deployed path: serve.yaml's app builder on Ray Serve, its engine in Ray actors."""
    from ray import serve

    family = "mistral"
    target, draft = make_family_pair(tmp_path, family)
    references = hf_greedy_references(target, PROMPTS, MAX_TOKENS)
    build_app, _ = serve_yaml_app()
    small = {"num_cpus": 0.1}
    args = {**_family_args(target, draft, family), "num_threads": 1, "target_role": small, "draft_role": small}
    serve.run(build_app(args), name="family", route_prefix="/")
    try:
        _check_served_exactly(serve_port, family, references)
    finally:
        serve.delete("family")
