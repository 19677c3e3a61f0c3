"""Prompts in: text or chat messages (through the tokenizer's chat template) to token ids, and the
checks every engine applies before generating (non-empty, ids in the vocabulary, fits the context)."""

from __future__ import annotations

from collections.abc import Sequence

from specdec.config import SamplingParams

CHAT_ROLES = ("system", "user", "assistant")

#: A prompt is text, or (with chat) text or a list of {"role", "content"} messages.
Prompt = str | list[dict]


def _check_messages(messages: list) -> list[dict]:
    if not messages:
        raise ValueError("messages is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be {{'role': one of {', '.join(CHAT_ROLES)}, 'content': text}}; "
                             f"got {m!r:.200}")
    if not any(m["content"].strip() for m in messages):
        raise ValueError("messages are all empty")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def tokenize_prompt(tokenizer, prompt: Prompt, chat: bool = False, model_name: str = "target") -> list[int]:
    """Prompt -> ids. With `chat`, the tokenizer's chat template wraps the messages (a text prompt is
    one user message) and appends the assistant's generation prompt."""
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
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
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
                   model_name: str = "target") -> tuple[list[int], SamplingParams]:
    """Exactly one of a prompt or ids -> checked ids, and the sampling parameters with max_tokens
    made concrete (None becomes what is left of the context)."""
    if (prompt is None) == (prompt_token_ids is None):
        raise ValueError("pass exactly one of prompt and prompt_token_ids")
    ids = tokenize_prompt(tokenizer, prompt, chat, model_name) if prompt is not None else prompt_token_ids
    ids = check_prompt(ids, sampling, vocab_size, max_context)
    if sampling.max_tokens is None:
        sampling = sampling.replace(max_tokens=max_context - len(ids))
    return ids, sampling
