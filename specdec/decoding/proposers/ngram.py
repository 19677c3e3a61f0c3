"""Prompt-lookup proposals: match the context's last n tokens earlier in the context and propose
what followed (Saxena 2023, "prompt lookup decoding"; HF `prompt_lookup_num_tokens`, vLLM `ngram`).

No model, near-zero cost, and strong on inputs that get copied (code edits, summaries, repetitive
output). Deterministic, so its q is one-hot.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specdec.config import SamplingParams
from specdec.decoding.proposers.base import Proposal


class NgramProposer:
    name = "ngram"
    per_token = False  # a lookup, paid once per step whatever K
    device = torch.device("cpu")

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def new_state(self, limit: int | None = None) -> None:
        return None

    def propose(
        self,
        state: None,
        context_token_ids: Sequence[int],
        num_tokens: int,
        sampling: SamplingParams,
    ) -> Proposal:
        return Proposal(find_continuation(context_token_ids, num_tokens, self.min_n, self.max_n))

    def propose_batch(self, states, contexts, nums_tokens, samplings, max_tokens=None) -> list[Proposal]:
        return [Proposal(find_continuation(c, n, self.min_n, self.max_n)) for c, n in zip(contexts, nums_tokens)]

    def rewind(self, state: None, context_token_ids: Sequence[int]) -> None:
        pass

    def release(self, state: None) -> None:
        pass


def find_continuation(context_token_ids: Sequence[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` ids that followed the most recent earlier occurrence of the longest
    suffix n-gram (max_n down to min_n) of the context; [] when nothing matches."""
    return find_match(context_token_ids, num_tokens, min_n, max_n)[0]


def find_match(context_token_ids: Sequence[int], num_tokens: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """`find_continuation`, and the length n of the suffix that matched (0: no match)."""
    if num_tokens <= 0:
        return [], 0
    tokens = np.asarray(context_token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Windows starting at 0 .. length-n-1: every occurrence except the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # [length - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + num_tokens].tolist(), n
    return [], 0
