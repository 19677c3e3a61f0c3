"""A draft model with prompt lookup in front: a long n-gram match proposes for free, the model otherwise.

When the context's last `min_match` or more tokens occurred earlier (code that repeats a name, an
edit that copies the input, a list that continues a pattern), what followed them is a proposal that
costs no draft forward; such matches are usually accepted at a high rate. Otherwise the draft model
proposes as usual. The model's KV cache simply lags behind over the n-gram steps: at its next call
it rewinds to the prefix it shares with the committed context and feeds the rest in its first
forward (`DraftModelProposer`).

An n-gram proposal is deterministic, so its q is one-hot (`Proposal.probs` is None) and rejection
sampling stays exact. It may be longer than the K the step asked for, up to `DraftRow.max_tokens`:
proposing costs nothing, and verifying a few more tokens costs little (the flat verify curve of
`kernels/linear.py`), while auto-K sizes the model's proposals by the model's cost.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdec.config import SamplingParams
from specdec.decoding.proposers.base import Proposal
from specdec.decoding.proposers.model import DraftModelProposer
from specdec.decoding.proposers.ngram import find_match


class HybridProposer:
    name = "model+ngram"
    per_token = True

    def __init__(self, model: DraftModelProposer, min_match: int = 3, max_n: int = 4) -> None:
        if not 1 <= min_match <= max_n:
            raise ValueError(f"need 1 <= min_match <= ngram max_n, got {min_match}, {max_n}")
        self.model = model
        self.runner = model.runner
        self.device = model.device
        self.min_match, self.max_n = min_match, max_n

    def new_state(self, limit: int | None = None):
        return self.model.new_state(limit)

    def lookup(self, context_token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """The n-gram proposal, if the match is long enough; else []."""
        tokens, n = find_match(context_token_ids, num_tokens, self.min_match, self.max_n)
        return tokens if n >= self.min_match else []

    def propose(self, state, context_token_ids: Sequence[int], num_tokens: int, sampling: SamplingParams,
                max_tokens: int | None = None) -> Proposal:
        tokens = self.lookup(context_token_ids, max(num_tokens, max_tokens or 0))
        if tokens:
            return Proposal(tokens)
        return self.model.propose(state, context_token_ids, num_tokens, sampling)

    def propose_batch(self, states, contexts, nums_tokens, samplings, max_tokens=None) -> list[Proposal]:
        max_tokens = max_tokens or [None] * len(states)
        found = [self.lookup(c, max(n, m or 0)) if n > 0 else [] for c, n, m in zip(contexts, nums_tokens, max_tokens)]
        rest = [i for i, t in enumerate(found) if not t]
        proposals: list[Proposal | None] = [Proposal(t) if t else None for t in found]
        if rest:
            drafted = self.model.propose_batch([states[i] for i in rest], [contexts[i] for i in rest],
                                               [nums_tokens[i] for i in rest], [samplings[i] for i in rest])
            for i, p in zip(rest, drafted):
                proposals[i] = p
        return proposals

    def rewind(self, state, context_token_ids: Sequence[int]) -> None:
        self.model.rewind(state, context_token_ids)

    def release(self, state) -> None:
        self.model.release(state)
