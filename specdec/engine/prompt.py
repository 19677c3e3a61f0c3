"""Prompts in: text or chat messages (through the tokenizer's chat template) to token ids, and the
checks every engine applies before generating (non-empty, ids in the vocabulary, fits the context)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import dataclasses
from dataclasses import dataclass

from specdec.decoding import structured_output
from specdec.config import SamplingParams

CHAT_ROLES = ("system", "user", "assistant", "tool")

#: A prompt is text, or (with chat) text or a list of {"role", "content"} messages.
Prompt = str | list[dict]


#: What a message may carry besides role and content: an assistant's tool calls ([{"id", "type":
#: "function", "function": {"name", "arguments": a dict}}]), a tool result's call id and name.
_MESSAGE_EXTRAS = ("tool_calls", "tool_call_id", "name")


def _check_messages(messages: list) -> list[dict]:
    if not messages:
        raise ValueError("messages is empty")
    for i, m in enumerate(messages):
        calls = isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls")
        if (not isinstance(m, dict) or m.get("role") not in CHAT_ROLES
                or not (isinstance(m.get("content"), str) or (calls and m.get("content") is None))):
            raise ValueError(f"messages[{i}] must be {{'role': one of {', '.join(CHAT_ROLES)}, 'content': text}}; "
                             f"got {m!r:.200}")
    if not any((m["content"] or "").strip() or m.get("tool_calls") for m in messages):
        raise ValueError("messages are all empty")
    return [{"role": m["role"], "content": m["content"], **{k: m[k] for k in _MESSAGE_EXTRAS if m.get(k) is not None}}
            for m in messages]


def tokenize_prompt(tokenizer, prompt: Prompt, chat: bool = False, model_name: str = "target",
                    tools: list[dict] | None = None) -> list[int]:
    """Prompt -> ids. With `chat`, the tokenizer's chat template wraps the messages (a text prompt is
    one user message) and appends the assistant's generation prompt; `tools` (OpenAI's function
    definitions) are rendered by the template as the model's authors wrote it."""
    if not chat:
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("prompt is empty" if isinstance(prompt, str) or not prompt else
                             "a list of messages needs chat=True")
        return [int(i) for i in tokenizer.encode(prompt)]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("prompt is empty")
        prompt = [{"role": "user", "content": prompt}]
    messages = _check_messages(prompt)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"chat: the tokenizer of {model_name!r} has no chat template")
    if tools and "tools" not in tokenizer.chat_template:
        raise ValueError(f"tools: the chat template of {model_name!r} does not render tools")
    ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def check_prompt(prompt_token_ids: Sequence[int], sampling: SamplingParams, vocab_size: int,
                 max_context: int) -> list[int]:
    """Validate prompt ids against the model; returns them as a list. Raises ValueError."""
    ids = list(prompt_token_ids)
    if not ids:
        raise ValueError("prompt is empty")
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be integers of the model's vocabulary, [0, {vocab_size}); got "
                         f"{bad[:5]}")
    if len(ids) >= max_context:
        raise ValueError(f"prompt is {len(ids)} tokens, longer than the model's context of {max_context}")
    outside = [i for i, _ in sampling.logit_bias if i >= vocab_size]
    if outside:
        raise ValueError(f"logit_bias: token ids must be in the model's vocabulary, [0, {vocab_size}); got {outside[:5]}")
    if sampling.max_tokens is not None and len(ids) + sampling.max_tokens > max_context:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the model's context "
            f"of {max_context} tokens; set max_tokens to at most {max_context - len(ids)}"
        )
    return ids


def resolve_prompt(tokenizer, prompt: Prompt | None, prompt_token_ids: Sequence[int] | None, chat: bool,
                   sampling: SamplingParams, vocab_size: int, max_context: int,
                   model_name: str = "target", eos_token_ids: Sequence[int] = (),
                   trust_remote_code: bool = False, tools: list[dict] | None = None) -> tuple[list[int], SamplingParams]:
    """Exactly one of a prompt or ids -> checked ids, and the sampling parameters with max_tokens
    made concrete (None becomes what is left of the context) and a structured-output constraint
    compiled against the model's vocabulary (`model_name`: its spec; a bad schema raises
    `structured_output.ConstraintError`, a ValueError)."""
    if (prompt is None) == (prompt_token_ids is None):
        raise ValueError("pass exactly one of prompt and prompt_token_ids")
    if tools and (prompt is None or not chat):
        raise ValueError("tools: need a chat prompt (messages)")
    ids = tokenize_prompt(tokenizer, prompt, chat, model_name, tools) if prompt is not None else prompt_token_ids
    ids = check_prompt(ids, sampling, vocab_size, max_context)
    if sampling.max_tokens is None:
        sampling = sampling.replace(max_tokens=max_context - len(ids))
    if sampling.min_tokens > sampling.max_tokens:
        raise ValueError(f"min_tokens ({sampling.min_tokens}) exceeds max_tokens ({sampling.max_tokens})")
    if sampling.structured is not None:
        vocabulary = structured_output.Vocabulary(model_name, vocab_size, tuple(sorted(eos_token_ids)),
                                                  trust_remote_code)
        structured_output.prepare(vocabulary, tokenizer)
        constraint = dataclasses.replace(sampling.structured, vocabulary=vocabulary)
        structured_output.check(constraint)
        sampling = sampling.replace(structured=constraint)
    return ids, sampling


@dataclass(frozen=True)
class PromptResolver:
    """`resolve_prompt` bound to one target model: called with a `GenerationRequest`, returns its
    checked ids and its sampling parameters made concrete (both engines call it at admission)."""

    tokenizer: object
    vocab_size: int
    max_context: int
    model_name: str  # the target's spec (structured output loads its vocabulary from it elsewhere)
    #: The model's end-of-sequence ids, or a function giving them (read at each request: a model's
    #: generation config may change between requests).
    eos: Sequence[int] | Callable[[], Sequence[int]]
    trust_remote_code: bool = False

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self.eos() if callable(self.eos) else self.eos)

    def __call__(self, request) -> tuple[list[int], SamplingParams]:
        return resolve_prompt(self.tokenizer, request.prompt, request.prompt_token_ids, request.chat,
                              request.sampling, self.vocab_size, self.max_context, self.model_name,
                              self.eos_token_ids, self.trust_remote_code, request.tools)
