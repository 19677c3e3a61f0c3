"""Every decoder family is served exactly over HTTP: a real Ray Serve app per family (built from
deployments/serve.yaml's import path), driven by the official `openai` client with concurrent
requests, so rows of different lengths share batched steps. Greedy completions equal HF `generate()`
of the target alone, token for token, with prompts and generations crossing the sliding windows.

An app takes ~14 s to start here (three actor processes import torch and transformers): the 17
families cost ~5 minutes of CI, the price of serving each one exactly, as users deploy them."""

from __future__ import annotations

import importlib
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import yaml

from tests.deployments.processes import free_port
from tests.tiny_models import FAMILIES, hf_greedy_references, make_family_pair

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [list(range(5, 24)), [3, 4], [10, 20, 30, 10, 20, 30, 10, 20, 11]]
MAX_TOKENS = [30, 22, 26]


@pytest.fixture(scope="module")
def serve_port(ray_session):
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()


def _build_app():
    config = yaml.safe_load((ROOT / "deployments" / "serve.yaml").read_text())
    (app,) = config["applications"]
    module, _, name = app["import_path"].partition(":")
    return getattr(importlib.import_module(module), name), dict(app["args"])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_served_exactly_and_batched(serve_port, tmp_path, family):
    from ray import serve

    target, draft = make_family_pair(tmp_path, family)
    references = hf_greedy_references(target, PROMPTS, MAX_TOKENS)
    build_app, args = _build_app()
    small = {"num_cpus": 0.1}
    args.update(target=str(target), draft=str(draft), threads=1, target_role=small, draft_role=small,
                served_model_name=family, draft_quantization="none", linear_kernel="torch",
                request_timeout_s=120)
    serve.run(build_app(args), name="family", route_prefix="/")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{serve_port}/v1", api_key="none", max_retries=0,
                               timeout=120)

        def complete(i: int) -> list[str]:
            # Token-id prompts: transformers loads its own tokenizer class for some model types (Qwen2's
            # byte-level one for `qwen2`), which does not split the tiny word vocabulary's text.
            out = client.completions.create(model=family, prompt=PROMPTS[i], max_tokens=MAX_TOKENS[i], temperature=0)
            return re.findall(r"w\d+", out.choices[0].text)  # one word per token, with or without spaces

        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # together: they share batched steps
            texts = list(pool.map(complete, range(len(PROMPTS))))
        assert texts == [[f"w{t}" for t in ref] for ref in references]
        assert complete(0) == [f"w{t}" for t in references[0]]  # and alone
    finally:
        serve.delete("family")
