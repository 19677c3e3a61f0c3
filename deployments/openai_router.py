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
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.config import ServeOptions
from deployments.errors import APIError, error_body, error_from_exception, validation_error
from deployments.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, CompletionChoice, CompletionRequest, CompletionResponse, Delta, ErrorResponse, ModelCard,
    ModelList, SamplingRequest, ToolCallDelta, Usage, chat_logprobs, completion_logprobs, new_id, now,
)
from deployments.tool_calls import StreamParser, parse
from specdec.engine.request_state import GenerationOutput, StreamChunk
from specdec.decoding.stats import SpeculativeStats

logger = logging.getLogger(__name__)

MODEL_DEPLOYMENT = "SpecdecModel"


@dataclass
class Choice:
    """One generation of a request: its index in `choices`, its stream from the model deployment."""

    index: int
    prompt_index: int
    stream: object  # ray.serve.handle.DeploymentResponseGenerator
    chunks: list[StreamChunk] = field(default_factory=list)
    text_offset: int = 0  # characters streamed so far (completions' logprobs.text_offset)
    echo: str = ""  # the prompt text a completions choice with `echo` starts with
    tools: StreamParser | None = None  # a chat choice whose output is parsed for tool calls
    num_calls: int = 0  # tool calls streamed so far

    @property
    def output(self) -> GenerationOutput | None:
        return self.chunks[-1].output if self.chunks else None


