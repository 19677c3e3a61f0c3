"""The prefix cache and the KV budget (`specdec/models/prefix_cache.py`, `specdec/engine/budget.py`):
a request that starts with what earlier requests computed prefills only the rest, and its output is
still HF `generate()`'s on the whole prompt; a small budget makes requests wait, never fail."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from specdec import SamplingParams, SpeculativeEngine
from specdec.engine.budget import OverBudget
from specdec.engine.request import GenerationRequest
from specdec.models.prefix_cache import BLOCK_TOKENS, PrefixCache
from tests.tiny_models import FAMILIES, hf_greedy_references, make_family_pair

#: A 40-token "system prompt" shared by every conversation, then turns of new tokens.
SYSTEM = [(7 * i) % 90 + 3 for i in range(40)]
NEW = 10
ROLLBACK = 12  # small, so sliding-window layers drop keys in these tests (as in test_families)


@pytest.fixture(autouse=True)
def small_rollback(monkeypatch):
    monkeypatch.setattr("specdec.models.kv_cache.ROLLBACK_TOKENS", ROLLBACK)


def _hf(model_dir, prompts, max_tokens):
    return hf_greedy_references(model_dir, prompts, max_tokens)


def _turns(engine, first_prompt, turns: int = 3, max_tokens: int = NEW, **kwargs):
    """A conversation: each turn's prompt is the last prompt, its answer and new tokens."""
    prompts, outs, prompt = [], [], list(first_prompt)
    for turn in range(turns):
        out = engine.generate(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=max_tokens), **kwargs)
        prompts.append(prompt)
        outs.append(out)
        prompt = prompt + out.token_ids + [(turn * 11 + j) % 90 + 4 for j in range(5)]
    return prompts, outs


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    target, draft = make_family_pair(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, target, draft


def test_greedy_with_cache_hits_equals_hf_generate_on_the_whole_prompt(family):
    """Every family (sliding windows whose prefix is longer than the window included): the turns of
    a conversation hit the cache, and each turn's output is HF's on its whole prompt; then the same
    turns batched, on a warm cache."""
    name, target, draft = family
    ks = (1, 4, "auto") if name in ("llama", "qwen2-sliding", "gemma2", "mistral") else (4,)
    for k in ks:
        engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=k,
                                                   max_batch_size=4)
        prompts, outs = _turns(engine, SYSTEM)
        for previous, out in zip(prompts, outs[1:]):  # each turn hits at least the turn before's prompt
            assert out.cached_tokens >= len(previous), (name, k, [o.cached_tokens for o in outs])
        references = _hf(target, prompts, NEW)
        assert [o.token_ids for o in outs] == references, (name, k)
        batched = engine.generate_batch([GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(max_tokens=NEW))
                                         for p in prompts])
        assert [o.token_ids for o in batched] == references, (name, k, "batched")
        assert all(o.cached_tokens == len(p) - 1 for o, p in zip(batched, prompts))  # the whole prompt cached


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_family_pair(tmp_path_factory.mktemp("prefix"), "qwen2")


def test_hits_at_every_boundary(pair):
    target, draft = pair
    engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=4)
    engine.generate(prompt_token_ids=SYSTEM + [5, 6, 7], sampling=SamplingParams(max_tokens=8))
    cases = {
        "whole prompt": SYSTEM + [5, 6, 7],  # all but its last token cached
        "mid-block": SYSTEM[:BLOCK_TOKENS + 5] + [88, 89, 90],  # a prefix ending mid-block
        "longer": SYSTEM + [5, 6, 7, 40, 41],  # the cached answer is part of it
    }
    outs = {case: engine.generate(prompt_token_ids=p, sampling=SamplingParams(max_tokens=8))
            for case, p in cases.items()}
    assert outs["whole prompt"].cached_tokens == len(cases["whole prompt"]) - 1
    assert outs["mid-block"].cached_tokens == BLOCK_TOKENS + 5
    assert outs["longer"].cached_tokens >= len(SYSTEM) + 3
    assert [o.token_ids for o in outs.values()] == _hf(target, list(cases.values()), 8)


def test_a_conversation_whose_answer_was_cut_by_a_stop_string(pair):
    """The first answer stops at a stop string (the tokens past it were computed, then cut): the next
    turn resends the answer up to the stop string and hits the cache up to there."""
    target, draft = pair
    engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=4)
    full = engine.generate(prompt_token_ids=SYSTEM, sampling=SamplingParams(max_tokens=12))
    stop_word = engine.tokenizer.decode([full.token_ids[6]])
    cut = engine.generate(prompt_token_ids=SYSTEM, sampling=SamplingParams(max_tokens=12, stop=[stop_word]))
    assert cut.finish_reason == "stop" and len(cut.token_ids) < len(full.token_ids)
    follow = SYSTEM + cut.token_ids + [30, 31, 32]
    out = engine.generate(prompt_token_ids=follow, sampling=SamplingParams(max_tokens=8))
    assert out.cached_tokens >= len(SYSTEM) + len(cut.token_ids)
    assert out.token_ids == _hf(target, [follow], 8)[0]


def test_a_request_hits_the_cache_of_one_still_running(pair):
    target, draft = pair
    engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=4)
    first = iter(engine.generate_stream(prompt_token_ids=SYSTEM, sampling=SamplingParams(max_tokens=400,
                                                                                        ignore_eos=True)))
    next(first)  # it is prefilled and decoding
    second = engine.generate(prompt_token_ids=SYSTEM + [9, 9, 9], sampling=SamplingParams(max_tokens=8))
    assert engine.scheduler.num_active == 1  # the first is still running
    assert second.cached_tokens >= len(SYSTEM) - 1
    assert second.token_ids == _hf(target, [SYSTEM + [9, 9, 9]], 8)[0]
    first.close()


