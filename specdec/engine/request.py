"""One generation request, as every layer passes it (engine, scheduler, Ray coordinator, Serve)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec.config import SamplingParams
from specdec.engine.prompt import Prompt


@dataclass
class GenerationRequest:
    """What to generate and how. `prompt` is text, or with `chat` a list of {"role", "content"}
    messages (and `tools` for the chat template); or pass `prompt_token_ids`. `num_speculative_tokens` (an int, "auto", or 0 for
    target-only) and `pipeline` override the engine's settings for this request; past `timeout_s`
    the request stops at its next step with `RequestTimeout`."""

    prompt: Prompt | None = None
    prompt_token_ids: Sequence[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    chat: bool = False
    request_id: str = ""
    num_speculative_tokens: int | str | None = None
    pipeline: bool | None = None
    timeout_s: float | None = None
    tools: list[dict] | None = None  # OpenAI function definitions, rendered by the chat template
    # Cached prefixes are shared only among requests with the same salt (vLLM's `cache_salt`): a
    # tenant that must not learn from the prefix cache's timing what others sent gives its own.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.sampling is None:
            self.sampling = SamplingParams()
        if not self.request_id:
            self.request_id = uuid.uuid4().hex
        if self.prompt_token_ids is not None:
            self.prompt_token_ids = list(self.prompt_token_ids)


class Cancelled(Exception):
    """The request was cancelled by its caller (a closed stream, a disconnected client)."""


class RequestTimeout(TimeoutError):
    """The request ran past its `timeout_s`; it was stopped at a step boundary and its caches freed."""


def as_request(prompt: Prompt | GenerationRequest | None = None, **fields) -> GenerationRequest:
    """A `GenerationRequest`: the one given, or one made from the prompt and the other fields."""
    if isinstance(prompt, GenerationRequest):
        if fields:
            raise TypeError("pass a GenerationRequest or its fields, not both")
        return prompt
    return GenerationRequest(prompt=prompt, **fields)


def as_requests(requests: Sequence[GenerationRequest | Prompt]) -> list[GenerationRequest]:
    return [as_request(r) for r in requests]
