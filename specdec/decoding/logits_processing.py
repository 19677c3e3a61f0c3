"""What a request does to the logits before warping: biases and penalties, position by position.

At every position the target verifies (and the draft proposes), the logits are processed from the
tokens before that position: the committed text plus the proposed tokens ahead of it in the block,
exactly as target-only decoding would see them, so speculation stays lossless. The draft's q gets
the same processing, so its proposals stay likely under the processed target (acceptance).

In Hugging Face `generate()`'s order (its own processors, then custom ones, then the warpers):
1. `logit_bias`: a number added to a token's logit (OpenAI; HF's `SequenceBiasLogitsProcessor`
   with one-token sequences);
2. `repetition_penalty` over prompt and output (HF's `RepetitionPenaltyLogitsProcessor`, its code:
   a positive logit is divided by the penalty, a negative one multiplied);
3. `frequency_penalty` and `presence_penalty` over the output only (OpenAI's formula, as vLLM:
   logit -= frequency * count + presence * [count > 0]);
4. `min_tokens`: end-of-sequence and `stop_token_ids` at -inf while the output is shorter (HF's
   `MinNewTokensLengthLogitsProcessor`);
5. structured output: every token the request's grammar forbids after the output so far at -inf
   (`structured_output.py`; last, as a custom processor runs after HF's own).
Then temperature, top-k and top-p (`sampling.warp_logits`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from specdec.decoding import structured_output
from specdec.config import SamplingParams


def process(logits: torch.Tensor, sampling: SamplingParams, prefix: Sequence[int]) -> torch.Tensor:
    """One position's `[1, vocab]` logits -> processed `[1, vocab]` float32 (a new tensor when anything
    applies). `prefix`: every token before the position, prompt included (`sampling.prompt_length`
    of them are the prompt)."""
    if not sampling.processes_logits:
        return logits
    scores = logits.float().clone()
    vocab = scores.shape[-1]
    if sampling.logit_bias:
        ids = [i for i, _ in sampling.logit_bias if i < vocab]
        if ids:
            scores[0, ids] += torch.tensor([b for i, b in sampling.logit_bias if i < vocab], dtype=scores.dtype,
                                           device=scores.device)
    if sampling.repetition_penalty != 1.0 and len(prefix):
        from transformers import RepetitionPenaltyLogitsProcessor

        ids = torch.tensor([list(prefix)], dtype=torch.long, device=scores.device)
        scores = RepetitionPenaltyLogitsProcessor(float(sampling.repetition_penalty))(ids, scores)
    output = prefix[sampling.prompt_length:]
    if (sampling.frequency_penalty or sampling.presence_penalty) and len(output):
        seen = Counter(t for t in output if t < vocab)  # counted on the host, sent once to the logits' device
        ids = torch.tensor(list(seen), dtype=torch.long, device=scores.device)
        counts = torch.tensor(list(seen.values()), dtype=scores.dtype, device=scores.device)
        scores[0, ids] -= sampling.frequency_penalty * counts + sampling.presence_penalty
    held = len(output) < sampling.min_tokens
    if held:
        before = scores
        ends = [i for i in {*sampling.eos_token_ids, *sampling.stop_token_ids} if i < vocab]
        scores = scores.clone()
        scores[0, ends] = -float("inf")
    if sampling.structured is not None:
        constrained = structured_output.apply(scores, sampling.structured, output)
        if held and not bool(torch.isfinite(constrained).any()):
            # The grammar is complete and allows only the end: it wins over min_tokens (else nothing is left).
            constrained = structured_output.apply(before, sampling.structured, output)
        scores = constrained
    return scores
