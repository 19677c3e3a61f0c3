"""Speculative sampling is lossless, inside a batch: two consecutive generated tokens follow the
target's exact joint distribution (computed directly from the target model, not through the engine)
for a draft that is clearly different from the target, with 8 requests decoded together. A
chi-square test over the joint distribution of (token i, token i+1), at the first tokens (K=1: the
bonus token; K=2) and beyond them (K=3: tokens 2 and 3, multi-row verification; the pipelined
path: tokens 3 and 4, which follow a used pre-drafted block), for both sampling modes (`residual`,
`invariant`) and for target-only invariant sampling.

Every subtle bug below is injected as a negative control and must fail the same test:
- residual: the recovered token drawn from p instead of p - q (draft model and n-gram's one-hot q),
  a draft that is always trusted, the bonus token drawn from row K-1 instead of row K, a pre-drafted
  block whose q rows are shifted by one, draft and verification randomness that are the same numbers,
  top-p applied before top-k, and a row's q taken from its batch neighbour (the batched plumbing);
- invariant: Gumbel noise shared across positions.

Seeds make every run identical, so the test is deterministic, not flaky.
"""

import dataclasses

import pytest
import torch

import specdec.decoding.sampling
import specdec.engine.scheduler
import specdec.decoding.verify
from specdec.decoding.proposers.model import DraftModelProposer
from specdec import SamplingParams, SpeculativeEngine
from specdec.decoding.proposers import Proposal
from tests.distribution import BATCH, chi_square_pvalue, exact_pair_distribution, sample_pair

NUM_SAMPLES = 2000
T1 = SamplingParams(temperature=1.0, speculative_sampling="residual")
T1_INVARIANT = SamplingParams(temperature=1.0, speculative_sampling="invariant")
#: Top-k then top-p (HF's order); the reverse order gives a clearly different distribution here.
TOPK_TOPP = SamplingParams(temperature=1.0, top_k=3, top_p=0.7, speculative_sampling="residual")


def assert_exercises_both_paths(acceptance_rate: float) -> None:
    """The runs must see acceptances and rejections alike, or the test proves little."""
    assert 0.05 < acceptance_rate < 0.95, acceptance_rate


def pipelined(engine: SpeculativeEngine) -> SpeculativeEngine:
    """The in-process engine with the scheduler's pre-drafting on (the Ray engine does it with a draft
    worker of its own; here the draft runs in the same thread, which exercises the same code)."""
    draft = engine.scheduler.draft
    draft.capabilities = dataclasses.replace(draft.capabilities, concurrent=True, pipeline=True)
    return engine


def run(pair, draft: str, k: int, params: SamplingParams, first: int, max_tokens: int, pipeline: bool = False,
        num_samples: int = NUM_SAMPLES, **engine_kwargs):
    target, draft_model = pair
    engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft_model) if draft == "model" else draft,
                                               num_speculative_tokens=k, max_batch_size=BATCH, **engine_kwargs)
    if pipeline:
        pipelined(engine)
    exact = exact_pair_distribution(engine.target_model.model, params, first=first)
    counts, acceptance_rate, hits = sample_pair(engine, params, max_tokens, num_samples, first=first)
    assert max(engine.scheduler.batch_sizes) > 1  # sampled inside batches
    return chi_square_pvalue(counts, exact), acceptance_rate, hits


