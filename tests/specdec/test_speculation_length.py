"""Choosing K: the cost model and the auto-K policy."""

import pytest

from specdec import SamplingParams, SpeculativeEngine
from specdec.decoding.speculation_length import BASELINE_SAMPLES, AutoK, CostModel, expected_tokens, theoretical_speedup


def test_expected_tokens_and_speedup_formula():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    # Leviathan et al. (2023), eq. 1 with alpha=0.8, K=4, c=0.05: ~2.8x
    assert theoretical_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8**5) / (0.2 * 1.2))


def test_target_cost_interpolates_and_extrapolates():
    costs = CostModel()
    assert costs.target_cost(3) is None
    costs.observe_target(1, 9.0)  # the first call at a size is a warm-up: dropped
    assert costs.target_cost(1) is None
    costs.observe_target(1, 1.0)
    assert costs.target_cost(5) == 1.0  # one point: flat until measured
    costs.observe_target(5, 30.0)
    costs.observe_target(5, 3.0)
    assert costs.target_cost(3) == pytest.approx(2.0)
    assert costs.target_cost(9) == pytest.approx(5.0)


def test_cost_estimates_ignore_contention_bursts():
    """Noise only adds time: a burst while timing one size must not make drafting look cheap."""
    costs = CostModel(window=4)
    for n in (1, 1, 5, 5):
        costs.observe_target(n, 1.0 if n == 1 else 1.2)
    for _ in range(3):
        costs.observe_target(1, 25.0)  # a busy neighbour during three plain steps
    assert costs.target_cost(1) == 1.0
    for _ in range(4):
        costs.observe_target(1, 2.0)  # a real, lasting change is followed within the window
    assert costs.target_cost(1) == 2.0
    policy = AutoK(costs, speculative_tokens_limit=4)
    costs.observe_draft(1, 0.5)
    costs.observe_draft(1, 0.5)
    for _ in range(10):
        policy.observe(4, 0)
    assert policy.best_k() == 0


def measured(t1=1.0, slope=0.05, draft=0.05):
    costs = CostModel()
    for _ in range(1 + BASELINE_SAMPLES):  # the first observation of each size is a warm-up
        for n in (1, 5):
            costs.observe_target(n, t1 + slope * (n - 1))
        costs.observe_draft(1, draft)
    return costs


def test_the_baseline_is_measured_several_times_before_any_k_is_weighed_against_it():
    """One plain step slowed by contention must not make drafting look worth it for the rest of a
    request (a request alone stops timing plain steps once it drafts)."""
    costs = CostModel()
    costs.observe_target(1, 1.0)  # warm-up, dropped
    costs.observe_target(1, 9.0)  # contention: 9x the real cost
    costs.observe_target(5, 1.2)
    costs.observe_target(5, 1.2)
    costs.observe_draft(1, 0.3)
    costs.observe_draft(1, 0.3)
    policy = AutoK(costs, speculative_tokens_limit=4)
    for _ in range(20):
        policy.observe(4, 0)  # a useless draft
    assert policy.best_k() == 0  # one baseline sample: measure again
    assert policy.rate(1) > policy.rate(0)  # what the contended sample alone would have chosen
    for _ in range(BASELINE_SAMPLES - 1):
        costs.observe_target(1, 1.0)
    assert policy.best_k() == 0  # the quiet minimum: drafting does not pay


def test_good_draft_speculates_deeply():
    policy = AutoK(measured(), speculative_tokens_limit=8)
    for _ in range(30):
        policy.observe(8, 8)
    assert policy.next_k() >= 6


def test_hopeless_draft_falls_back_to_target_only_and_probes_with_backoff():
    policy = AutoK(measured(draft=0.9), speculative_tokens_limit=8)
    for _ in range(10):
        policy.observe(4, 0)
    ks = [policy.next_k() for _ in range(100)]
    probes = [i for i, k in enumerate(ks) if k > 0]
    assert ks[0] == 0
    assert 1 <= len(probes) <= 5  # intervals double: 8, 16, 32, 64
    assert all(b - a > 8 for a, b in zip(probes[1:], probes[2:]))


def test_draft_call_overhead_is_paid_once_per_drafting_step():
    """A remote draft's round trip is a fixed cost of drafting at all, not a per-token one: it must
    not inflate c (which would shorten K), but it can make marginal drafting not worth it."""
    policy = AutoK(measured(draft=0.05), speculative_tokens_limit=8)
    for _ in range(30):
        policy.observe(8, 6)  # acceptance ~0.75 per position
    k_local = policy.best_k()
    for _ in range(2):
        policy.costs.observe_draft_call(0.05)
    assert policy.costs.draft_seconds == 0.05 and policy.costs.draft_call_seconds == 0.05
    assert policy.best_k() >= k_local - 1 > 0  # a round trip per step barely changes the best K
    policy.costs.draft_call_samples.clear()
    policy.costs.observe_draft_call(5.0)  # a call slower than the tokens it could save
    assert policy.best_k() == 0


def test_expensive_verify_prefers_short_proposals():
    cheap = AutoK(measured(slope=0.0), speculative_tokens_limit=8)
    costly = AutoK(measured(slope=0.8), speculative_tokens_limit=8)
    for policy in (cheap, costly):
        for _ in range(20):
            policy.observe(4, 3)
    assert costly.best_k() < cheap.best_k()


def test_engine_with_unrelated_draft_falls_back(tiny_llama, tiny_llama_unrelated):
    """An unrelated random draft (same vocabulary, independent weights): auto K stops drafting."""
    engine = SpeculativeEngine.from_pretrained(str(tiny_llama), draft=str(tiny_llama_unrelated),
                                               num_speculative_tokens="auto")
    out = engine.generate(prompt_token_ids=[5, 6, 7, 8, 9], sampling=SamplingParams(max_tokens=120, ignore_eos=True))
    history = out.k_history
    assert history[:2] == [0, 0]  # measures plain decoding first (the first timing is a warm-up)
    assert sum(1 for k in history[len(history) // 2:] if k == 0) >= 0.8 * (len(history) - len(history) // 2)


def test_auto_k_learns_a_staircase_verify_curve():
    """The int4 kernel works in blocks of 4 rows: a 4-token verify costs little more than 1, a 5-token
    one twice that. Measured at 1 and 5 tokens only, a straight line overprices K=3 and auto-K picks
    a deeper K; trying the verify sizes whose estimates come close, it settles on K=3."""
    def cost(n: int) -> float:
        return 1.0 + (0.05 if n > 1 else 0.0) + (1.0 if n > 4 else 0.0) + 0.05 * max(0, n - 5)

    costs = CostModel()
    for _ in range(1 + BASELINE_SAMPLES):
        for n in (1, 5):
            costs.observe_target(n, cost(n))
        costs.observe_draft(1, 0.05)
    policy = AutoK(costs, speculative_tokens_limit=8)
    policy.accepted, policy.reached = [9.0] * 8, [10.0] * 8  # acceptance 0.9 at every position
    assert policy.best_k() > 3  # the control: what the straight line alone chooses
    chosen = []
    for _ in range(24):
        k = policy.next_k()
        chosen.append(k)
        costs.observe_target(k + 1, cost(k + 1))
        costs.observe_draft(1, 0.05)
    assert chosen[-3:] == [3, 3, 3], chosen
    assert set(chosen) | {4} == set(range(1, 9))  # every untimed verify size tried, then settled (5 was timed)
