"""Same seed, same text: the `invariant` sampling mode gives, token for token, the text target-only
decoding gives for the seed, whatever the draft, K, batch-mates, token budget or pipelining; the
`residual` mode's seeded text does not depend on batch-mates, the token budget or pipelining (its
K follows its own history alone).

No statistics are needed here: these are equalities. The distributions themselves are tested in
`test_lossless_sampling.py` (chi-square, with negative controls).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from specdec import SamplingParams, SpeculativeEngine
from tests.specdec.test_lossless_sampling import as_unseeded, pipelined

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 11, 12, 11, 12], [40, 41, 42], [3, 1, 2, 3, 1, 2, 3, 1], [70, 5, 70, 5]]
MAX_TOKENS = 40

PARAMS = {
    "T1": SamplingParams(temperature=1.0),
    "T0.7": SamplingParams(temperature=0.7),
    "topk8": SamplingParams(temperature=1.0, top_k=8),
    "topp0.9": SamplingParams(temperature=1.0, top_p=0.9),
    "T0.7-topk20-topp0.8": SamplingParams(temperature=0.7, top_k=20, top_p=0.8),
}

#: How each draft is built from the fixture paths: (draft, engine keyword arguments).
DRAFTS = {
    "model": ("model", {}),
    "ngram": ("ngram", {}),
    "hybrid": ("model", {"prompt_lookup_min": 2}),
    "int8": ("model", {"draft_precision": "int8"}),
    "bfloat16": ("model", {"draft_precision": "bfloat16"}),
}


def _seeded(params: SamplingParams, seed: int, mode: str = "invariant", **changes) -> SamplingParams:
    fields = {"seed": seed, "max_tokens": MAX_TOKENS, "ignore_eos": True, "speculative_sampling": mode}
    return params.replace(**{**fields, **changes})


def _alone(engine, params, mode="invariant", k=None):
    return [engine.generate(prompt_token_ids=p, sampling=_seeded(params, seed, mode), num_speculative_tokens=k)
            .token_ids for seed, p in enumerate(PROMPTS)]


def _batched(engine, params, ks, mode="invariant", stagger_s=0.0):
    """Every prompt at once (each with its own K); with `stagger_s`, requests join a running batch."""
    def one(i):
        time.sleep(stagger_s * i)
        return engine.generate(prompt_token_ids=PROMPTS[i], sampling=_seeded(params, i, mode),
                               num_speculative_tokens=ks[i % len(ks)]).token_ids

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, range(len(PROMPTS))))


@pytest.fixture(scope="module")
def target_only(tiny_llama):
    """The reference: target-only decoding (no draft), each request alone."""
    engine = SpeculativeEngine.from_pretrained(str(tiny_llama), draft="none")
    return {name: _alone(engine, params) for name, params in PARAMS.items()}


@pytest.mark.parametrize("draft", DRAFTS)
def test_invariant_text_equals_target_only_for_every_draft_k_and_batch(tiny_llama, tiny_llama_draft, target_only,
                                                                          draft):
    kind, kwargs = DRAFTS[draft]
    engine = SpeculativeEngine.from_pretrained(str(tiny_llama), draft=str(tiny_llama_draft) if kind == "model"
                                               else kind, num_speculative_tokens=4, **kwargs)
    for name, params in PARAMS.items():
        want = target_only[name]
        assert _alone(engine, params) == want, name
        assert _alone(engine, params, k=0) == want, name  # K=0 on a speculative engine: target-only
        assert _batched(engine, params, ks=[1, 3, 6, "auto", 2]) == want, name
        assert _batched(engine, params, ks=[5], stagger_s=0.02) == want, name  # joining a running batch
    stats = engine.generate(prompt_token_ids=PROMPTS[1], sampling=_seeded(PARAMS["T0.7"], 1)).speculative
    assert stats.num_accepted_tokens > 0, "no proposal was accepted: the test would pass with a useless draft"
    assert max(engine.scheduler.batch_sizes) > 1


def test_invariant_text_survives_a_tight_token_budget_and_pipelining(tiny_llama, tiny_llama_draft, target_only):
    engine = SpeculativeEngine.from_pretrained(str(tiny_llama), draft=str(tiny_llama_draft),
                                               num_speculative_tokens="auto", max_batch_tokens=8, max_batch_size=5)
    pipelined(engine)
    for name in ("T1", "T0.7-topk20-topp0.8"):
        assert _batched(engine, PARAMS[name], ks=[4, 6, None]) == target_only[name], name


@pytest.mark.parametrize("draft, mode", [(d, "invariant") for d in DRAFTS] + [("model", "residual"),
                                                                         ("hybrid", "residual")])
def test_eos_and_stop_strings_inside_accepted_blocks(tiny_llama, tiny_llama_draft, target_only, monkeypatch,
                                                     draft, mode):
    """A seeded run with an EOS token (or a stop string) is the free run cut there, token for token,
    though the EOS arrives inside a block of accepted proposals (K=6)."""
    kind, kwargs = DRAFTS[draft]
    engine = SpeculativeEngine.from_pretrained(str(tiny_llama), draft=str(tiny_llama_draft) if kind == "model"
                                               else kind, num_speculative_tokens=6, **kwargs)
    params = _seeded(PARAMS["T0.7"], 1, mode)
    free = engine.generate(prompt_token_ids=PROMPTS[1], sampling=params)
    if mode == "invariant":
        assert free.token_ids == target_only["T0.7"][1]
    assert max(free.k_history) == 6 and free.speculative.num_accepted_tokens > 0
    eos = free.token_ids[12]
    monkeypatch.setattr(engine.target_model.model.generation_config, "eos_token_id", eos)
    out = engine.generate(prompt_token_ids=PROMPTS[1], sampling=params.replace(ignore_eos=False))
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]
    stop = free.text[len(free.text) // 2:][:3]
    out = engine.generate(prompt_token_ids=PROMPTS[1], sampling=params.replace(stop=(stop,)))
    assert out.finish_reason == "stop" and out.text == free.text[: free.text.index(stop)]
    assert free.token_ids[: len(out.token_ids)] == out.token_ids


def test_unseeded_requests_still_sample(tiny_llama, tiny_llama_draft):
    engine = SpeculativeEngine.from_pretrained(str(tiny_llama), draft=str(tiny_llama_draft))
    params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    texts = {tuple(engine.generate(prompt_token_ids=PROMPTS[0], sampling=params).token_ids) for _ in range(4)}
    assert len(texts) > 1


#: Drafts whose proposals are exact functions of the context. A bfloat16 or int8-weight draft's q
#: may move with the shape of the forward it ran in (bfloat16 rounding), which would flip a residual
#: draw now and then: `benchmarks/seeded_stability.py` measures how often (README, Guarantees).
RESIDUAL_DRAFTS = {d: DRAFTS[d] for d in ("model", "ngram", "hybrid")}


def _engine(tiny_llama, tiny_llama_draft, draft, **kwargs):
    kind, draft_kwargs = RESIDUAL_DRAFTS[draft]
    return SpeculativeEngine.from_pretrained(str(tiny_llama), draft=str(tiny_llama_draft) if kind == "model" else kind,
                                             **draft_kwargs, **kwargs)


@pytest.mark.parametrize("draft", RESIDUAL_DRAFTS)
def test_residual_seeded_text_does_not_depend_on_load(tiny_llama, tiny_llama_draft, draft):
    """A seeded residual request's K comes from its own history (auto: HF's heuristic schedule) and
    is never trimmed for batch-mates: its text is the same alone on a roomy engine and batched under
    a token budget of 8 (every row wants more; rows sit steps out), joining a running batch, and
    pipelined."""
    roomy = _engine(tiny_llama, tiny_llama_draft, draft, num_speculative_tokens="auto")
    tight = _engine(tiny_llama, tiny_llama_draft, draft, num_speculative_tokens="auto", max_batch_tokens=8,
                    max_batch_size=5)
    tight_pipelined = pipelined(_engine(tiny_llama, tiny_llama_draft, draft, num_speculative_tokens="auto",
                                        max_batch_tokens=8, max_batch_size=5))
    for name in ("T1", "T0.7-topk20-topp0.8"):
        for k in (None, 4):  # auto, fixed
            alone = _alone(roomy, PARAMS[name], mode="residual", k=k)
            assert _batched(tight, PARAMS[name], ks=[k], mode="residual") == alone, (name, k)
            assert _batched(tight, PARAMS[name], ks=[k], mode="residual", stagger_s=0.02) == alone, (name, k)
            assert _batched(tight_pipelined, PARAMS[name], ks=[k], mode="residual") == alone, (name, k)
    assert max(tight.scheduler.batch_sizes) > 1
    runs = [roomy.generate(prompt_token_ids=p, sampling=_seeded(PARAMS["T0.7"], 1, "residual")).speculative
            for p in PROMPTS]
    accepted, drafted = sum(r.num_accepted_tokens for r in runs), sum(r.num_draft_tokens for r in runs)
    assert 0 < accepted < drafted, "both accepted and rejected proposals must occur"


def test_residual_load_independence_control(tiny_llama, tiny_llama_draft, monkeypatch):
    """Negative control: with seeded residual rows treated like the others (auto-K over the batch's
    measured costs, K trimmed to the token budget), batching changes their text."""
    as_unseeded(monkeypatch)
    roomy = _engine(tiny_llama, tiny_llama_draft, "model", num_speculative_tokens=4)
    tight = _engine(tiny_llama, tiny_llama_draft, "model", num_speculative_tokens=4, max_batch_tokens=8,
                    max_batch_size=5)
    alone = _alone(roomy, PARAMS["T1"], mode="residual")
    assert _batched(tight, PARAMS["T1"], ks=[None], mode="residual") != alone
