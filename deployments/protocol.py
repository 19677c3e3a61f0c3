"""The OpenAI wire format, requests: the bodies of /v1/completions and /v1/chat/completions (pydantic
models), and the one conversion of a request into the core's `SamplingParams` and per-request
speculation overrides. What the server answers (responses, stream chunks, the error body) is
`deployments/responses.py`.

Field names and defaults follow OpenAI's API (temperature 1, top_p 1; completions max_tokens 16,
chat until EOS or the end of the context), except that the fields a request omits may take the
model's own defaults (`specdec.models.generation_defaults`, applied by `SamplingRequest.sampling`).
Extensions, as vLLM has them: `top_k`, `repetition_penalty`, `ignore_eos`, `min_tokens`,
`stop_token_ids`, `structured_outputs` ({"json" | "json_object" | "regex" | "choice" | "grammar": ...})
and `speculative` ({"num_speculative_tokens": int | "auto" | 0, "pipeline": bool, "sampling":
"invariant" | "residual"}). `response_format` (json_object, json_schema) is OpenAI's.
Log-probabilities come back in OpenAI's shapes (`deployments/responses.py`).

OpenAI parameters this server does not implement are rejected by name (400) unless they carry
their "off" value (`logprobs: null`, `presence_penalty: 0`, ...), which some clients always send;
any other unknown field is a 400 too. `user` is accepted and ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, model_validator

from specdec.decoding import structured_output
from specdec.config import MAX_LOGPROBS, SAMPLING_MODES, SamplingParams
from specdec.decoding.structured_output import Constraint

# --------------------------------------------------------------------------- unsupported parameters

# OpenAI parameters we know and do not implement are fields typed `_off(name)`: each may only carry
# its "off" value, and anything else is refused by name.
_OFF = (None, False, 0, 0.0, "", [], {})
_ALSO_OFF = {"best_of": (1,)}


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


class JSONSchemaFormat(StrictModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(..., alias="schema", description="the JSON schema the output must match")
    strict: bool | None = Field(None, description="always enforced: the output is constrained to the schema")


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format: json_schema is required with type json_schema, and only then")
        return self


class StructuredOutputs(StrictModel):
    """Extension (vLLM's `structured_outputs`): exactly one constraint."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema")
    json_object: bool | None = Field(None, description="any JSON object")
    regex: str | None = Field(None, description="a regular expression (Rust regex syntax) the whole output matches")
    choice: list[str] | None = Field(None, description="the output is exactly one of these strings")
    grammar: str | None = Field(None, description="a Lark grammar (llguidance's dialect)")

    def constraint(self) -> Constraint:
        given = [name for name in ("json_", "json_object", "regex", "choice", "grammar")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs: give exactly one of json, json_object, regex, choice, grammar")
        name = given[0]
        if name == "json_":
            return Constraint("json_schema", self.json_ if isinstance(self.json_, str) else json.dumps(self.json_))
        if name == "json_object":
            return Constraint("json_object")
        if name == "choice":
            return Constraint("choice", json.dumps(self.choice))
        return Constraint(name, getattr(self, name))


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
    cache_salt: str | None = Field(None, max_length=1024,
                                   description="extension (vLLM): cached prompt prefixes are shared only among "
                                               "requests with the same salt (give a tenant its own: a cache hit's "
                                               "speed then tells nothing about other tenants' prompts)")
    presence_penalty: Float | None = Field(0.0, ge=-2, le=2, description="subtracted from the logit of every token "
                                                                          "already in the output")
    frequency_penalty: Float | None = Field(0.0, ge=-2, le=2, description="times each token's count in the output, "
                                                                            "subtracted from its logit")
    repetition_penalty: Float | None = Field(1.0, gt=0, le=10, description="extension (HF, vLLM): divides positive "
                                             "and multiplies negative logits of tokens in the prompt or output")
    logit_bias: dict[str, Float] | None = Field(None, description="token id (as a string) -> a bias in [-100, 100] "
                                                                  "added to its logit")
    response_format: ResponseFormat | None = Field(None, description="json_object or json_schema: the output is "
                                                   "constrained to JSON (to the schema), at every verified position")
    structured_outputs: StructuredOutputs | None = Field(None, description="extension (vLLM): constrain the output "
                                                         "to a JSON schema, a regex, a choice or a Lark grammar")
    min_tokens: Int = Field(0, ge=0, description="extension: no end-of-sequence (nor stop_token_ids) before this "
                                                  "many tokens")
    stop_token_ids: list[Annotated[Int, Field(ge=0)]] | None = Field(
        None, max_length=64, description="extension: token ids that end the output (kept in it, as EOS is)")

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
        if self.effective_max_tokens is not None and self.min_tokens > self.effective_max_tokens:
            raise ValueError(f"min_tokens: {self.min_tokens} exceeds max_tokens ({self.effective_max_tokens})")
        constraint = self.constraint()
        if constraint is not None:
            try:
                structured_output.validate(constraint)
            except ValueError as e:
                name = "structured_outputs" if self.structured_outputs is not None else "response_format"
                raise ValueError(f"{name}: {e}") from None
        return self

    def constraint(self) -> Constraint | None:
        """The structured-output constraint this request asks for (`response_format` or `structured_outputs`)."""
        formats = self.response_format is not None and self.response_format.type != "text"
        if formats and self.structured_outputs is not None:
            raise ValueError("response_format: give response_format or structured_outputs, not both")
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        if not formats:
            return None
        if self.response_format.type == "json_object":
            return Constraint("json_object")
        return Constraint("json_schema", json.dumps(self.response_format.json_schema.schema_))

    def sampling(self, index: int = 0, defaults: dict | None = None) -> SamplingParams:
        """The core's parameters for choice `index` (its seed is seed + index). `defaults`: the model's
        values (`specdec.models.generation_defaults`) for the fields this request did not send."""
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
                              logprobs=self.num_logprobs, structured=self.constraint(), min_tokens=self.min_tokens,
                              stop_token_ids=tuple(self.stop_token_ids or ()))

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
    def uses_tools(self) -> bool:
        """Tools go to the model (chat completions only)."""
        return False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def speculation(self) -> dict:
        """Keyword arguments of the coordinator's per-request overrides."""
        s = self.speculative or SpeculativeOptions()
        return {"num_speculative_tokens": s.num_speculative_tokens, "pipeline": s.pipeline,
                "cache_salt": self.cache_salt}


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[Int] | list[list[Int]] = Field(
        ..., description="text, a list of texts (one choice each), token ids, or a list of token-id lists")
    max_tokens: Int | None = Field(16, ge=1)
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="the log-probability of each token and of "
                                 "this many most likely alternatives (the target's, after penalties and warping)")
    echo: bool | None = Field(False, description="the prompt before the completion in each choice's text (and, "
                              "with logprobs, the prompt tokens' log-probabilities: the target's raw ones, the first "
                              "token's null)")
    suffix: _off("suffix") = None
    best_of: _off("best_of") = None

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def sampling(self, index: int = 0, defaults: dict | None = None) -> SamplingParams:
        sampling = super().sampling(index, defaults)
        return sampling.replace(prompt_logprobs=self.logprobs) if self.echo and self.logprobs is not None else sampling

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