class OpenAIRouter:
    def __init__(self, model, options: ServeOptions) -> None:
        self.model = model  # DeploymentHandle of the model deployment
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
        app.openapi = _without_422(app.openapi)
        app.add_exception_handler(RequestValidationError, lambda request, exc: validation_error(exc.errors()).response())
        app.add_exception_handler(StarletteHTTPException, _http_exception)
        app.add_exception_handler(APIError, lambda request, exc: exc.response())
        key = self.options.api_key.get_secret_value() if self.options.api_key else None
        app.add_middleware(RequestGuard, api_key=key, max_bytes=self.options.max_request_bytes)
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
        prompts = _prompts(body)
        if len(prompts) * body.n > self.options.max_n:
            raise APIError(400, f"n × number of prompts is {len(prompts) * body.n}, above this server's limit of "
                                f"{self.options.max_n}", param="n")
        defaults = await _until(deadline, self._sampling_defaults())
        echoes = [""] * len(prompts)
        if not chat and body.echo:
            echoes = [p["prompt"] if "prompt" in p else await _until(deadline, self.model.detokenize.remote(
                p["prompt_token_ids"])) for p in prompts]
        choices = []
        for p, prompt in enumerate(prompts):
            for j in range(body.n):
                index = p * body.n + j
                choices.append(Choice(index, p, self._open(f"{response_id}-{index}", body, index, prompt,
                                                           deadline - time.monotonic(), defaults), echo=echoes[p]))
        try:
            firsts = await _until(deadline, asyncio.gather(*[_next(c.stream) for c in choices]))
        except BaseException:
            _cancel(choices)
            raise
        for c, first in zip(choices, firsts):
            c.chunks.append(first)
        if body.stream:
            events = _sse(self._stream_events(body, choices, response_id, chat, deadline))
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            await _until(deadline, asyncio.gather(*[_drain(c) for c in choices]))
        finally:
            _cancel(choices)
        return self._response(body, choices, response_id, chat)

    def _parses_tools(self, body) -> bool:
        """The output is parsed for tool calls: tools went to the model, and this server has a parser."""
        return getattr(body, "uses_tools", False) and self.options.tool_call_parser != "none"

    def _check(self, body: SamplingRequest) -> None:
        if getattr(body, "uses_tools", False) and self.options.tool_call_parser == "none":
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

    def _response(self, body, choices: list[Choice], response_id: str, chat: bool):
        outputs = [c.output for c in choices]
        usage, merged = _usage(choices), _merged(outputs)
        top = bool(body.num_logprobs)
        if chat:
            tools = self._parses_tools(body)
            messages = [_message(o, tools) for o in outputs]
            return ChatCompletionResponse(
                id=response_id, created=now(), model=self.model_name, usage=usage, speculative=merged,
                choices=[ChatChoice(index=c.index, message=m,
                                    logprobs=chat_logprobs(o.logprobs) if o.logprobs is not None else None,
                                    finish_reason="tool_calls" if m.tool_calls and o.finish_reason == "stop"
                                    else o.finish_reason,
                                    speculative=o.speculative.to_dict())
                         for c, o, m in zip(choices, outputs, messages)])
        return CompletionResponse(
            id=response_id, created=now(), model=self.model_name, usage=usage, speculative=merged,
            choices=[CompletionChoice(index=c.index, text=c.echo + o.text, finish_reason=o.finish_reason,
                                      logprobs=completion_logprobs((o.prompt_logprobs or []) + o.logprobs, top=top)
                                      if o.logprobs is not None else None, speculative=o.speculative.to_dict())
                     for c, o in zip(choices, outputs)])

    async def _stream_events(self, body: SamplingRequest, choices: list[Choice], response_id: str, chat: bool,
                             deadline: float) -> AsyncIterator[dict]:
        """The chunks of every choice as they arrive, in OpenAI's chunk format; then usage."""
        created = now()

        tools = chat and self._parses_tools(body)
        for c in choices:
            c.tools = StreamParser() if tools else None

        def chunk(c: Choice, piece: StreamChunk, first: bool) -> dict:
            spec = piece.output.speculative.to_dict() if piece.output is not None else None
            if chat:
                delta, finish_reason = Delta(role="assistant" if first else None, content=piece.text), piece.finish_reason
                if c.tools is not None:
                    delta.content, calls = c.tools.feed(piece.text)
                    if piece.finish_reason is not None:
                        delta.content += c.tools.finish()
                        finish_reason = "tool_calls" if c.tools.calls and finish_reason == "stop" else finish_reason
                    delta.tool_calls = [ToolCallDelta(index=c.num_calls + i, **call) for i, call in enumerate(calls)]
                    c.num_calls += len(calls)
                    delta.tool_calls = delta.tool_calls or None
                choice = ChatChunkChoice(index=c.index, delta=delta, finish_reason=finish_reason,
                                         logprobs=chat_logprobs(piece.logprobs) if piece.logprobs else None,
                                         speculative=spec)
                return ChatCompletionChunk(id=response_id, created=created, model=self.model_name,
                                           choices=[choice]).model_dump(exclude_none=True)
            logprobs = None
            entries = ((piece.prompt_logprobs or []) if first else []) + (piece.logprobs or [])
            if entries:
                logprobs = completion_logprobs(entries, c.text_offset, top=bool(body.num_logprobs))
                c.text_offset += sum(len(e.token) for e in entries)
            choice = CompletionChoice(index=c.index, text=(c.echo if first else "") + piece.text,
                                      finish_reason=piece.finish_reason,
                                      logprobs=logprobs, speculative=spec)
            return CompletionResponse(id=response_id, created=created, model=self.model_name,
                                      choices=[choice]).model_dump(exclude_none=True)

        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: Choice) -> None:
            try:
                while c.chunks[-1].finish_reason is None:
                    piece = await _next(c.stream)
                    c.chunks.append(piece)
                    queue.put_nowait((c, piece, None))
            except BaseException as e:  # noqa: BLE001 - reported in the stream
                queue.put_nowait((c, None, e))

        async def events() -> AsyncIterator[tuple[Choice, StreamChunk, bool]]:
            """(choice, chunk, first) in arrival order; chunks without news (held-back text) skipped."""
            for c in choices:
                yield c, c.chunks[0], True
            pending = sum(c.chunks[0].finish_reason is None for c in choices)
            while pending:
                c, piece, error = await _until(deadline, queue.get())
                if error is not None:
                    raise error
                pending -= piece.finish_reason is not None
                if piece.text or piece.finish_reason or piece.logprobs:
                    yield c, piece, False

        tasks = [asyncio.ensure_future(pump(c)) for c in choices]
        unfinished = len(choices)
        try:
            async for c, piece, first in events():
                event = chunk(c, piece, first)
                unfinished -= piece.finish_reason is not None
                if unfinished == 0 and not body.include_usage:  # the last chunk: the request's stats
                    event["speculative"] = _merged([c.output for c in choices])
                yield _keep_finish_null(event)
            if body.include_usage:
                cls = ChatCompletionChunk if chat else CompletionResponse
                yield cls(id=response_id, created=created, model=self.model_name, choices=[], usage=_usage(choices),
                          speculative=_merged([c.output for c in choices])).model_dump(exclude_none=True)
        finally:
            for t in tasks:
                t.cancel()
            _cancel(choices)

    # ------------------------------------------------------------------------- model state

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

    async def _info(self) -> dict:
        if self._model_info is None:
            state, message = await self._model_state()
            if state != "ready":
                raise APIError(503, f"the model is {state}: {message}".rstrip(": "), code="model_" + state,
                               retry_after=self.options.retry_after_s)
            self._model_info = await self.model.model_info.remote()
        return self._model_info


# ---------------------------------------------------------------------------------- helpers

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


def _without_422(openapi):
    """FastAPI documents a 422 for every body; this app answers 400 instead (see `validation_error`)."""
    def schema() -> dict:
        document = openapi()
        for operations in document.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        return document

    return schema


