"""Speculative sampling is lossless: the first two generated tokens follow the target's exact
distribution (computed directly from the target model, not through the engine), for a draft that
is deliberately different from the target. A chi-square test over the joint distribution of
(token 1, token 2); the negative controls show the test catches a wrong acceptance rule.

Seeds make every run identical, so the test is deterministic, not flaky.
"""

import pytest
import torch
from scipy import stats

import specdec.verify
from specdec import SamplingParams, SpeculativeEngine
from tiny_models import make_model

VOCAB = 8
PROMPT = [3, 1, 2, 3, 1, 2, 3, 1]  # repetitive, so the n-gram proposer has something to propose
NUM_SAMPLES = 2000


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    target = make_model(tmp_path_factory.mktemp("sv-target"), "llama", vocab_size=VOCAB, seed=11,
                        hidden=32, init_range=0.1, eos_token_id=None)
    draft = make_model(tmp_path_factory.mktemp("sv-draft"), "llama", vocab_size=VOCAB, seed=12,
                       hidden=32, init_range=0.1, eos_token_id=None)
    return target, draft


def exact_two_token_distribution(model, params: SamplingParams) -> torch.Tensor:
    """P(t1, t2) = p(t1 | prompt) p(t2 | prompt, t1) from plain full forwards of the target."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    def probs(ids):
        with torch.no_grad():
            scores = model(torch.tensor([ids])).logits[0, -1:].float()
        for warper in (TemperatureLogitsWarper(params.temperature),
                       TopKLogitsWarper(params.top_k) if params.top_k else None,
                       TopPLogitsWarper(params.top_p) if params.top_p < 1 else None):
            if warper is not None:
                scores = warper(None, scores)
        return torch.softmax(scores, -1)[0].double()

    p1 = probs(PROMPT)
    return torch.stack([p1[t] * probs(PROMPT + [t]) for t in range(VOCAB)])  # [VOCAB, VOCAB]


def sample_two_tokens(engine, params: SamplingParams, max_tokens: int) -> tuple[torch.Tensor, float]:
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    proposed = accepted = 0
    for seed in range(NUM_SAMPLES):
        out = engine.generate(prompt_token_ids=PROMPT, sampling=params.replace(seed=seed, max_tokens=max_tokens))
        t1, t2 = out.token_ids[:2]
        counts[t1, t2] += 1
        proposed += out.speculative.num_draft_tokens
        accepted += out.speculative.num_accepted_tokens
    return counts, accepted / proposed


def assert_exercises_both_paths(acceptance_rate: float) -> None:
    """The runs must see acceptances and rejections alike, or the test proves little."""
    assert 0.05 < acceptance_rate < 0.95, acceptance_rate


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


SETTINGS = [
    pytest.param(SamplingParams(temperature=1.0), id="T1"),
    pytest.param(SamplingParams(temperature=0.7, top_k=4), id="T0.7-topk4"),
    pytest.param(SamplingParams(temperature=1.0, top_p=0.8), id="T1-topp0.8"),
]


@pytest.mark.parametrize("params", SETTINGS)
@pytest.mark.parametrize("max_tokens, k", [(2, 1), (3, 2)], ids=["K1-bonus", "K2"])
def test_draft_model_sampling_matches_target(small_vocab_pair, params, max_tokens, k):
    target, draft = small_vocab_pair
    engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=k)
    exact = exact_two_token_distribution(engine.target_model.model, params)
    counts, acceptance_rate = sample_two_tokens(engine, params, max_tokens)
    assert_exercises_both_paths(acceptance_rate)
    assert chi_square_pvalue(counts, exact) > 1e-3


def test_ngram_sampling_matches_target(small_vocab_pair):
    target, _ = small_vocab_pair
    params = SamplingParams(temperature=1.0)
    engine = SpeculativeEngine.from_pretrained(str(target), draft="ngram", num_speculative_tokens=2)
    exact = exact_two_token_distribution(engine.target_model.model, params)
    counts, acceptance_rate = sample_two_tokens(engine, params, max_tokens=3)
    assert_exercises_both_paths(acceptance_rate)
    assert chi_square_pvalue(counts, exact) > 1e-3


@pytest.mark.parametrize("bug", ["resample_from_target", "accept_always"])
def test_wrong_acceptance_rule_is_detected(small_vocab_pair, monkeypatch, bug):
    """Negative control: the same test on a deliberately broken verifier must fail."""
    if bug == "resample_from_target":  # the classic bug: on rejection, draw from p instead of p - q
        monkeypatch.setattr(specdec.verify, "recovered_distribution", lambda p, q: p)
    else:  # trust the draft
        monkeypatch.setattr(specdec.verify, "accept_probability", lambda p, q: torch.ones_like(p))
    target, draft = small_vocab_pair
    params = SamplingParams(temperature=1.0)
    engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=2)
    exact = exact_two_token_distribution(engine.target_model.model, params)
    counts, _ = sample_two_tokens(engine, params, max_tokens=3)
    assert chi_square_pvalue(counts, exact) < 1e-6
