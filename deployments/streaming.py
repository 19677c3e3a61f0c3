"""A request's choices as streams from the model deployment, and the server-sent events made of them.

Each choice of a request is one streaming call to the model deployment (`ServedModel.generate`,
`deployments/served_model.py`), held in a `Choice`. The router reads them through the helpers here
(`next_chunk`, `drain`, `cancel`, each within the request's deadline with `until`), and a streaming
response is `sse(events(...))`:

    data: {first chunk of choice 0}         every choice's first chunk, in choice order (the role)
    data: {chunk of whichever choice}       then chunks as they arrive, chunks without news skipped
    data: {last chunk}                      the request's merged `speculative` stats, without usage
    data: {"choices": [], "usage": ...}     or, with stream_options.include_usage, a usage chunk
    data: [DONE]                            or, if the stream failed after it started, an error event

A chunk is formatted per endpoint: `chat_chunk` (a delta, tool calls parsed as they close) and
`completion_chunk` (text, with logprobs' text offsets counted over the stream).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from deployments.errors import APIError, error_body, error_from_exception
from deployments.protocol import SamplingRequest
from deployments.responses import (ChatChunkChoice, ChatCompletionChunk, CompletionChoice, CompletionResponse, Delta,
                                   PromptTokensDetails, ToolCallDelta, Usage, chat_logprobs, completion_logprobs)
from deployments.tool_calls import StreamParser
from specdec.decoding.stats import SpeculativeStats
from specdec.engine.request_state import GenerationOutput, StreamChunk


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


@dataclass(frozen=True)
class ChunkHead:
    """What every chunk of one streamed response carries besides its choices."""

    id: str
    created: int
    model: str


# ------------------------------------------------------------------------------ reading streams

async def next_chunk(stream) -> StreamChunk:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        raise RuntimeError("the model deployment ended a stream without a finish reason") from None


async def drain(choice: Choice) -> None:
    while choice.chunks[-1].finish_reason is None:
        choice.chunks.append(await next_chunk(choice.stream))


async def until(deadline: float, awaitable):
    """Await within the request's deadline; past it, a 408."""
    try:
        return await asyncio.wait_for(awaitable, max(0.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        raise APIError(408, "the request ran past this server's request timeout and was cancelled",
                       type="timeout_error", code="request_timeout") from None


def cancel(choices: list[Choice]) -> None:
    for c in choices:
        if c.chunks and c.chunks[-1].finish_reason is not None:
            continue
        try:
            c.stream.cancel()
        except Exception:  # noqa: BLE001 - already finished
            pass


def usage(choices: list[Choice]) -> Usage:
    prompt_tokens = {c.prompt_index: c.output.prompt_tokens for c in choices if c.output is not None}
    # A prompt's cached tokens: its first choice's (the n choices of one prompt share its prefill).
    cached = {}
    for c in choices:
        if c.output is not None:
            cached.setdefault(c.prompt_index, c.output.cached_tokens)
    completion = sum(c.output.completion_tokens for c in choices if c.output is not None)
    total_prompt = sum(prompt_tokens.values())
    return Usage(prompt_tokens=total_prompt, completion_tokens=completion, total_tokens=total_prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached.values())))


def merged_stats(outputs: list[GenerationOutput | None]) -> dict:
    """The request's speculation statistics: its choices' merged."""
    stats = SpeculativeStats()
    for o in outputs:
        if o is not None:
            stats.merge(o.speculative)
    return stats.to_dict()


# --------------------------------------------------------------------------------- chunks

def chat_chunk(head: ChunkHead, c: Choice, piece: StreamChunk, first: bool) -> dict:
    """A chat.completion.chunk: the piece as a delta (the role on the first); with tools, the text
    outside calls as content and each call once its block closes."""
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
                             speculative=_stats(piece))
    return ChatCompletionChunk(id=head.id, created=head.created, model=head.model,
                               choices=[choice]).model_dump(exclude_none=True)


