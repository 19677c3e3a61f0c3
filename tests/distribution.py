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


def _next_token_probs(model, sequences: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from specdec.kernels import stock_linears

    with torch.no_grad(), stock_linears(model):
        scores = model(sequences).logits[:, -1].float()  # [num_sequences, vocab]
    for warper in (TemperatureLogitsWarper(params.temperature),
                   TopKLogitsWarper(params.top_k) if params.top_k else None,
                   TopPLogitsWarper(params.top_p) if params.top_p < 1 else None):
        if warper is not None:
            scores = warper(None, scores)
    return torch.softmax(scores, -1).double()


def exact_pair_distribution(model, params: SamplingParams, first: int = 0) -> torch.Tensor:
    """P(t[first], t[first+1]) of the target's sampling, marginalised over earlier tokens: `[VOCAB, VOCAB]`."""
    length = first + 2
    joint = torch.ones(1, dtype=torch.float64)  # probabilities of every continuation so far
    for level in range(length):
        prefixes = torch.tensor([PROMPT + list(c) for c in itertools.product(range(VOCAB), repeat=level)])
        probs = _next_token_probs(model, prefixes, params)  # [VOCAB**level, VOCAB]
        joint = (joint.unsqueeze(-1) * probs).flatten()
    return joint.view(-1, VOCAB, VOCAB).sum(0)


def sample_pair(engine, params: SamplingParams, max_tokens: int, num_samples: int, first: int = 0,
                concurrency: int = 8):
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