class RequestGuard:
    """ASGI middleware: the API key (every route but /health) and the body-size limit, checked
    before anything reads the body. Keys are compared in constant time."""

    def __init__(self, app, api_key: str | None, max_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        path = scope.get("path", "")
        if self.api_key is not None and not path.endswith("/health"):
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                message = ("missing API key: send 'Authorization: Bearer <key>'" if not given else
                           "malformed Authorization header: send 'Authorization: Bearer <key>'"
                           if scheme.lower() != b"bearer" else "incorrect API key")
                return await APIError(401, message, code="invalid_api_key")(scope, receive, send)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _too_large(self.max_bytes)(scope, receive, send)
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        # Read the body here (it is small by then), so a body without Content-Length is bounded too.
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await _too_large(self.max_bytes)(scope, receive, send)
        problem = _body_problem(headers.get(b"content-type"), body)
        if problem is not None:
            return await problem(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect

        await self.app(scope, replay, send)


def _body_problem(content_type: bytes | None, body: bytes) -> APIError | None:
    """What is wrong with a request body before FastAPI sees it: not JSON by its Content-Type (415),
    not UTF-8, not JSON, nested deeper than the parser goes, or holding text that is not Unicode (a
    lone surrogate escape). An absent Content-Type is read as JSON, as FastAPI does."""
    if not body:
        return None
    media = (content_type or b"").split(b";")[0].strip().lower()
    if media and media != b"application/json" and not media.endswith(b"+json"):
        return APIError(415, f"unsupported Content-Type {media.decode('latin-1')!r}: send the body as JSON with "
                             "'Content-Type: application/json'", code="unsupported_media_type")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return APIError(400, f"request body is not valid UTF-8 (byte {body[e.start]:#04x} at offset {e.start})",
                        code="invalid_json")
    try:
        parsed = json.loads(text)
    except RecursionError:
        return APIError(400, "request body is nested too deeply to parse", code="invalid_json")
    except ValueError as e:  # JSONDecodeError, or an integer of more than 4300 digits
        return APIError(400, f"request body is not valid JSON: {e}", code="invalid_json")
    try:
        json.dumps(parsed, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return APIError(400, f"request body holds a lone UTF-16 surrogate ({e.object[e.start]!r}), which is not "
                             "valid Unicode text", code="invalid_json")
    except RecursionError:
        return APIError(400, "request body is nested too deeply to parse", code="invalid_json")
    return None


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than this server's limit of {limit} bytes",
                    code="request_too_large")


async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        return APIError(404, f"no route {request.method} {request.url.path}; see /docs for the API",
                        code="not_found").response()
    if exc.status_code == 405:
        return APIError(405, f"method {request.method} is not allowed on {request.url.path}",
                        code="method_not_allowed").response()
    return APIError(exc.status_code, str(exc.detail)).response()


def _message(output: GenerationOutput, tools: bool) -> AssistantMessage:
    """The assistant's message: its text, or with tools the text outside its calls and the calls."""
    if not tools:
        return AssistantMessage(content=output.text)
    content, calls = parse(output.text)
    return AssistantMessage(content=content, tool_calls=calls or None)


def _prompts(body: SamplingRequest) -> list[dict]:
    try:
        return body.prompts()
    except ValueError as e:
        raise APIError(400, str(e), param="prompt") from None


async def _next(stream) -> StreamChunk:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        raise RuntimeError("the model deployment ended a stream without a finish reason") from None


async def _drain(choice: Choice) -> None:
    while choice.chunks[-1].finish_reason is None:
        choice.chunks.append(await _next(choice.stream))


async def _until(deadline: float, awaitable):
    """Await within the request's deadline; past it, a 408."""
    try:
        return await asyncio.wait_for(awaitable, max(0.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        raise APIError(408, "the request ran past this server's request timeout and was cancelled",
                       type="timeout_error", code="request_timeout") from None


def _cancel(choices: list[Choice]) -> None:
    for c in choices:
        if c.chunks and c.chunks[-1].finish_reason is not None:
            continue
        try:
            c.stream.cancel()
        except Exception:  # noqa: BLE001 - already finished
            pass


def _usage(choices: list[Choice]) -> Usage:
    prompt_tokens = {c.prompt_index: c.output.prompt_tokens for c in choices if c.output is not None}
    completion = sum(c.output.completion_tokens for c in choices if c.output is not None)
    total_prompt = sum(prompt_tokens.values())
    return Usage(prompt_tokens=total_prompt, completion_tokens=completion, total_tokens=total_prompt + completion)


def _merged(outputs: list[GenerationOutput | None]) -> dict:
    stats = SpeculativeStats()
    for o in outputs:
        if o is not None:
            stats.merge(o.speculative)
    return stats.to_dict()


def _keep_finish_null(chunk: dict) -> dict:
    """OpenAI sends `finish_reason: null` until a choice ends (clients read the key)."""
    for choice in chunk["choices"]:
        choice.setdefault("finish_reason", None)
    return chunk


async def _sse(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Server-sent events: `data: <json>` per chunk, then `data: [DONE]`, or an error event."""
    try:
        async for event in events:
            yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # noqa: BLE001 - the stream has started: report in-band
        error = error_from_exception(e)
        yield f"data: {json.dumps(error_body(error))}\n\n"
        return
    yield "data: [DONE]\n\n"


def _version() -> str:
    from specdec import __version__

    return __version__
