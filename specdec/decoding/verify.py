"""Verification: which proposed tokens the target accepts, and the token it emits after them.

Vocabulary (as in vLLM's rejection sampler): for K proposed (draft) tokens the target scores K+1
positions in one forward. The output of a step is
    accepted tokens (a prefix of the proposal) + one recovered token (at the first rejection)
                                              or one bonus token (when all K were accepted).
So a step always emits between 1 and K+1 tokens, and with K = 0 it is plain target decoding.

Greedy: accept while the draft token equals the target's argmax; the recovered/bonus token is the
target's argmax. The output equals target-only greedy decoding token for token.

Sampling: speculative sampling (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023,
arXiv 2302.01318). Draft token x, sampled from q, is accepted with probability min(1, p(x)/q(x)); at
the first rejection a token is drawn from normalize(max(0, p - q)); the bonus token is drawn from p
at position K+1. Deterministic proposers (n-gram lookup) have a one-hot q. The output follows the
target's distribution p exactly, whatever the draft. Two ways to sample (`sampling.py`): `residual`
is the rule above; `invariant` couples draft and target through shared Gumbel noise, so the text
is the target-only text for the seed (`verify_invariant`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec.config import SamplingParams
from specdec.decoding.logits_processing import process
from specdec.decoding.sampling import defers_sync, draw, gumbel_argmax, uniform, warp_logits
from specdec.decoding.stats import TokenLogprob


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of one verification step."""

    num_proposed: int  # K
    num_accepted: int  # accepted draft tokens: a prefix of the proposal
    token_ids: list[int]  # [num_accepted + 1]: accepted tokens, then the recovered or bonus token
    logprobs: list[TokenLogprob] | None = None  # [num_accepted + 1] when the request asked for them

    @property
    def all_accepted(self) -> bool:
        """Every proposed token was accepted, so the last token is the bonus token from position K+1."""
        return self.num_accepted == self.num_proposed


def verify_greedy(draft_token_ids: Sequence[int], target_logits: torch.Tensor) -> VerifyResult:
    """Greedy verification.

    draft_token_ids: K proposed ids.
    target_logits: `[K+1, vocab]`; row i predicts the token at proposal position i.
    """
    return verify_greedy_ids(draft_token_ids, target_logits.argmax(dim=-1).tolist())


def verify_greedy_ids(draft_token_ids: Sequence[int], target_token_ids: Sequence[int]) -> VerifyResult:
    """Greedy verification from the target's argmax ids `[K+1]` (what a remote target shard returns)."""
    k = len(draft_token_ids)
    num_accepted = 0
    while num_accepted < k and draft_token_ids[num_accepted] == target_token_ids[num_accepted]:
        num_accepted += 1
    out = list(draft_token_ids[:num_accepted]) + [target_token_ids[num_accepted]]
    return VerifyResult(k, num_accepted, out)


def accept_probability(target_token_probs: torch.Tensor, draft_token_probs: torch.Tensor) -> torch.Tensor:
    """min(1, p(x)/q(x)) for each proposed x. Both `[K]`; q(x) > 0 since x was drawn from q."""
    return torch.clamp(target_token_probs / draft_token_probs, max=1.0)


def recovered_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)) for one position (`[vocab]` each).

    If p <= q everywhere (only possible through rounding, since a rejection needs p(x) < q(x) and
    both sum to one) the residual is empty; p itself is then the right fallback.
    """
    residual = torch.clamp(target_probs - draft_probs, min=0.0)
    total = residual.sum()
    if total <= 0:
        return target_probs
    return residual / total


def bonus_distribution(target_row: Callable[[int], torch.Tensor], k: int) -> torch.Tensor:
    """The bonus token's distribution after K accepted proposals: the target's at position K+1,
    row K (`[vocab]`) of the K+1 verified positions."""
    return target_row(k)


def verify_sampled(
    draft_token_ids: Sequence[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor | Callable[[int], torch.Tensor],
    seed: int,
    position: int,
) -> VerifyResult:
    """Speculative sampling (the `residual` mode).

    draft_token_ids: K proposed ids.
    draft_probs: `[K, vocab]` the warped distributions the ids were drawn from, or None for a
        deterministic proposer (q one-hot at each proposed id).
    target_probs: `[K+1, vocab]` the warped target distributions at the K+1 positions, or a function
        of j giving row j (`[vocab]`): only the rows up to the first rejection are asked for.
    seed, position: the request's seed and the absolute position of the first proposed token. The
        uniform that accepts the token at position t is (seed, "accept", t); the token drawn at the
        first rejection, or the bonus token, uses (seed, "resample", t).
    """
    row = target_probs if callable(target_probs) else target_probs.__getitem__
    k = len(draft_token_ids)
    if k == 0:  # target-only decoding
        return VerifyResult(0, 0, [draw(row(0), uniform(seed, "resample", position))])
    for j, x in enumerate(draft_token_ids):
        p = row(j)
        q_x = draft_probs[j, int(x)] if draft_probs is not None else torch.ones((), dtype=p.dtype, device=p.device)
        if not uniform(seed, "accept", position + j) < float(accept_probability(p[int(x)], q_x)):
            if draft_probs is not None:
                q = draft_probs[j]
            else:
                q = torch.zeros_like(p)
                q[int(x)] = 1.0
            recovered = draw(recovered_distribution(p, q), uniform(seed, "resample", position + j))
            return VerifyResult(k, j, list(draft_token_ids[:j]) + [recovered])
    bonus = draw(bonus_distribution(row, k), uniform(seed, "resample", position + k))
    return VerifyResult(k, k, list(draft_token_ids) + [bonus])


class RowScores:
    """The target's scores at each verified position, computed when first asked for: row j's logits
    processed from the committed prefix plus the proposed tokens before j (`logits_processing`),
    then warped (sampled requests). Greedy argmax, Gumbel-max, p and the log-probabilities all
    read these, so they agree with target-only decoding, which computes the same per position."""

    def __init__(self, target_logits: torch.Tensor, sampling: SamplingParams, prefix: Sequence[int],
                 draft_token_ids: Sequence[int]) -> None:
        self.logits, self.sampling = target_logits, sampling
        self.prefix, self.draft = prefix, draft_token_ids
        self.rows: dict[int, torch.Tensor] = {}

    def __call__(self, j: int) -> torch.Tensor:
        """`[vocab]` scores at proposal position j."""
        if j not in self.rows:
            row = self.logits[j : j + 1]
            if self.sampling.processes_logits:
                row = process(row, self.sampling, [*self.prefix, *self.draft[:j]])
            if not self.sampling.greedy:
                row = warp_logits(row, self.sampling)
            self.rows[j] = row[0]
        return self.rows[j]

    def logprobs(self, token_ids: Sequence[int], top: int) -> list[TokenLogprob]:
        """Log-probabilities of the emitted `token_ids` (one per position from 0) and `top` alternatives."""
        return [token_logprob(self(j), token, top) for j, token in enumerate(token_ids)]


def token_logprob(scores: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`token`'s log-probability under one position's `[vocab]` scores, and the `top` most likely."""
    logprobs = torch.log_softmax(scores.float(), dim=-1)
    best = logprobs.topk(top) if top else None
    return TokenLogprob(float(logprobs[int(token)]), tuple(zip(best.indices.tolist(), best.values.tolist()))
                        if best is not None else ())