class FunctionCall(StrictModel):
    name: str
    arguments: str = Field(..., description="the arguments as a JSON object, in a string")


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(StrictModel):
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = Field(None, description="always enforced when the call is required or named")


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant's earlier calls")
    tool_call_id: str | None = Field(None, description="a tool message: the call it answers")

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
    tools: list[Tool] | None = Field(None, max_length=128, description="functions the model may call; rendered by "
                                     "its chat template, its calls parsed into tool_calls")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="auto (default with tools), none, required, or a named function (both enforced by a grammar)")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call [default true]")
    functions: _off("functions") = None
    function_call: _off("function_call") = None
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
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) < len(names):
            raise ValueError("tools: two tools have the same name")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice: needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice: no tool is named {self.tool_choice.function.name!r}")
        if self.forced_tools and (self.response_format is not None and self.response_format.type != "text"
                                  or self.structured_outputs is not None):
            raise ValueError("tool_choice: a required or named tool call cannot be combined with response_format or "
                             "structured_outputs")
        for i, m in enumerate(self.messages):
            if m.tool_calls and m.role != "assistant":
                raise ValueError(f"messages[{i}].tool_calls: only an assistant message has tool calls")
            if m.role == "tool" and m.tool_call_id is None:
                raise ValueError(f"messages[{i}].tool_call_id: a tool message needs the id of the call it answers")
            for call in m.tool_calls or []:
                try:
                    arguments = json.loads(call.function.arguments)
                except json.JSONDecodeError:
                    arguments = None
                if not isinstance(arguments, dict):
                    raise ValueError(f"messages[{i}].tool_calls: arguments must be a JSON object in a string")
        return self

    @property
    def uses_tools(self) -> bool:
        """Tools go to the model (and its output is parsed for calls): tools given and tool_choice not none."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tools(self) -> list[dict] | None:
        """The tools a call must be to, when the choice is required or named; else None."""
        if not self.tools or self.tool_choice in (None, "none", "auto"):
            return None
        tools = [t.model_dump(exclude_none=True) for t in self.tools]
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in tools if t["function"]["name"] == self.tool_choice.function.name]
        return tools

    def constraint(self) -> Constraint | None:
        forced = self.forced_tools
        if forced:
            from deployments.tool_calls import required_constraint

            named = isinstance(self.tool_choice, NamedToolChoice)
            return required_constraint(forced, parallel=not named and self.parallel_tool_calls is not False)
        return super().constraint()

    def prompts(self) -> list[dict]:
        # "developer" is OpenAI's newer name for the system role. Tool-call arguments go to the chat
        # template as objects (templates write them with `tojson`), as vLLM passes them.
        messages = []
        for m in self.messages:
            message = {"role": "system" if m.role == "developer" else m.role,
                       "content": m.text() if m.content is not None or not m.tool_calls else None}
            if m.tool_calls:
                message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.role == "tool" and m.name:
                message["name"] = m.name
            messages.append(message)
        tools = [t.model_dump(exclude_none=True) for t in self.tools] if self.uses_tools else None
        return [{"prompt": messages, "chat": True, **({"tools": tools} if tools else {})}]
