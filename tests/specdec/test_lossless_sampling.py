"""Speculative sampling is lossless, inside a batch: two consecutive generated tokens follow the
target's exact joint distribution (computed directly from the target model, not through the engine)
for a draft that is clearly different from the target, with 8 requests decoded together. A
chi-square test over the joint distribution of (token i, token i+1), at the first tokens (K=1: the
bonus token; K=2) and beyond them (K=3: tokens 2 and 3, multi-row verification; the pipelined
path: tokens 3 and 4, which follow a used pre-drafted block). Every subtle bug below is injected
as a negative control and must fail the same test: the recovered token drawn from p instead of
p - q (draft model and n-gram's one-hot q), a draft that is always trusted, the bonus token drawn
from row K-1 instead of row K, and a pre-drafted block whose q rows are shifted by one.

Seeds make every run identical, so the test is deterministic, not flaky.
"""

import dataclasses

import pytest
import torch

import specdec.scheduler
import specdec.verify
from specdec import SamplingParams, SpeculativeEngine
from specdec.proposers import Proposal
from tests.distribution import chi_square_pvalue, exact_pair_distribution, sample_pair

NUM_SAMPLES = 2000
T1 = SamplingParams(temperature=1.0)


def assert_exercises_both_paths(acceptance_rate: float) -> None:
    """The runs must see acceptances and rejections alike, or the test proves little."""
    assert 0.05 < acceptance_rate < 0.95, acceptance_rate


def pipelined(engine: SpeculativeEngine) -> SpeculativeEngine:
    """The in-process engine with the scheduler's pre-drafting on (the Ray engine does it with a draft
    worker of its own; here the draft runs in the same thread, which exercises the same code)."""
    draft = engine.scheduler.draft
    draft.capabilities = dataclasses.replace(draft.capabilities, concurrent=True, pipeline=True)
    return engine


def run(pair, draft: str, k: int, params: SamplingParams, first: int, max_tokens: int, pipeline: bool = False):
    target, draft_model = pair
    engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft_model) if draft == "model" else draft,
                                               num_speculative_tokens=k)
    if pipeline:
        pipelined(engine)
    exact = exact_pair_distribution(engine.target_model.model, params, first=first)
    counts, acceptance_rate, hits = sample_pair(engine, params, max_tokens, NUM_SAMPLES, first=first)
    assert max(engine.scheduler.batch_sizes) > 1  # sampled inside batches
    return chi_square_pvalue(counts, exact), acceptance_rate, hits


#: (sampling, K, first token tested, max_tokens): the bonus token of K=1, K=2 under each warping,
#: and tokens 2-3 of K=3 steps.
CASES = [
    pytest.param(T1, 1, 0, 2, id="T1-K1-bonus"),
    pytest.param(T1, 2, 0, 3, id="T1-K2"),
    pytest.param(T1, 3, 2, 4, id="T1-K3-tokens2,3"),
    pytest.param(SamplingParams(temperature=0.7, top_k=4), 2, 0, 3, id="T0.7-topk4-K2"),
    pytest.param(SamplingParams(temperature=1.0, top_p=0.8), 2, 0, 3, id="T1-topp0.8-K2"),
]


@pytest.mark.parametrize("params, k, first, max_tokens", CASES)
def test_draft_model_sampling_matches_target(small_vocab_pair, params, k, first, max_tokens):
    pvalue, acceptance_rate, _ = run(small_vocab_pair, "model", k, params, first, max_tokens)
    assert_exercises_both_paths(acceptance_rate)
    assert pvalue > 1e-3


def test_ngram_sampling_matches_target(small_vocab_pair):
    pvalue, acceptance_rate, _ = run(small_vocab_pair, "ngram", 2, T1, 0, 3)
    assert_exercises_both_paths(acceptance_rate)
    assert pvalue > 1e-3


def test_pipelined_sampling_matches_target(small_vocab_pair):
    pvalue, acceptance_rate, hits = run(small_vocab_pair, "model", 2, T1, 3, 6, pipeline=True)
    assert hits > NUM_SAMPLES // 5  # tokens 3-4 often come from a used pre-drafted block
    assert_exercises_both_paths(acceptance_rate)
    assert pvalue > 1e-3


def _shifted_block(early: Proposal) -> Proposal:
    return Proposal(early.token_ids[1:], early.probs[:-1] if early.probs is not None else None)


BUGS = {
    # The classic bug: on rejection, draw from p instead of normalize(max(0, p - q)).
    "resample_from_target": (specdec.verify, "recovered_distribution", lambda p, q: p),
    "accept_always": (specdec.verify, "accept_probability", lambda p, q: torch.ones_like(p)),
    "bonus_from_row_k-1": (specdec.verify, "bonus_distribution", lambda probs, k: probs[k - 1 : k]),
    "predraft_q_shifted": (specdec.scheduler, "pre_drafted_block", _shifted_block),
}


@pytest.mark.parametrize("bug, draft, k, first, max_tokens, pipeline", [
    pytest.param("resample_from_target", "model", 2, 0, 3, False, id="resample_from_target"),
    pytest.param("accept_always", "model", 2, 0, 3, False, id="accept_always"),
    pytest.param("resample_from_target", "ngram", 2, 0, 3, False, id="ngram_residual_is_p"),
    pytest.param("bonus_from_row_k-1", "model", 1, 0, 2, False, id="bonus_from_row_k-1"),
    pytest.param("predraft_q_shifted", "model", 2, 3, 6, True, id="predraft_q_shifted"),
])
def test_subtle_bugs_are_detected(small_vocab_pair, monkeypatch, bug, draft, k, first, max_tokens, pipeline):
    """Negative controls: the same test on a deliberately broken step must fail."""
    module, name, broken = BUGS[bug]
    monkeypatch.setattr(module, name, broken)
    pvalue, _, hits = run(small_vocab_pair, draft, k, T1, first, max_tokens, pipeline)
    if pipeline:
        assert hits > NUM_SAMPLES // 5
    assert pvalue < 1e-6