def verify_invariant(
    draft_token_ids: Sequence[int],
    target_logits: torch.Tensor | Callable[[int], torch.Tensor],
    sampling: SamplingParams,
    position: int,
) -> VerifyResult:
    """Drafter-invariant verification (the `invariant` mode; Daliri, Musco, Suresh, arXiv 2408.07978).

    The target's token at position t is argmax(warped logits_t + G_t), with the Gumbel noise of
    (seed, t): a draw from the warped p. A proposed token is accepted while it equals that choice;
    the first mismatch emits the target's own choice. So the output is the target-only output for
    the same seed, whatever was proposed. target_logits: `[K+1, vocab]`; position: the absolute
    position of the first proposed token; or a function of j giving row j's warped scores (`RowScores`).
    Rows are warped and noised only up to the first mismatch."""
    scores = target_logits if callable(target_logits) else RowScores(target_logits, sampling, (), draft_token_ids)
    k = len(draft_token_ids)
    if k and defers_sync(scores(0).device):  # every position on the device, read in one host sync
        picks = torch.stack([gumbel_argmax(scores(j), sampling.seed, position + j, on_device=True)
                             for j in range(k + 1)]).tolist()
        choice = picks.__getitem__
    else:  # on the CPU a sync costs nothing: noise only up to the first mismatch
        def choice(j):
            return gumbel_argmax(scores(j), sampling.seed, position + j)
    out: list[int] = []
    for j in range(k + 1):
        out.append(choice(j))
        if j == k or out[-1] != int(draft_token_ids[j]):
            break
    return VerifyResult(k, len(out) - 1, out)


def argmax_only(sampling: SamplingParams) -> bool:
    """Whether verifying this request's proposals needs only the target's argmax ids: greedy, nothing
    done to the logits, no log-probabilities. Decided here and carried by the verify row
    (`TargetRow.argmax_only`): the target then returns `[K+1]` ids, and a remote shard sends no
    `[K+1, vocab]` logits."""
    return sampling.greedy and not sampling.processes_logits and sampling.logprobs is None


def verify_proposal(
    draft_token_ids: Sequence[int],
    draft_probs: torch.Tensor | None,
    target: Sequence[int] | torch.Tensor,
    sampling: SamplingParams,
    position: int,
    prefix: Sequence[int] = (),
) -> VerifyResult:
    """Verify K proposed tokens against what the target returned for them: its argmax ids `[K+1]`
    (a row that asked only for them, `argmax_only`) or its `[K+1, vocab]` logits, the way the request
    samples (greedy, invariant or residual); `sampling` must be `sampling.make_concrete`d (a seed and
    a mode). position: the absolute position of the first proposed token (the committed length);
    prefix: the committed tokens (read when the request processes logits). With `sampling.logprobs`,
    the result carries the emitted tokens' log-probabilities from the same scores."""
    if not isinstance(target, torch.Tensor):
        return verify_greedy_ids(draft_token_ids, target)
    scores = RowScores(target, sampling, prefix, draft_token_ids)
    if sampling.greedy:
        result = _verify_greedy_rows(draft_token_ids, scores)
    elif sampling.speculative_sampling == "invariant":
        result = verify_invariant(draft_token_ids, scores, sampling, position)
    else:
        result = verify_sampled(draft_token_ids, draft_probs, lambda j: torch.softmax(scores(j), dim=-1),
                                sampling.seed, position)
    if sampling.logprobs is None:
        return result
    return dataclasses.replace(result, logprobs=scores.logprobs(result.token_ids, sampling.logprobs))


def _verify_greedy_rows(draft_token_ids: Sequence[int], scores: RowScores) -> VerifyResult:
    """Greedy verification over processed rows, each computed only if the one before matched."""
    out: list[int] = []
    for j in range(len(draft_token_ids) + 1):
        out.append(int(scores(j).argmax()))
        if j == len(draft_token_ids) or out[-1] != int(draft_token_ids[j]):
            break
    return VerifyResult(len(draft_token_ids), len(out) - 1, out)
