"""Batched speculative decoding keeps every promise of one request alone: each request's greedy tokens
equal HF `generate()` for that prompt alone whatever else is in the batch (prompts of different
lengths, requests joining and leaving mid-batch, K = 1, 4, auto), seeded sampling is bit-identical
alone and batched, every row's cache holds exactly its committed tokens after each step, and a bad
or cancelled request leaves the others untouched."""

import threading

import pytest
import torch

from specdec import SamplingParams, SpeculativeEngine
from specdec.kernels.linear import stock_linears
from specdec.engine.request import GenerationRequest

# Different lengths (1 to 19 tokens) and contents, so a row mix-up changes someone's output.
PROMPTS = [[5, 6, 7, 8, 9], [3], [10, 20, 30, 10, 20, 30, 10, 20], [40, 41], list(range(50, 69)), [7, 7, 7, 7]]
MAX_TOKENS = [40, 12, 33, 25, 40, 7]  # requests leave the batch at different steps


def hf_greedy(model, prompt, max_new_tokens):
    with torch.no_grad(), stock_linears(model):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    return request.getfixturevalue(f"tiny_{request.param}"), request.getfixturevalue(f"tiny_{request.param}_draft")


@pytest.fixture(scope="module")
def references(pair):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32).eval()
    return [hf_greedy(model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]


def requests(**overrides):
    return [GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(max_tokens=n), **overrides)
            for p, n in zip(PROMPTS, MAX_TOKENS)]


@pytest.mark.parametrize("k", [1, 4, "auto"])
def test_batched_greedy_equals_hf_generate_alone(pair, references, k):
    target, draft = pair
    # A batch of 3 for 6 requests: the rest wait, and join as others finish.
    engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=k,
                                               max_batch_size=3)
    outs = engine.generate_batch(requests())
    for out, expected in zip(outs, references):
        assert out.token_ids == expected
    sizes = engine.scheduler.batch_sizes
    assert max(sizes) == 3 and min(sizes) < 3  # batched, and the batch shrank and refilled
    assert sum(o.speculative.num_accepted_tokens for o in outs) > 0
    assert len(engine.target_pool) == len(engine.draft_pool) == 0  # every cache freed


def test_ngram_and_target_only_batches_equal_hf_generate(pair, references):
    target, _ = pair
    for draft in ("ngram", "none"):
        engine = SpeculativeEngine.from_pretrained(str(target), draft=draft, num_speculative_tokens=3)
        outs = engine.generate_batch(requests())
        assert [o.token_ids for o in outs] == references
        assert max(engine.scheduler.batch_sizes) == len(PROMPTS)


def test_mixed_k_per_request_in_one_batch(pair, references):
    target, draft = pair
    engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=4)
    reqs = requests()
    for r, k in zip(reqs, [1, 0, 4, "auto", 2, 8]):
        r.num_speculative_tokens = k
    outs = engine.generate_batch(reqs)
    assert [o.token_ids for o in outs] == references
    assert outs[1].speculative.num_draft_tokens == 0  # K=0: target-only inside a speculating batch


def test_requests_join_a_running_batch_from_threads(pair, references):
    """Concurrent generate() calls share the scheduler: a long request runs while others arrive."""
    target, draft = pair
    engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=4)
    results = {}
    first = engine.generate_stream(prompt_token_ids=PROMPTS[0], sampling=SamplingParams(max_tokens=MAX_TOKENS[0]))
    tokens = list(next(first).token_ids)  # the first request is running

    def run(i):
        results[i] = engine.generate(prompt_token_ids=PROMPTS[i], sampling=SamplingParams(max_tokens=MAX_TOKENS[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(1, len(PROMPTS))]
    for t in threads:
        t.start()
    for chunk in first:
        tokens += chunk.token_ids
    for t in threads:
        t.join()
    assert tokens == references[0]
    assert {i: results[i].token_ids for i in results} == {i: references[i] for i in range(1, len(PROMPTS))}
    assert max(engine.scheduler.batch_sizes) > 1


def test_each_row_cache_holds_its_committed_length_at_every_step(pair):
    target, draft = pair
    engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=4)
    streams = [engine.generate_stream(r) for r in requests()]
    checked = 0
    for prompt, stream in zip(PROMPTS, streams):
        committed = len(prompt)
        for chunk in stream:
            # When the step's forward began the target cache held every committed token but the last
            # (the step's first input): what the step before rejected was dropped.
            assert chunk.cache_lengths == [committed - 1]
            committed += len(chunk.token_ids)
            checked += 1
    assert checked > 20


def test_seeded_sampling_is_identical_alone_and_in_a_batch(pair):
    """With a full-precision draft. An int8 draft's dynamic quantization scales each linear's input
    over the whole batch, so its proposals (never the output's distribution) depend on batch-mates."""
    target, draft = pair
    engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=3,
                                               draft_precision="none")
    params = [SamplingParams(temperature=1.0, top_k=20, seed=s, max_tokens=30) for s in range(len(PROMPTS))]
    alone = [engine.generate(prompt_token_ids=p, sampling=s).token_ids for p, s in zip(PROMPTS, params)]
    batched = engine.generate_batch([GenerationRequest(prompt_token_ids=p, sampling=s)
                                     for p, s in zip(PROMPTS, params)])
    assert [o.token_ids for o in batched] == alone
    assert len(set(map(tuple, alone))) == len(alone)


def test_bad_and_cancelled_requests_leave_the_batch_alone(pair, references):
    target, draft = pair
    engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=4)
    with pytest.raises(ValueError, match="prompt token ids must be integers"):
        engine.generate_batch(requests()[:2] + [GenerationRequest(prompt_token_ids=[10_000])])
    streams = [engine.generate_stream(r) for r in requests()]
    next(streams[1])
    streams[1].close()  # cancelled mid-batch: its caches are freed, the others go on
    for i, stream in enumerate(streams):
        if i != 1:
            assert [t for c in stream for t in c.token_ids] == references[i]
    assert len(engine.target_pool) == len(engine.draft_pool) == 0


def test_a_proposal_that_fails_turns_its_own_row_target_only_not_the_batch(pair, references, monkeypatch):
    """A row whose drafting raises (here: the proposer fails on any context holding prompt 4's first
    token) goes on target-only with its output unchanged; the rows batched with it keep drafting."""
    engine = SpeculativeEngine.from_pretrained(str(pair[0]), draft=str(pair[1]), num_speculative_tokens=4,
                                               draft_precision="none")
    marker = PROMPTS[4][0]
    assert all(marker not in p for i, p in enumerate(PROMPTS) if i != 4)
    real = engine.proposer.propose_batch

    def failing(states, contexts, *args, **kwargs):
        if any(marker in c for c in contexts):
            raise RuntimeError("this row's input breaks the draft")
        return real(states, contexts, *args, **kwargs)

    monkeypatch.setattr(engine.proposer, "propose_batch", failing)
    outs = engine.generate_batch(requests())
    assert [o.token_ids for o in outs] == references
    assert outs[4].speculative.draft_failures == 1 and outs[4].speculative.num_draft_tokens == 0
    for i, out in enumerate(outs):
        if i != 4:
            assert out.speculative.draft_failures == 0 and out.speculative.num_draft_tokens > 0, i
    # Negative control: the same failure without per-row isolation turns every row target-only.
    monkeypatch.setattr(engine.draft_pool, "propose", engine.draft_pool._propose)
    outs = engine.generate_batch(requests())
    assert [o.token_ids for o in outs] == references
    assert sum(o.speculative.draft_failures > 0 for o in outs) > 1
