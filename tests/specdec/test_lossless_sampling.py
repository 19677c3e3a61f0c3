"""Speculative sampling is lossless: the first two generated tokens follow the target's exact
distribution (computed directly from the target model, not through the engine), for a draft that
is deliberately different from the target. A chi-square test over the joint distribution of
(token 1, token 2); the negative controls show the test catches a wrong acceptance rule.

Seeds make every run identical, so the test is deterministic, not flaky.
"""

import pytest
import torch

import specdec.verify
from specdec import SamplingParams, SpeculativeEngine
from tests.distribution import chi_square_pvalue, exact_pair_distribution, sample_pair

NUM_SAMPLES = 2000


def assert_exercises_both_paths(acceptance_rate: float) -> None:
    """The runs must see acceptances and rejections alike, or the test proves little."""
    assert 0.05 < acceptance_rate < 0.95, acceptance_rate


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
    exact = exact_pair_distribution(engine.target_model.model, params)
    counts, acceptance_rate, _ = sample_pair(engine, params, max_tokens, NUM_SAMPLES)
    assert_exercises_both_paths(acceptance_rate)
    assert chi_square_pvalue(counts, exact) > 1e-3


def test_ngram_sampling_matches_target(small_vocab_pair):
    target, _ = small_vocab_pair
    params = SamplingParams(temperature=1.0)
    engine = SpeculativeEngine.from_pretrained(str(target), draft="ngram", num_speculative_tokens=2)
    exact = exact_pair_distribution(engine.target_model.model, params)
    counts, acceptance_rate, _ = sample_pair(engine, params, 3, NUM_SAMPLES)
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
    exact = exact_pair_distribution(engine.target_model.model, params)
    counts, _, _ = sample_pair(engine, params, 3, NUM_SAMPLES)
    assert chi_square_pvalue(counts, exact) < 1e-6
