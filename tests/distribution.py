"""Exact token distributions of a tiny-vocabulary target, and the chi-square comparison with what an
engine samples. The exact side is computed by enumerating every continuation with plain batched
forwards of the target model (no KV cache, no engine code), warped with Hugging Face's warpers."""

from __future__ import annotations

import itertools

import torch
from scipy import stats

from specdec import SamplingParams

VOCAB = 8
PATTERN = [3, 1, 2]
PROMPT = [3, 1, 2, 3, 1, 2, 3, 1]  # repetitive, so the n-gram proposer has something to propose


class OpenAIPenalties:
    """OpenAI's presence and frequency penalties over the generated tokens, as a Hugging Face logits
    processor (HF has none): logit -= frequency * count + presence * [count > 0]. Written apart from
    specdec's (`bincount` over the vocabulary), for the references only."""

    def __init__(self, presence: float, frequency: float, prompt_length: int) -> None:
        self.presence, self.frequency, self.prompt_length = presence, frequency, prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for b in range(scores.shape[0]):
            counts = torch.bincount(input_ids[b, self.prompt_length:], minlength=scores.shape[-1])[: scores.shape[-1]]
            scores[b] -= self.frequency * counts.to(scores.dtype) + self.presence * (counts > 0).to(scores.dtype)
        return scores


def hf_processors(params: SamplingParams, prompt_length: int) -> list:
    """Hugging Face's processors for the request's biases and penalties, in `generate()`'s order
    (its own, then custom ones): sequence bias, repetition penalty, then OpenAI's penalties."""
    from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    processors = []
    if params.logit_bias:
        processors.append(SequenceBiasLogitsProcessor({(int(t),): float(b) for t, b in params.logit_bias}))
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty)))
    if params.presence_penalty or params.frequency_penalty:
        processors.append(OpenAIPenalties(params.presence_penalty, params.frequency_penalty, prompt_length))
    return processors


def hf_scores(scores: torch.Tensor, sequences: torch.Tensor, params: SamplingParams, prompt_length: int) -> torch.Tensor:
    """`[n, vocab]` next-token logits after `sequences` `[n, length]` -> the scores HF samples from
    (processors, then temperature, top-k and top-p warpers for a sampled request)."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    for processor in hf_processors(params, prompt_length):
        scores = processor(sequences, scores)
    if params.greedy:
        return scores
    for warper in (TemperatureLogitsWarper(params.temperature),
                   TopKLogitsWarper(params.top_k) if params.top_k else None,
                   TopPLogitsWarper(params.top_p) if params.top_p < 1 else None):
        if warper is not None:
            scores = warper(sequences, scores)
    return scores


def _next_token_probs(model, sequences: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    from specdec.kernels.linear import stock_linears

    with torch.no_grad(), stock_linears(model):
        scores = model(sequences).logits[:, -1].float()  # [num_sequences, vocab]
    return torch.softmax(hf_scores(scores, sequences, params, len(PROMPT)), -1).double()


def exact_pair_distribution(model, params: SamplingParams, first: int = 0) -> torch.Tensor:
    """P(t[first], t[first+1]) of the target's sampling, marginalised over earlier tokens: `[VOCAB, VOCAB]`."""
    length = first + 2
    joint = torch.ones(1, dtype=torch.float64)  # probabilities of every continuation so far
    for level in range(length):
        prefixes = torch.tensor([PROMPT + list(c) for c in itertools.product(range(VOCAB), repeat=level)])
        probs = _next_token_probs(model, prefixes, params)  # [VOCAB**level, VOCAB]
        joint = (joint.unsqueeze(-1) * probs).flatten()
    return joint.view(-1, VOCAB, VOCAB).sum(0)


#: Requests decoded together by the sampling tests' engines (their `max_batch_size`): big batches
#: draw the thousands of samples in fewer steps, and every row is tested inside a batch.
BATCH = 32


def sample_pair(engine, params: SamplingParams, max_tokens: int, num_samples: int, first: int = 0,
                concurrency: int = BATCH):
    """Counts of (t[first], t[first+1]) over seeded generations, and the acceptance rate seen.

    `concurrency` requests run at once, so the engine decodes them as one batch: the distribution is
    tested for requests inside a batch."""
    from concurrent.futures import ThreadPoolExecutor

    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    proposed = accepted = hits = 0

    def run(seed):
        return engine.generate(prompt_token_ids=PROMPT, sampling=params.replace(seed=seed, max_tokens=max_tokens))

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        outputs = list(pool.map(run, range(num_samples)))
    for out in outputs:
        counts[out.token_ids[first], out.token_ids[first + 1]] += 1
        proposed += out.speculative.num_draft_tokens
        accepted += out.speculative.num_accepted_tokens
        hits += out.speculative.pipeline_hits
    return counts, accepted / max(1, proposed), hits


def chi_square_pvalue(counts: torch.Tensor, exact: torch.Tensor) -> float:
    observed = counts.flatten().numpy()
    expected = (exact.flatten() / exact.sum() * counts.sum()).numpy()
    # Pool the cells too rare for the chi-square approximation into one.
    rare = expected < 5
    if rare.any():
        assert observed[expected == 0].sum() == 0, "sampled a pair the target gives probability 0"
        observed = list(observed[~rare]) + [observed[rare].sum()]
        expected = list(expected[~rare]) + [expected[rare].sum()]
        if expected[-1] == 0:
            observed, expected = observed[:-1], expected[:-1]
    return float(stats.chisquare(observed, expected).pvalue)
