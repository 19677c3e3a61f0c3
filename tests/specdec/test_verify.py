"""Verification on handmade distributions: the accept/recover/bonus rules, masks and seeding."""

import pytest
import torch
from scipy import stats

from specdec.config import SamplingParams
from specdec.sampling import logits_to_probs, make_generator
from specdec.verify import verify_greedy, verify_proposal, verify_sampled

V = 6


def one_hot_logits(ids):
    logits = torch.full((len(ids), V), -5.0)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 5.0
    return logits


def gen(seed=0):
    return make_generator(seed, "verify")


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
        result = verify_sampled([1, 2, 3], p[:3].clone(), p, gen(seed))
        assert result.num_accepted == 3 and len(result.token_ids) == 4


def test_sampled_rejects_token_target_cannot_produce():
    p = torch.full((3, V), 1.0 / (V - 1))
    p[:, 0] = 0.0  # the target never produces token 0
    q = torch.full((2, V), 1.0 / V)
    for seed in range(50):
        result = verify_sampled([0, 0], q, p, gen(seed))
        assert result.num_accepted == 0
        assert result.token_ids[0] != 0  # recovered from max(0, p - q), which has no mass at 0


def test_sampled_one_hot_draft_never_recovers_the_rejected_token():
    p = torch.softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(1)), -1)
    for seed in range(200):
        result = verify_sampled([2, 3], None, p, gen(seed))
        if result.num_accepted == 0:
            assert result.token_ids[0] != 2
        elif result.num_accepted == 1:
            assert result.token_ids[1] != 3


def test_sampled_empty_draft_samples_target():
    p = torch.zeros(1, V)
    p[0, 4] = 1.0
    assert verify_sampled([], None, p, gen()).token_ids == [4]


def test_seeded_verification_is_deterministic():
    p = torch.softmax(torch.randn(5, V, generator=torch.Generator().manual_seed(2)), -1)
    q = torch.softmax(torch.randn(4, V, generator=torch.Generator().manual_seed(3)), -1)
    runs = [verify_sampled([1, 2, 3, 4], q, p, gen(7)).token_ids for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    outcomes = {tuple(verify_sampled([1, 2, 3, 4], q, p, gen(s)).token_ids) for s in range(50)}
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
        result = verify_proposal([5, 4], draft_probs, target_logits, params, gen(seed))
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
    verifier = gen(5)
    for x in draws:
        counts[verify_sampled([x], q, p, verifier).token_ids[0]] += 1
    assert stats.chisquare(counts.numpy(), (p[0] * n).numpy()).pvalue > 1e-3
    # and it is far from the draft's distribution (the check has power)
    assert stats.chisquare(counts.numpy(), (q[0] * n).numpy()).pvalue < 1e-6
