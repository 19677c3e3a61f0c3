"""The OpenAI wire format: request and response bodies of /v1/completions and /v1/chat/completions
(pydantic models), the error body, and the one conversion of a request into the core's
`SamplingParams` and per-request speculation overrides.

Field names and defaults follow OpenAI's API (temperature 1, top_p 1; completions max_tokens 16,
chat until EOS or the end of the context), except that the fields a request omits may take the
model's own defaults (`specdec.generation_defaults`, applied by `SamplingRequest.sampling`).
Extensions, as vLLM has them: `top_k`, `repetition_penalty`, `ignore_eos`, and `speculative`
({"num_speculative_tokens": int | "auto" | 0, "pipeline": bool, "sampling": "invariant" | "residual"}).
Log-probabilities come back in OpenAI's shapes (`chat_logprobs`, `completion_logprobs`).

OpenAI parameters this server does not implement are rejected by name (400) unless they carry
their "off" value (`logprobs: null`, `presence_penalty: 0`, ...), which some clients always send;
any other unknown field is a 400 too. `user` is accepted and ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, model_validator

from specdec.config import MAX_LOGPROBS, SAMPLING_MODES, SamplingParams

# --------------------------------------------------------------------------- unsupported parameters

#: OpenAI parameters we know and do not implement; each may only carry its "off" value.
UNSUPPORTED = ("echo", "suffix", "best_of", "tools", "tool_choice", "functions", "function_call",
               "parallel_tool_calls", "response_format", "modalities", "audio", "prediction", "reasoning_effort",
               "web_search_options")
_OFF = (None, False, 0, 0.0, "", [], {})
_ALSO_OFF = {"best_of": (1,), "tool_choice": ("none", "auto"), "parallel_tool_calls": (True,),
             "response_format": ({"type": "text"},)}


def _off(name: str):
    """A field that may only carry an "off" value (compared with its type: 0 is not False)."""
    allowed = _OFF + _ALSO_OFF.get(name, ())

    def check(value: Any) -> Any:
        if not any(type(value) is type(off) and value == off for off in allowed):
            raise ValueError(f"'{name}' is not supported by this server")
        return value

    return Annotated[Any, AfterValidator(check)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Numbers are JSON numbers: no booleans (`true` is not 1) and no strings; floats are finite (Python's
# JSON parser reads NaN and Infinity).
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict(), Field(allow_inf_nan=False)]

#: The longest stop string, in characters (a stop string is matched against held-back text).
MAX_STOP_CHARS = 1024


# ------------------------------------------------------------------------------------- requests

class StreamOptions(StrictModel):
    include_usage: bool = Field(False, description="send a last chunk with usage (and the merged speculative "
                                                   "stats) before [DONE]")


class SpeculativeOptions(StrictModel):
    num_speculative_tokens: Annotated[Int, Field(ge=0)] | Literal["auto"] | None = Field(
        None, description="K for this request: a number, 'auto', or 0 for the target alone")
    pipeline: bool | None = Field(None, description="pre-draft while verifying (separate draft only)")
    sampling: Literal[SAMPLING_MODES] | None = Field(
        None, description="invariant: a seed gives the target-only text whatever the draft, K or load; residual: "
                          "rejection sampling, the most acceptance [default: the server's]")


class SamplingRequest(StrictModel):
    """The fields shared by completions and chat completions."""

    model: str | None = Field(None, description="the served model id (see /v1/models)")
    max_tokens: Int | None = Field(None, ge=1)
    temperature: Float = Field(1.0, ge=0, description="0 = greedy")
    top_p: Float = Field(1.0, gt=0, le=1)
    top_k: Int = Field(0, ge=-1, description="extension: keep the k most likely tokens; 0 or -1 = off")
    n: Int = Field(1, ge=1, description="independent choices per prompt; choice i uses seed + i")
    seed: Int | None = None
    stop: str | list[str] | None = Field(None, description=f"up to 16 strings of at most {MAX_STOP_CHARS} "
                                                             "characters that end the text (not included)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="extension: keep generating past the EOS token")
    speculative: SpeculativeOptions | None = Field(None, description="extension: per-request speculation")
    user: str | None = Field(None, description="accepted and ignored")
    presence_penalty: Float | None = Field(0.0, ge=-2, le=2, description="subtracted from the logit of every token "
                                                                          "already in the output")
    frequency_penalty: Float | None = Field(0.0, ge=-2, le=2, description="times each token's count in the output, "
                                                                            "subtracted from its logit")
    repetition_penalty: Float | None = Field(1.0, gt=0, le=10, description="extension (HF, vLLM): divides positive "
                                             "and multiplies negative logits of tokens in the prompt or output")
    logit_bias: dict[str, Float] | None = Field(None, description="token id (as a string) -> a bias in [-100, 100] "
                                                                  "added to its logit")

    @model_validator(mode="after")
    def _check(self):
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias: keys must be token ids (digits), got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias: biases must be in [-100, 100], got {value} for token {key}")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("stop: at most 16 non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop: each stop string must be at most {MAX_STOP_CHARS} characters")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")
        return self

    def sampling(self, index: int = 0, defaults: dict | None = None) -> SamplingParams:
        """The core's parameters for choice `index` (its seed is seed + index). `defaults`: the model's
        values (`specdec.generation_defaults`) for the fields this request did not send."""
        defaults = {k: v for k, v in (defaults or {}).items() if k not in self.model_fields_set}
        if self.effective_max_tokens_given:
            defaults.pop("max_tokens", None)

        def value(name: str, given):
            return defaults.get(name, given)

        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(temperature=float(value("temperature", self.temperature)),
                              top_p=float(value("top_p", self.top_p)), top_k=max(0, int(value("top_k", self.top_k))),
                              max_tokens=value("max_tokens", self.effective_max_tokens),
                              seed=None if self.seed is None else self.seed + index, stop=tuple(stops),
                              ignore_eos=self.ignore_eos,
                              speculative_sampling=self.speculative.sampling if self.speculative else None,
                              presence_penalty=float(self.presence_penalty or 0.0),
                              frequency_penalty=float(self.frequency_penalty or 0.0),
                              repetition_penalty=float(value("repetition_penalty", 1.0 if self.repetition_penalty
                                                             is None else self.repetition_penalty)),
                              logit_bias={int(k): float(v) for k, v in (self.logit_bias or {}).items()},
                              logprobs=self.num_logprobs)

    @property
    def effective_max_tokens_given(self) -> bool:
        return "max_tokens" in self.model_fields_set

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives to list per token (0: the emitted token's only), or None: no log-probabilities."""
        return None

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def speculation(self) -> dict:
        """Keyword arguments of the coordinator's per-request overrides."""
        s = self.speculative or SpeculativeOptions()
        return {"num_speculative_tokens": s.num_speculative_tokens, "pipeline": s.pipeline}


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[Int] | list[list[Int]] = Field(
        ..., description="text, a list of texts (one choice each), token ids, or a list of token-id lists")
    max_tokens: Int | None = Field(16, ge=1)
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="the log-probability of each token and of "
                                 "this many most likely alternatives (the target's, after penalties and warping)")
    echo: _off("echo") = None
    suffix: _off("suffix") = None
    best_of: _off("best_of") = None

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[dict]:
        """One entry per prompt: {"prompt": text} or {"prompt_token_ids": ids}."""
        p = self.prompt
        if isinstance(p, str):
            return [{"prompt": p}]
        if not p:
            raise ValueError("prompt: is empty")
        if all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": list(p)}]
        return [{"prompt": x} if isinstance(x, str) else {"prompt_token_ids": list(x)} for x in p]


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1, description="as max_tokens; wins when both are given")
    logprobs: bool | None = Field(False, description="the log-probability of each output token (the target's, "
                                                      "after penalties and warping)")
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="with logprobs: this many most likely "
                                                                              "alternatives per token")
    tools: _off("tools") = None
    tool_choice: _off("tool_choice") = None
    functions: _off("functions") = None
    function_call: _off("function_call") = None
    parallel_tool_calls: _off("parallel_tool_calls") = None
    response_format: _off("response_format") = None
    modalities: _off("modalities") = None
    audio: _off("audio") = None
    prediction: _off("prediction") = None
    reasoning_effort: _off("reasoning_effort") = None
    web_search_options: _off("web_search_options") = None
    store: bool | None = Field(None, description="accepted and ignored (nothing is stored)")
    metadata: dict[str, str] | None = Field(None, description="accepted and ignored")

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens  # None: to EOS or the end of the context

    @property
    def effective_max_tokens_given(self) -> bool:
        return bool({"max_tokens", "max_completion_tokens"} & self.model_fields_set)

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return self

    def prompts(self) -> list[dict]:
        # "developer" is OpenAI's newer name for the system role.
        return [{"prompt": [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                            for m in self.messages], "chat": True}]


# ------------------------------------------------------------------------------------ responses

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape: parallel lists over the choice's tokens."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
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


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None
    speculative: dict | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    speculative: dict | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None
    speculative: dict | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    speculative: dict | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    speculative: dict | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    speculative: dict | None = None


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
    return CompletionLogprobs(
        tokens=[e.token for e in entries], token_logprobs=[max(e.logprob, LOGPROB_FLOOR) for e in entries],
        top_logprobs=[{t: max(v, LOGPROB_FLOOR) for t, (_, v) in zip(e.top_tokens, e.top)} for e in entries]
        if top else None, text_offset=offsets)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
