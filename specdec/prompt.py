"""Prompts in: text (optionally through the chat template) to token ids, and the checks every
engine applies before generating (non-empty, ids in the vocabulary, fits the context)."""

from __future__ import annotations

from collections.abc import Sequence

from specdec.config import SamplingParams


def tokenize_prompt(tokenizer, prompt: str, chat: bool = False, model_name: str = "target") -> list[int]:
    """Prompt text -> ids (with the tokenizer's chat template when `chat`)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("prompt is empty")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"--chat: the tokenizer of {model_name!r} has no chat template")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer.encode(prompt)]


def check_prompt(prompt_token_ids: Sequence[int], sampling: SamplingParams, vocab_size: int,
                 max_context: int) -> list[int]:
    """Validate prompt ids against the model; returns them as a list. Raises ValueError."""
    ids = list(prompt_token_ids)
    if not ids:
        raise ValueError("prompt is empty")
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]}")
    if len(ids) >= max_context:
        raise ValueError(f"prompt is {len(ids)} tokens, longer than the model's context of {max_context}")
    if len(ids) + sampling.max_tokens > max_context:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the model's context "
            f"of {max_context} tokens; set max_tokens to at most {max_context - len(ids)}"
        )
    return ids


def resolve_prompt(tokenizer, prompt: str | None, prompt_token_ids: Sequence[int] | None, chat: bool,
                   sampling: SamplingParams, vocab_size: int, max_context: int, model_name: str = "target"):
    """Exactly one of text or ids -> checked ids."""
    if (prompt is None) == (prompt_token_ids is None):
        raise ValueError("pass exactly one of prompt and prompt_token_ids")
    ids = tokenize_prompt(tokenizer, prompt, chat, model_name) if prompt is not None else prompt_token_ids
    return check_prompt(ids, sampling, vocab_size, max_context)
