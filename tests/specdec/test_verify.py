"""Verification on handmade distributions: the accept/recover/bonus rules, masks and seeding, for
the residual rule (`verify_sampled`) and the drafter-invariant one (`verify_invariant`)."""

import pytest
import torch
from scipy import stats

from specdec.config import SamplingParams
from specdec.decoding import sampling
from specdec.decoding.sampling import logits_to_probs
from specdec.decoding.verify import verify_greedy, verify_proposal, verify_sampled

V = 6


def one_hot_logits(ids):
    logits = torch.full((len(ids), V), -5.0)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 5.0
    return logits


def test_greedy_perfect_match_emits_bonus():
    result = verify_greedy([1, 2, 3], one_hot_logits([1, 2, 3, 4]))
    assert result.num_accepted == 3 and result.all_accepted
    assert result.token_ids == [1, 2, 3, 4]


def test_greedy_early_mismatch_recovers_target_token():
    result = verify_greedy([1, 5, 3], one_hot_logits([1, 2, 3, 4]))
    assert result.num_accepted == 1 and not result.all_accepted
    assert result.token_ids == [1, 2]


def test_greedy_first_token_mismatch():
    result = verify_greedy([0, 2], one_hot_logits([1, 2, 3]))
    assert result.token_ids == [1] and result.num_accepted == 0


def test_greedy_empty_draft_is_plain_decoding():
    result = verify_greedy([], one_hot_logits([4]))
    assert result.token_ids == [4] and result.num_proposed == 0


def test_sampled_identical_distributions_accept_everything():
    p = torch.softmax(torch.randn(4, V, generator=torch.Generator().manual_seed(0)), -1)
    for seed in range(50):
        result = verify_sampled([1, 2, 3], p[:3].clone(), p, seed, 0)
        assert result.num_accepted == 3 and len(result.token_ids) == 4


def test_sampled_rejects_token_target_cannot_produce():
    p = torch.full((3, V), 1.0 / (V - 1))
    p[:, 0] = 0.0  # the target never produces token 0
    q = torch.full((2, V), 1.0 / V)
    for seed in range(50):
        result = verify_sampled([0, 0], q, p, seed, 0)
        assert result.num_accepted == 0
        assert result.token_ids[0] != 0  # recovered from max(0, p - q), which has no mass at 0


def test_sampled_one_hot_draft_never_recovers_the_rejected_token():
    p = torch.softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(1)), -1)
    for seed in range(200):
        result = verify_sampled([2, 3], None, p, seed, 0)
        if result.num_accepted == 0:
            assert result.token_ids[0] != 2
        elif result.num_accepted == 1:
            assert result.token_ids[1] != 3


def test_sampled_empty_draft_samples_target():
    p = torch.zeros(1, V)
    p[0, 4] = 1.0
    assert verify_sampled([], None, p, 0, 0).token_ids == [4]


def test_seeded_verification_is_deterministic():
    p = torch.softmax(torch.randn(5, V, generator=torch.Generator().manual_seed(2)), -1)
    q = torch.softmax(torch.randn(4, V, generator=torch.Generator().manual_seed(3)), -1)
    runs = [verify_sampled([1, 2, 3, 4], q, p, 7, 0).token_ids for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    outcomes = {tuple(verify_sampled([1, 2, 3, 4], q, p, s, 0).token_ids) for s in range(50)}
    assert len(outcomes) > 1


@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(temperature=1.0, top_k=2), {0, 1}),
    (SamplingParams(temperature=1.0, top_p=0.5), {0}),
    (SamplingParams(temperature=0.5, top_p=0.9), {0, 1}),
])
def test_top_k_top_p_masks_respected(params, allowed):
    # Target logits prefer 0 > 1 > 2 > ...; the draft proposes tokens outside the mask.
    base = torch.tensor([3.0, 2.5, 1.0, 0.5, 0.0, -1.0])
    target_logits = base.repeat(3, 1)
    target_probs = logits_to_probs(target_logits, params)
    assert set(torch.nonzero(target_probs[0]).flatten().tolist()) == allowed
    draft_probs = torch.full((2, V), 1.0 / V)
    seen = set()
    for seed in range(300):
        result = verify_proposal([5, 4], draft_probs, target_logits, params.replace(seed=seed, speculative_sampling="residual"), 0)
        seen.update(result.token_ids)
    assert seen <= allowed and seen == allowed


