"""The one place where Serve options are applied: the app of `specdec serve`, `serve run
deployments/serve.yaml` and `serve deploy`.

    from deployments.builder import build_app
    serve.run(build_app({"target": "qwen2.5-coder-1.5b-instruct", "num_speculative_tokens": 4}), route_prefix="/")

Two deployments, the shape Ray Serve LLM gives vLLM: `SpecdecRouter` (the FastAPI ingress, one
replica, no CPUs of its own) routes through a DeploymentHandle to `SpecdecModel`, of which each
replica owns one engine. `max_ongoing_requests` bounds the requests generating at once per replica;
`max_queued_requests` bounds those waiting in the router's handle beyond that, after which the
router answers 503 with Retry-After.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from deployments.config import ServeOptions
from deployments.model_server import ModelServer
from deployments.openai_router import MODEL_DEPLOYMENT, OpenAIRouter


def build_app(args: dict[str, Any] | ServeOptions | None = None) -> Application:
    """An app builder (`import_path: deployments.builder:build_app`): `args` are `ServeOptions`."""
    options = args if isinstance(args, ServeOptions) else ServeOptions.model_validate(args or {})
    model = serve.deployment(
        ModelServer,
        name=MODEL_DEPLOYMENT,
        num_replicas=options.replicas,
        max_ongoing_requests=options.max_ongoing_requests,
        max_queued_requests=options.max_queued_requests,
        ray_actor_options={"num_cpus": 0},  # the engine's actors reserve the resources
        health_check_period_s=5,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=10,
        max_constructor_retry_count=1,  # a model that fails to load fails the deploy, with its error
    ).bind(options)
    # The router admits everything the model replicas can run or queue, so the model deployment's
    # bounds (and not the router's) decide what is overloaded.
    admitted = options.replicas * options.max_ongoing_requests + options.max_queued_requests + 16
    router = serve.deployment(
        serve.ingress()(OpenAIRouter),
        name="SpecdecRouter",
        num_replicas=1,
        max_ongoing_requests=admitted,
        ray_actor_options={"num_cpus": 0},
    ).bind(model, options)
    return router
