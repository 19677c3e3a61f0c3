"""The OpenAI app in one process, without Ray: the real router (`OpenAIRouter`'s FastAPI app, with
its validation, errors, streaming and tool parsing) in front of the in-process `SpeculativeEngine`.

    from deployments.local import local_app
    app, model = local_app({"target": "qwen2.5-coder-1.5b-instruct", "num_speculative_tokens": "auto"})
    uvicorn.run(app, port=8000)
    model.shutdown()

What changes against `build_app`: no Serve (one ingress, no replicas, no admission bounds of the
model deployment, no actor health checks) and the engine decodes in this process. What it is for:
serving where Ray is not wanted, and tests whose assertion Ray adds nothing to (every decoder
family served exactly: `tests/deployments/test_families_serve.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI

from deployments.config import ServeOptions
from deployments.openai_router import OpenAIRouter
from deployments.served_model import ServedModel, build_model_info
from specdec.engine.local import SpeculativeEngine
from specdec.engine.request import GenerationRequest
from specdec.engine.request_state import StreamChunk
from specdec.models.generation_defaults import sampling_defaults


class LocalModel(ServedModel):
    """What `deployments.model_server.ModelServer` answers (the `ServedModel`), from the in-process engine."""

    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.engine = SpeculativeEngine.from_config(options.engine_config())
        self.sampling_defaults = sampling_defaults(options.generation_config, options.target)

    async def generate(self, **fields) -> AsyncIterator[StreamChunk]:
        stream = self.engine.generate_async(GenerationRequest(**fields))
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                yield chunk

    def detokenize(self, token_ids: list[int]) -> str:
        return self.engine.tokenizer.decode(token_ids)

    def model_info(self) -> dict:
        target = self.engine.target
        return build_model_info(
            self.options.describe(), max_context=target.max_context, device=str(target.device),
            dtype=str(self.engine.target_model.dtype), linear_kernel=self.engine.linear_kernel,
            sampling_defaults=self.sampling_defaults,
            startup_seconds=self.engine.startup_seconds, calibration=self.engine.calibration)

    def shutdown(self) -> None:
        self.engine.shutdown()


class _Call:
    """`handle.method.remote(...)`, as the router calls a Serve deployment: an awaitable result, or
    (with `stream`) an async iterator of the method's items."""

    def __init__(self, method, stream: bool) -> None:
        self.method, self.stream = method, stream

    def remote(self, *args, **kwargs):
        if self.stream:
            return _Stream(self.method(*args, **kwargs))
        return asyncio.to_thread(self.method, *args, **kwargs)


class _Stream:
    def __init__(self, agen) -> None:
        self.agen = agen

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.agen.__anext__()

    def cancel(self) -> None:
        asyncio.ensure_future(self.agen.aclose())  # cancels the request in the engine


class _Handle:
    """The calling convention of a Serve `DeploymentHandle` over a local object."""

    def __init__(self, target: ServedModel, stream: bool = False) -> None:
        self._target, self._stream = target, stream

    def options(self, stream: bool = False, **_) -> "_Handle":
        return _Handle(self._target, stream)

    def __getattr__(self, name: str) -> _Call:
        return _Call(getattr(self._target, name), self._stream)


class _LocalRouter(OpenAIRouter):
    async def _model_state(self) -> tuple[str, str]:
        return "ready", ""  # the engine loaded before the app was built


def local_app(args: dict[str, Any] | ServeOptions | None = None) -> tuple[FastAPI, LocalModel]:
    """The FastAPI app and its model (call `model.shutdown()` when done). `args` are `ServeOptions`."""
    options = args if isinstance(args, ServeOptions) else ServeOptions.model_validate(args or {})
    model = LocalModel(options)
    return _LocalRouter(_Handle(model), options).build_app(), model