def test_first_token_follows_target_distribution():
    """Many single-step verifications: the first output token is distributed as p, not q."""
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(1, V, generator=g) * 1.5, -1)
    n = 6000
    draws = torch.multinomial(q[0], n, replacement=True, generator=g).tolist()
    counts = torch.zeros(V)
    for seed, x in enumerate(draws):
        counts[verify_sampled([x], q, p, seed, 0).token_ids[0]] += 1
    assert stats.chisquare(counts.numpy(), (p[0] * n).numpy()).pvalue > 1e-3
    # and it is far from the draft's distribution (the check has power)
    assert stats.chisquare(counts.numpy(), (q[0] * n).numpy()).pvalue < 1e-6


# ------------------------------------------------------------------ counter-based randomness

def _splitmix_reference(key: int, index: int) -> float:
    """SplitMix64 in plain Python integers (the published algorithm), as a Gumbel sample."""
    import math

    mask = (1 << 64) - 1
    z = (key + (index + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return -math.log(-math.log(((z >> 11) + 0.5) * 2.0**-53))


def test_gumbel_noise_is_splitmix64_of_the_counter_key():
    ids = torch.tensor([0, 1, 7, 151935])
    got = sampling.gumbel_noise(123, 45, ids).tolist()
    key = sampling.counter_key(123, "noise", 45)
    assert got == [_splitmix_reference(key, int(i)) for i in ids]
    # a subset of the vocabulary gets the numbers the full vocabulary would
    full = sampling.gumbel_noise(123, 45, torch.arange(200))
    assert torch.equal(full[torch.tensor([3, 150])], sampling.gumbel_noise(123, 45, torch.tensor([3, 150])))


def test_counter_keys_differ_by_seed_purpose_and_position():
    keys = {sampling.counter_key(seed, purpose, position)
            for seed in range(3) for purpose in sampling.PURPOSES for position in range(50)}
    assert len(keys) == 3 * len(sampling.PURPOSES) * 50
    with pytest.raises(ValueError, match="unknown random purpose"):
        sampling.counter_key(0, "verify", 0)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),  # a sparse support: noise for the support only
    SamplingParams(temperature=1.0, top_k=4, top_p=0.8),
])
def test_gumbel_argmax_draws_from_the_warped_distribution(params):
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.2, -0.5, -1.0] + [-3.0] * 26])  # 32 columns
    probs = logits_to_probs(logits, params)[0].double()
    probs = probs / probs.sum()
    scores = sampling.warp_logits(logits, params)[0]
    n = 6000
    counts = torch.zeros(32, dtype=torch.float64)
    for position in range(n):
        counts[sampling.gumbel_argmax(scores, 11, position)] += 1
    support = probs > 0
    assert counts[~support].sum() == 0
    assert stats.chisquare(counts[support].numpy(), (probs[support] * n).numpy()).pvalue > 1e-3


def test_inverse_cdf_draw_skips_zero_probability_tokens():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    assert {sampling.draw(probs, u) for u in (1e-12, 0.25, 0.4999, 0.5001, 1 - 1e-12)} == {1, 3}


def test_invariant_verification_emits_the_target_only_tokens_whatever_the_proposal():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, V, generator=g)
    params = SamplingParams(temperature=1.0, seed=3, speculative_sampling="invariant")
    scores = sampling.warp_logits(logits, params)
    target_only = [sampling.gumbel_argmax(scores[j], 3, 10 + j) for j in range(5)]
    for proposal in ([], target_only[:4], target_only[:2] + [(target_only[2] + 1) % V, 0], [0, 1, 2, 3]):
        result = verify_proposal(proposal, None, logits[: len(proposal) + 1], params, 10)
        assert result.token_ids == target_only[: len(result.token_ids)]
        n = result.num_accepted
        assert proposal[:n] == target_only[:n] and (n == len(proposal) or proposal[n] != target_only[n])