#: (sampling, K, first token tested, max_tokens): the bonus token of K=1, K=2 under each warping,
#: and tokens 2-3 of K=3 steps.
CASES = [
    pytest.param(T1, 1, 0, 2, id="T1-K1-bonus"),
    pytest.param(T1, 2, 0, 3, id="T1-K2"),
    pytest.param(T1, 3, 2, 4, id="T1-K3-tokens2,3"),
    pytest.param(SamplingParams(temperature=0.7, top_k=4, speculative_sampling="residual"), 2, 0, 3,
                 id="T0.7-topk4-K2"),
    pytest.param(SamplingParams(temperature=1.0, top_p=0.8, speculative_sampling="residual"), 2, 0, 3,
                 id="T1-topp0.8-K2"),
    pytest.param(TOPK_TOPP, 2, 0, 3, id="T1-topk3-topp0.7-K2"),
    pytest.param(T1_INVARIANT, 2, 0, 3, id="invariant-T1-K2"),
    pytest.param(T1_INVARIANT, 3, 2, 4, id="invariant-T1-K3-tokens2,3"),
    pytest.param(TOPK_TOPP.replace(speculative_sampling="invariant"), 2, 0, 3, id="invariant-topk3-topp0.7-K2"),
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


@pytest.mark.parametrize("engine_kwargs", [
    pytest.param({"prompt_lookup_min": 1}, id="hybrid"),
    pytest.param({"draft_precision": "int8"}, id="int8"),
    pytest.param({"draft_precision": "bfloat16"}, id="bfloat16"),
])
def test_other_drafts_sample_the_target(small_vocab_pair, engine_kwargs):
    pvalue, acceptance_rate, _ = run(small_vocab_pair, "model", 2, T1, 0, 3, **engine_kwargs)
    assert_exercises_both_paths(acceptance_rate)
    assert pvalue > 1e-3


def test_target_only_invariant_sampling_follows_the_target(small_vocab_pair):
    pvalue, _, _ = run(small_vocab_pair, "none", 1, T1_INVARIANT, 2, 4)
    assert pvalue > 1e-3


def as_unseeded(monkeypatch) -> None:
    """Treat the test's seeded requests as the engine treats unseeded ones (seeded residual rows do
    not pipeline: `Scheduler._pin`), keeping the test deterministic."""
    monkeypatch.setattr(specdec.engine.scheduler.Scheduler, "_pin", staticmethod(lambda sampling, seeded, policy:
                                                                          (False, policy)))


def test_pipelined_sampling_matches_target(small_vocab_pair, monkeypatch):
    as_unseeded(monkeypatch)
    pvalue, acceptance_rate, hits = run(small_vocab_pair, "model", 2, T1, 3, 6, pipeline=True)
    assert hits > NUM_SAMPLES // 5  # tokens 3-4 often come from a used pre-drafted block
    assert_exercises_both_paths(acceptance_rate)
    assert pvalue > 1e-3


def _shifted_block(early: Proposal) -> Proposal:
    return Proposal(early.token_ids[1:], early.probs[:-1] if early.probs is not None else None)


def _correlated_uniform(seed, purpose, position, _uniform=specdec.decoding.sampling.uniform):
    return _uniform(seed, "accept", position)  # the draft's, the acceptance's and the resample's numbers are one


def _top_p_then_top_k(logits, params, _warp=specdec.decoding.sampling.warp_logits):
    scores = _warp(logits, params.replace(top_k=0))
    return _warp(scores, params.replace(top_p=1.0, temperature=1.0))


def _neighbours_q(propose_batch=DraftModelProposer.propose_batch):
    def broken(self, *args, **kwargs):
        proposals = propose_batch(self, *args, **kwargs)
        sampled = [p for p in proposals if p.probs is not None]
        rows = [p.probs for p in sampled]
        for p, probs in zip(sampled, rows[1:] + rows[:1]):  # each row gets the next row's q
            if probs.shape == p.probs.shape:
                p.probs = probs
        return proposals
    return broken


def _noise_shared_across_positions(seed, position, token_ids, _noise=specdec.decoding.sampling.gumbel_noise):
    return _noise(seed, 0, token_ids)


BUGS = {
    # The classic bug: on rejection, draw from p instead of normalize(max(0, p - q)).
    "resample_from_target": (specdec.decoding.verify, "recovered_distribution", lambda p, q: p),
    "accept_always": (specdec.decoding.verify, "accept_probability", lambda p, q: torch.ones_like(p)),
    "bonus_from_row_k-1": (specdec.decoding.verify, "bonus_distribution", lambda row, k: row(k - 1)),
    "predraft_q_shifted": (specdec.engine.scheduler, "pre_drafted_block", _shifted_block),
    "draft_verify_correlated": [(specdec.decoding.sampling, "uniform", _correlated_uniform),
                                (specdec.decoding.verify, "uniform", _correlated_uniform)],
    "topp_before_topk": [(specdec.decoding.sampling, "warp_logits", _top_p_then_top_k),
                         (specdec.decoding.verify, "warp_logits", _top_p_then_top_k)],
    "q_from_batch_neighbour": (DraftModelProposer, "propose_batch", _neighbours_q()),
    "noise_shared_across_positions": (specdec.decoding.sampling, "gumbel_noise", _noise_shared_across_positions),
}


@pytest.mark.parametrize("bug, draft, k, first, max_tokens, pipeline", [
    pytest.param("resample_from_target", "model", 2, 0, 3, False, id="resample_from_target"),
    pytest.param("accept_always", "model", 2, 0, 3, False, id="accept_always"),
    pytest.param("resample_from_target", "ngram", 2, 0, 3, False, id="ngram_residual_is_p"),
    pytest.param("bonus_from_row_k-1", "model", 1, 0, 2, False, id="bonus_from_row_k-1"),
    pytest.param("predraft_q_shifted", "model", 2, 3, 6, True, id="predraft_q_shifted"),
    pytest.param("draft_verify_correlated", "model", 2, 0, 3, False, id="draft_verify_correlated"),
    pytest.param("topp_before_topk", "model", 2, 0, 3, False, id="topp_before_topk"),
    pytest.param("q_from_batch_neighbour", "model", 2, 0, 3, False, id="q_from_batch_neighbour"),
    pytest.param("noise_shared_across_positions", "none", 1, 2, 4, False, id="invariant_noise_shared"),
])
def test_subtle_bugs_are_detected(small_vocab_pair, monkeypatch, bug, draft, k, first, max_tokens, pipeline):
    """Negative controls: the same test on a deliberately broken step must fail."""
    patches = BUGS[bug] if isinstance(BUGS[bug], list) else [BUGS[bug]]
    if pipeline:
        as_unseeded(monkeypatch)
    for module, name, broken in patches:
        monkeypatch.setattr(module, name, broken)
    params = {"topp_before_topk": TOPK_TOPP, "noise_shared_across_positions": T1_INVARIANT}.get(bug, T1)
    try:
        # The shifted block only matters on pipeline hits: more samples give that control its power.
        pvalue, _, hits = run(small_vocab_pair, draft, k, params, first, max_tokens, pipeline,
                              num_samples=2 * NUM_SAMPLES if pipeline else NUM_SAMPLES)
    except AssertionError as e:  # a pair the target never produces: caught before the chi-square
        assert "probability 0" in str(e), e
        return
    if pipeline:
        assert hits > NUM_SAMPLES // 5
    assert pvalue < 1e-6


@pytest.mark.parametrize("params, k, first, max_tokens", [
    pytest.param(T1, 2, 0, 3, id="residual-K2"),
    pytest.param(T1_INVARIANT, 3, 2, 4, id="invariant-K3-tokens2,3"),
])
def test_int4_target_and_draft_sample_the_int4_target(small_vocab_pair, params, k, first, max_tokens):
    """At int4 the target is its int4 modules (the exact distribution is computed from them): a
    rounded-to-nearest int4 target and draft keep it, residual and invariant."""
    pvalue, acceptance_rate, _ = run(small_vocab_pair, "model", k, params, first, max_tokens,
                                     target_precision="int4", draft_precision="int4")
    assert_exercises_both_paths(acceptance_rate)
    assert pvalue > 1e-3