def completion_chunk(head: ChunkHead, c: Choice, piece: StreamChunk, first: bool, top: bool) -> dict:
    """A text_completion chunk: the piece's text (after the echoed prompt on the first), its logprobs
    (`top`: with alternatives) placed by the characters streamed before them."""
    logprobs = None
    entries = ((piece.prompt_logprobs or []) if first else []) + (piece.logprobs or [])
    if entries:
        logprobs = completion_logprobs(entries, c.text_offset, top=top)
        c.text_offset += sum(len(e.token) for e in entries)
    choice = CompletionChoice(index=c.index, text=(c.echo if first else "") + piece.text,
                              finish_reason=piece.finish_reason, logprobs=logprobs, speculative=_stats(piece))
    return CompletionResponse(id=head.id, created=head.created, model=head.model,
                              choices=[choice]).model_dump(exclude_none=True)


def _stats(piece: StreamChunk) -> dict | None:
    """A choice's speculation statistics, on its last chunk."""
    return piece.output.speculative.to_dict() if piece.output is not None else None


# --------------------------------------------------------------------------------- events

async def events(body: SamplingRequest, choices: list[Choice], head: ChunkHead, deadline: float, chat: bool,
                 tools: bool) -> AsyncIterator[dict]:
    """The chunks of every choice as they arrive, in OpenAI's chunk format; then usage. `tools`: a
    chat's output is parsed for tool calls. Each choice's first chunk is already in `choice.chunks`."""
    for c in choices:
        c.tools = StreamParser() if tools else None
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(c, queue)) for c in choices]
    unfinished = len(choices)
    try:
        async for c, piece, first in _arrivals(choices, queue, deadline):
            event = (chat_chunk(head, c, piece, first) if chat else
                     completion_chunk(head, c, piece, first, top=bool(body.num_logprobs)))
            unfinished -= piece.finish_reason is not None
            if unfinished == 0 and not body.include_usage:  # the last chunk: the request's stats
                event["speculative"] = merged_stats([c.output for c in choices])
            yield _keep_finish_null(event)
        if body.include_usage:
            envelope = ChatCompletionChunk if chat else CompletionResponse
            yield envelope(id=head.id, created=head.created, model=head.model, choices=[], usage=usage(choices),
                           speculative=merged_stats([c.output for c in choices])).model_dump(exclude_none=True)
    finally:
        for t in tasks:
            t.cancel()
        cancel(choices)


async def _pump(c: Choice, queue: asyncio.Queue) -> None:
    """Move a choice's chunks, after its first, to `queue` as (choice, chunk, None), or (choice, None, error)."""
    try:
        while c.chunks[-1].finish_reason is None:
            piece = await next_chunk(c.stream)
            c.chunks.append(piece)
            queue.put_nowait((c, piece, None))
    except BaseException as e:  # noqa: BLE001 - reported in the stream
        queue.put_nowait((c, None, e))


async def _arrivals(choices: list[Choice], queue: asyncio.Queue,
                    deadline: float) -> AsyncIterator[tuple[Choice, StreamChunk, bool]]:
    """(choice, chunk, first) in arrival order; chunks without news (held-back text) skipped."""
    for c in choices:
        yield c, c.chunks[0], True
    pending = sum(c.chunks[0].finish_reason is None for c in choices)
    while pending:
        c, piece, error = await until(deadline, queue.get())
        if error is not None:
            raise error
        pending -= piece.finish_reason is not None
        if piece.text or piece.finish_reason or piece.logprobs:
            yield c, piece, False


def _keep_finish_null(chunk: dict) -> dict:
    """OpenAI sends `finish_reason: null` until a choice ends (clients read the key)."""
    for choice in chunk["choices"]:
        choice.setdefault("finish_reason", None)
    return chunk


async def sse(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Server-sent events: `data: <json>` per chunk, then `data: [DONE]`, or an error event."""
    try:
        async for event in chunks:
            yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # noqa: BLE001 - the stream has started: report in-band
        error = error_from_exception(e)
        yield f"data: {json.dumps(error_body(error))}\n\n"
        return
    yield "data: [DONE]\n\n"
