"""KV cache rewind: after cropping, the cache equals the cache of recomputing the kept prefix."""

import pytest
import torch

from specdec import SamplingParams
from specdec.models.model_runner import ModelRunner
from specdec.models.loading import load_model
from specdec.decoding.proposers import DraftModelProposer


def assert_caches_close(a, b):
    assert len(a) == len(b) == a.layers[0].length == b.layers[0].length
    for la, lb in zip(a.layers, b.layers):
        torch.testing.assert_close(la.keys, lb.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(la.values, lb.values, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def runner(tiny_llama):
    return ModelRunner(load_model(str(tiny_llama)))


def test_rewind_equals_recompute(runner):
    committed = [4, 8, 15, 16, 23]
    speculative = [42, 7, 7]
    cache = runner.new_cache()
    runner.forward([cache], [committed[:3]], [1])
    runner.forward([cache], [committed[3:] + speculative], [5])  # a verify step with rejects
    cache.rewind(len(committed))
    fresh = runner.new_cache()
    runner.forward([fresh], [committed], [1])
    assert cache.token_ids == committed
    assert_caches_close(cache, fresh)
    # And the rewound cache continues exactly like a fresh one.
    torch.testing.assert_close(runner.forward([cache], [[1, 2]], [2])[0], runner.forward([fresh], [[1, 2]], [2])[0],
                               rtol=1e-5, atol=1e-5)


def test_rewind_to_prefix_of_keeps_common_prefix(runner):
    cache = runner.new_cache()
    runner.forward([cache], [[1, 2, 3, 4, 5]], [1])
    assert cache.rewind_to_prefix_of([1, 2, 3, 9, 9, 9]) == 3
    assert cache.token_ids == [1, 2, 3] and all(layer.length == 3 for layer in cache.layers)


def test_rewind_out_of_range_raises(runner):
    cache = runner.new_cache()
    runner.forward([cache], [[1, 2]], [1])
    with pytest.raises(ValueError, match="cannot rewind"):
        cache.rewind(3)


def test_draft_catches_up_without_recompute(runner):
    """After a verify step the draft holds the committed prefix and feeds only what it has not seen."""
    proposer = DraftModelProposer(runner)
    state = proposer.new_state()
    greedy = SamplingParams()
    context = [4, 8, 15, 16]
    proposal = proposer.propose(state, context, 4, greedy)
    assert len(proposal) == 4 and proposal.num_catchup_tokens == 3  # the prompt, minus its last token
    assert state.token_ids == context + proposal.token_ids[:3]
    # The target accepted 2 and emitted a different third token.
    committed = context + proposal.token_ids[:2] + [(proposal.token_ids[2] + 1) % 96]
    proposer.rewind(state, committed)
    assert state.token_ids == context + proposal.token_ids[:2]
    proposal2 = proposer.propose(state, committed, 2, greedy)
    assert proposal2.num_catchup_tokens == 0  # only the new token is fed, with the first draft step
    fresh = runner.new_cache()
    runner.forward([fresh], [committed + proposal2.token_ids[:1]], [1])
    assert_caches_close(state, fresh)


def test_draft_proposal_reports_the_tokens_its_rewind_dropped(runner):
    """What the draft's cache dropped (rejected proposals) and holds: the draft's KV metrics."""
    proposer = DraftModelProposer(runner)
    state, greedy = proposer.new_state(), SamplingParams(temperature=0.0)
    context = [4, 8, 15, 16]
    first = proposer.propose(state, context, 4, greedy)
    assert first.rewound_tokens == 0 and first.cache_tokens == len(context) + 3  # the last proposal is not fed
    # The target accepted two proposals and repaired the third: the cache drops the third.
    repaired = (first.token_ids[2] + 1) % 96
    second = proposer.propose(state, context + first.token_ids[:2] + [repaired], 4, greedy)
    assert second.rewound_tokens == 1 and second.cache_tokens == len(context) + 3 + 3
