"""The OpenAI wire format, answers: the response bodies of /v1/completions and /v1/chat/completions
and their stream chunks, and /v1/models (pydantic models), the error body's schema (for OpenAPI; the
body is written by `deployments/errors.py`), and the core's log-probabilities in OpenAI's shapes
(`chat_logprobs`, `completion_logprobs`).

Requests, and their conversion into the core's `SamplingParams`, are `deployments/protocol.py`.
Besides OpenAI's fields, a response, its choices and the last chunk of a stream carry `speculative`:
the request's speculation statistics (an extension; `specdec.decoding.stats.SpeculativeStats`).
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Literal

from pydantic import BaseModel, Field

from deployments.protocol import FunctionCall, ToolCall


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV the prefix cache served


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape: parallel lists over the choice's tokens."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class _Response(BaseModel):
    """What every response and stream chunk carries besides its choices."""

    id: str
    created: int
    model: str
    usage: Usage | None = None
    speculative: dict | None = None  # the request's speculation statistics (an extension)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None
    speculative: dict | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class _ChatChoiceBase(BaseModel):
    index: int
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    speculative: dict | None = None


class ChatChoice(_ChatChoiceBase):
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_ChatChoiceBase):
    delta: Delta


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specdec"
    max_model_len: int | None = None
    specdec: dict = Field(default_factory=dict, description="the engine behind this id")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


#: A log-probability of minus infinity (a token outside top-k/top-p) is sent as this (JSON has no
#: infinity; vLLM's server does the same).
LOGPROB_FLOOR = -9999.0


def chat_logprobs(entries) -> ChatLogprobs:
    """OpenAI's chat shape from the core's `TokenLogprob`s."""
    return ChatLogprobs(content=[ChatTokenLogprob(
        token=e.token, logprob=max(e.logprob, LOGPROB_FLOOR), bytes=list(e.token.encode("utf-8")),
        top_logprobs=[TopLogprob(token=t, logprob=max(v, LOGPROB_FLOOR), bytes=list(t.encode("utf-8")))
                      for t, (_, v) in zip(e.top_tokens, e.top)]) for e in entries])


def completion_logprobs(entries, offset: int = 0, top: bool = True) -> CompletionLogprobs:
    """OpenAI's completions shape; `offset`: characters of the choice's text before these tokens."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    first = [math.isnan(e.logprob) for e in entries]  # an echoed prompt's first token has no log-probability
    return CompletionLogprobs(
        tokens=[e.token for e in entries],
        token_logprobs=[None if f else max(e.logprob, LOGPROB_FLOOR) for e, f in zip(entries, first)],
        top_logprobs=[None if f else {t: max(v, LOGPROB_FLOOR) for t, (_, v) in zip(e.top_tokens, e.top)}
                      for e, f in zip(entries, first)] if top else None, text_offset=offsets)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
