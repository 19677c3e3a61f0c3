"""The ingress deployment: OpenAI's HTTP API on FastAPI, routed to the model deployment.

    POST /v1/completions        POST /v1/chat/completions        GET /v1/models        GET /health

A plain class that builds its FastAPI app per instance (`build_app`); `deployments/builder.py`
wraps it with `serve.ingress()` (the app is made in the replica, bound to this instance's options).
Every choice of a request (n per prompt, each prompt of a list) is one streaming call to the model
deployment; their chunks are merged as they come. Nothing is buffered to the end: a streaming
response sends each step's text as the coordinator commits it.

Errors follow OpenAI's body, {"error": {"message", "type", "param", "code"}}: 400 for bad values
(never 422), 401 for a missing or wrong key, 404 unknown route, 408 past --request-timeout, 413 body
too large, 503 while loading or overloaded (with Retry-After); 500 only for a server bug. A request
is validated before its response starts (each choice's first chunk is awaited first), so a bad
prompt gets its 400 even when streaming; a stream that fails later ends with an error event in
place of `data: [DONE]`. A closed connection or a timeout cancels every choice of the request,
which frees their caches on every actor.

What the router calls is `deployments/served_model.py`'s `ServedModel`; the checks before a route
(API key, body size, JSON) and the error handlers are `deployments/middleware.py`; the choices'
streams and their server-sent events, `deployments/streaming.py`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from deployments.config import ServeOptions
from deployments.errors import APIError, error_from_exception
from deployments.middleware import guard
from deployments.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from deployments.responses import (AssistantMessage, ChatChoice, ChatCompletionResponse, CompletionChoice,
                                   CompletionResponse, ErrorResponse, ModelCard, ModelList, chat_logprobs,
                                   completion_logprobs, new_id, now)
from deployments.streaming import (Choice, ChunkHead, cancel, drain, events, merged_stats, next_chunk, sse, until,
                                   usage)
from deployments.tool_calls import parse
from specdec.engine.request_state import GenerationOutput

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

    from deployments.served_model import ServedModel

logger = logging.getLogger(__name__)

MODEL_DEPLOYMENT = "SpecdecModel"

#: What the generation routes answer besides 200, for the OpenAPI schema (/openapi.json, /docs).
_GENERATION_RESPONSES = {
    200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
          "description": "the response, or with stream: true its chunks as server-sent events ending with "
                         "`data: [DONE]` (or an error event)"},
    **{status: {"model": ErrorResponse, "description": description} for status, description in (
        (400, "a bad parameter value, an unknown parameter, or a body that is not a JSON object"),
        (401, "a missing or wrong API key"),
        (408, "the request ran past the server's request timeout"),
        (413, "the body is larger than the server's limit"),
        (415, "the body is not JSON"),
        (503, "the model is loading, its engine failed, or every replica is busy (see Retry-After)"))},
}


class OpenAIRouter:
    def __init__(self, model: DeploymentHandle[ServedModel], options: ServeOptions) -> None:
        self.model = model  # a handle of the model deployment (or `deployments.local`'s, over the local engine)
        self.options = options
        self.model_name = options.served_model_name
        self._model_info: dict | None = None
        self._defaults: dict | None = None
        self._created = now()
        self.app_name: str | None = None

    def __serve_build_asgi_app__(self) -> FastAPI:
        from ray import serve

        self.app_name = serve.get_replica_context().app_name
        return self.build_app()

    # ------------------------------------------------------------------------------- the app

    def build_app(self) -> FastAPI:
        app = FastAPI(title="specdec", description="OpenAI-compatible API answered by lossless speculative "
                                                   "decoding.", version=_version())
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"], response_model=ModelList)
        app.add_api_route("/v1/completions", self.completions, methods=["POST"], response_model=CompletionResponse,
                          responses=_GENERATION_RESPONSES)
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"],
                          response_model=ChatCompletionResponse, responses=_GENERATION_RESPONSES)
        key = self.options.api_key.get_secret_value() if self.options.api_key else None
        guard(app, api_key=key, max_bytes=self.options.max_request_bytes)
        return app

    # ------------------------------------------------------------------------------ routes

    async def health(self) -> JSONResponse:
        """200 once every replica of the model deployment has loaded its engine and passes Serve's
        health check (every actor answers a ping when idle; shard calls, or decoder layers inside a long
        forward, keep completing under load); 503 while loading or after a failure."""
        state, message = await self._model_state()
        if state == "ready":
            return JSONResponse({"status": "ok"})
        status = "loading" if state == "loading" else "unavailable"
        return JSONResponse({"status": status, "message": message}, status_code=503,
                            headers={"Retry-After": str(self.options.retry_after_s)})

    async def models(self) -> ModelList:
        info = await self._info()
        return ModelList(data=[ModelCard(id=self.model_name, created=self._created,
                                         max_model_len=info["max_context"], specdec=info)])

    async def completions(self, body: CompletionRequest):
        return await self._serve(body, chat=False)

    async def chat_completions(self, body: ChatCompletionRequest):
        return await self._serve(body, chat=True)

    # ---------------------------------------------------------------------------- serving

    async def _serve(self, body: SamplingRequest, chat: bool):
        try:
            return await self._generate(body, chat)
        except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error body
            raise error_from_exception(e) from None

    async def _generate(self, body: SamplingRequest, chat: bool):
        deadline = time.monotonic() + self.options.request_timeout_s
        self._check(body)
        response_id = new_id("chatcmpl" if chat else "cmpl")
        choices = await self._start(body, response_id, chat, deadline)
        if body.stream:
            head = ChunkHead(id=response_id, created=now(), model=self.model_name)
            chunks = events(body, choices, head, deadline, chat, tools=chat and self._parses_tools(body))
            return StreamingResponse(sse(chunks), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            await until(deadline, asyncio.gather(*[drain(c) for c in choices]))
        finally:
            cancel(choices)
        return self._response(body, choices, response_id, chat)

    def _check(self, body: SamplingRequest) -> None:
        if body.uses_tools and self.options.tool_call_parser == "none":
            raise APIError(400, "tools: this server parses no tool calls (started with --tool-call-parser none)",
                           param="tools")
        if body.model is not None and body.model != self.model_name:
            raise APIError(400, f"model {body.model!r} is not served here; this server serves "
                                f"{self.model_name!r} (GET /v1/models)", param="model", code="model_not_found")
        k = (body.speculative.num_speculative_tokens if body.speculative else None)
        if isinstance(k, int) and k > self.options.max_speculative_tokens:
            raise APIError(400, f"speculative.num_speculative_tokens is {k}; this server allows at most "
                                f"{self.options.max_speculative_tokens} (its max_speculative_tokens)",
                           param="speculative.num_speculative_tokens")

    async def _start(self, body: SamplingRequest, response_id: str, chat: bool, deadline: float) -> list[Choice]:
        """One stream per choice (n per prompt), each with its first chunk awaited: a request the model
        refuses fails here, before its response starts."""
        prompts = _prompts(body)
        if len(prompts) * body.n > self.options.max_n:
            raise APIError(400, f"n × number of prompts is {len(prompts) * body.n}, above this server's limit of "
                                f"{self.options.max_n}", param="n")
        defaults = await until(deadline, self._sampling_defaults())
        echoes = [""] * len(prompts)
        if not chat and body.echo:
            echoes = [p["prompt"] if "prompt" in p else await until(deadline, self.model.detokenize.remote(
                p["prompt_token_ids"])) for p in prompts]
        choices = []
        for p, prompt in enumerate(prompts):
            for j in range(body.n):
                index = p * body.n + j
                choices.append(Choice(index, p, self._open(f"{response_id}-{index}", body, index, prompt,
                                                           deadline - time.monotonic(), defaults), echo=echoes[p]))
        try:
            firsts = await until(deadline, asyncio.gather(*[next_chunk(c.stream) for c in choices]))
        except BaseException:
            cancel(choices)
            raise
        for c, first in zip(choices, firsts):
            c.chunks.append(first)
        return choices

    def _open(self, request_id: str, body: SamplingRequest, index: int, prompt: dict, timeout_s: float,
              defaults: dict):
        """The engine stops the choice at this deadline too (and counts it as a timeout)."""
        return self.model.options(stream=True).generate.remote(
            request_id=request_id, sampling=body.sampling(index, defaults), timeout_s=timeout_s, **prompt,
            **body.speculation())

    async def _sampling_defaults(self) -> dict:
        """The model's values for sampling fields a request omits (`--generation-config`), asked of the
        model deployment once (waiting for it to load, as a generation would)."""
        if self._defaults is None:
            info = self._model_info or await self.model.model_info.remote()
            self._defaults = dict(info.get("sampling_defaults", {}).get("values", {}))
        return self._defaults

    def _parses_tools(self, body) -> bool:
        """The output is parsed for tool calls: tools went to the model, and this server has a parser."""
        return body.uses_tools and self.options.tool_call_parser != "none"

    def _response(self, body, choices: list[Choice], response_id: str, chat: bool):
        outputs = [c.output for c in choices]
        total, merged = usage(choices), merged_stats(outputs)
        top = bool(body.num_logprobs)
        if chat:
            tools = self._parses_tools(body)
            messages = [_message(o, tools) for o in outputs]
            return ChatCompletionResponse(
                id=response_id, created=now(), model=self.model_name, usage=total, speculative=merged,
                choices=[ChatChoice(index=c.index, message=m,
                                    logprobs=chat_logprobs(o.logprobs) if o.logprobs is not None else None,
                                    finish_reason="tool_calls" if m.tool_calls and o.finish_reason == "stop"
                                    else o.finish_reason,
                                    speculative=o.speculative.to_dict())
                         for c, o, m in zip(choices, outputs, messages)])
        return CompletionResponse(
            id=response_id, created=now(), model=self.model_name, usage=total, speculative=merged,
            choices=[CompletionChoice(index=c.index, text=c.echo + o.text, finish_reason=o.finish_reason,
                                      logprobs=completion_logprobs((o.prompt_logprobs or []) + o.logprobs, top=top)
                                      if o.logprobs is not None else None, speculative=o.speculative.to_dict())
                     for c, o in zip(choices, outputs)])

    # ------------------------------------------------------------------------- model state

    async def _info(self) -> dict:
        if self._model_info is None:
            state, message = await self._model_state()
            if state != "ready":
                raise APIError(503, f"the model is {state}: {message}".rstrip(": "), code="model_" + state,
                               retry_after=self.options.retry_after_s)
            self._model_info = await self.model.model_info.remote()
        return self._model_info

    async def _model_state(self) -> tuple[str, str]:
        """("ready" | "loading" | "failed", message) of the model deployment, from Serve's status."""
        from ray import serve

        try:
            status = await asyncio.to_thread(serve.status)
            app = status.applications[self.app_name]
            deployment = app.deployments[MODEL_DEPLOYMENT]
        except Exception as e:  # noqa: BLE001
            return "failed", f"cannot read Serve's status: {e}"
        if deployment.status == "HEALTHY":
            return "ready", ""
        if deployment.status in ("UPDATING", "UPSCALING", "DOWNSCALING") or app.status == "DEPLOYING":
            return "loading", deployment.message or "the engine is loading"
        return "failed", deployment.message or app.message or f"model deployment is {deployment.status}"


# ---------------------------------------------------------------------------------- helpers

def _prompts(body: SamplingRequest) -> list[dict]:
    try:
        return body.prompts()
    except ValueError as e:
        raise APIError(400, str(e), param="prompt") from None


def _message(output: GenerationOutput, tools: bool) -> AssistantMessage:
    """The assistant's message: its text, or with tools the text outside its calls and the calls."""
    if not tools:
        return AssistantMessage(content=output.text)
    content, calls = parse(output.text)
    return AssistantMessage(content=content, tool_calls=calls or None)


def _version() -> str:
    from specdec import __version__

    return __version__