def test_invariant_sampling_gives_the_same_text_with_and_without_a_hit(pair):
    target, draft = pair
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=20, speculative_sampling="invariant")
    cached = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=4)
    fresh = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=4,
                                              prefix_caching=False)
    prompt = SYSTEM + [11, 12]
    cached.generate(prompt_token_ids=SYSTEM + [1], sampling=SamplingParams(max_tokens=4))
    hit = cached.generate(prompt_token_ids=prompt, sampling=params)
    miss = fresh.generate(prompt_token_ids=prompt, sampling=params)
    assert hit.cached_tokens >= len(SYSTEM) and miss.cached_tokens == 0
    assert hit.token_ids == miss.token_ids


def test_a_salt_keeps_tenants_apart(pair):
    target, _ = pair
    engine = SpeculativeEngine.from_pretrained(str(target), draft="none")
    engine.generate(prompt_token_ids=SYSTEM, sampling=SamplingParams(max_tokens=4), cache_salt="tenant-a")
    other = engine.generate(prompt_token_ids=SYSTEM, sampling=SamplingParams(max_tokens=4), cache_salt="tenant-b")
    same = engine.generate(prompt_token_ids=SYSTEM, sampling=SamplingParams(max_tokens=4), cache_salt="tenant-a")
    assert other.cached_tokens == 0 and same.cached_tokens == len(SYSTEM) - 1


def test_a_prefix_one_token_too_long_is_caught(pair, monkeypatch):
    """The negative control: a lookup that claims one token more than the prompt shares (copying the
    KV of a token the prompt does not have) changes the output, and the comparison with HF catches it."""
    target, draft = pair
    real = PrefixCache.lookup

    def one_too_many(self, token_ids, salt="", limit=None):
        hit = real(self, token_ids, salt, limit)
        if hit.length and hit.length < len(hit.entry.cache.token_ids):
            hit.length += 1
        return hit

    monkeypatch.setattr(PrefixCache, "lookup", one_too_many)
    engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=4)
    engine.generate(prompt_token_ids=SYSTEM + [5, 6, 7, 8], sampling=SamplingParams(max_tokens=4))
    prompt = SYSTEM + [70, 71, 72]
    out = engine.generate(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=12))
    assert out.cached_tokens == len(SYSTEM) + 1
    assert out.token_ids != _hf(target, [prompt], 12)[0]


def _kv_bytes(engine) -> int:
    pools = [engine.target_pool, engine.draft_pool]
    held = sum(c.nbytes for pool in pools if pool is not None
               for c in (pool.caches.values() if hasattr(pool, "caches") else pool.states.values()))
    cached = sum(e.cache.nbytes for pool in pools if pool is not None and pool.prefixes is not None
                 for e in pool.prefixes.entries.values() if not e.live)
    return held + cached


def test_a_small_budget_evicts_and_makes_requests_wait_but_changes_no_output(pair):
    target, draft = pair
    probe = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=4)
    per_request = probe.scheduler.budget.reservation(len(SYSTEM) + 5 + 24 + probe.config.speculative_tokens_limit + 1)
    budget = int(2.5 * per_request)  # two requests at a time, and little room for prefixes
    engine = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=4,
                                               kv_cache_memory=str(budget), max_batch_size=8)
    prompts = [SYSTEM[i:] + SYSTEM[:i] + [i, i + 1, i + 2, i + 3, i + 4] for i in range(6)]
    peak = [0]
    done = threading.Event()

    def watch():
        while not done.is_set():
            try:
                peak[0] = max(peak[0], _kv_bytes(engine))
            except RuntimeError:  # a dict the scheduler thread changed meanwhile: read again
                continue
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        outs = engine.generate_batch([GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(max_tokens=24))
                                      for p in prompts])
    finally:
        done.set()
        watcher.join()
    assert [o.token_ids for o in outs] == _hf(target, prompts, 24)  # every request finished, unchanged
    assert max(engine.scheduler.batch_sizes) <= 2  # the budget held the others in the queue
    assert peak[0] <= budget, (peak[0], budget)
    assert engine.scheduler.prefix_evictions > 0  # finished requests' prefixes were evicted for room
    assert engine.scheduler.reserved == 0 and engine.scheduler.prefix_bytes <= budget


def test_a_request_that_could_never_fit_is_refused_naming_its_length_and_the_budget(pair):
    target, _ = pair
    engine = SpeculativeEngine.from_pretrained(str(target), draft="none", kv_cache_memory="64KiB")
    with pytest.raises(OverBudget, match=r"prompt of 40 tokens .* more than this server's KV budget of 0.1 MiB"):
        engine.generate(prompt_token_ids=SYSTEM, sampling=SamplingParams(max_tokens=200))
    assert engine.generate(prompt_token_ids=SYSTEM[:8], sampling=SamplingParams(max_tokens=4)).completion_tokens == 4


def test_a_cached_prefix_copy_holds_its_own_buffers(pair):
    """A hit copies: the entry it came from can be evicted (cleared) without touching the request."""
    from specdec.models.loading import load_model
    from specdec.models.model_runner import ModelRunner

    target, _ = pair
    runner = ModelRunner(load_model(str(target)))
    source = runner.new_cache()
    runner.forward([source], [SYSTEM], [1])
    copy = runner.new_cache()
    copy.copy_prefix(source, 30)
    source.clear()
    logits = runner.forward([copy], [SYSTEM[30:]], [1])[0]
    fresh = runner.new_cache()
    expected = runner.forward([fresh], [SYSTEM], [1])[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
