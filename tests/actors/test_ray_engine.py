"""The distributed engine on real Ray (a local instance, tiny models): same tokens as the
in-process engine and HF generate(), for tp 1 and 2, pipelining on and off; caches per request;
recovery from a dead draft worker and from a dead target shard."""

import threading
import time

import pytest
import ray
import torch

from actors import RayEngineConfig, RolePlacement, build_ray_engine
from specdec import EngineConfig, SamplingParams, SpeculativeEngine
from specdec.kernels.linear import stock_linears

PROMPTS = [[5, 6, 7, 8, 9], [3], [10, 20, 30, 10, 20, 30, 10, 20]]
MAX_TOKENS = 40
#: A request that is certainly still running when a test kills an actor after its first chunk (the
#: scheduler runs ahead of a slow reader, so a short one could finish before the kill).
LONG = SamplingParams(max_tokens=400, ignore_eos=True)


DRAFT_PRECISION = "int8-weight"

@pytest.fixture(scope="module")
def in_process(tiny_llama, tiny_llama_draft):
    # A fixed draft precision: `auto` measures timings at load, so two engines may choose differently,
    # and seeded sampling is bit-identical only with the same draft proposals.
    return SpeculativeEngine.from_pretrained(str(tiny_llama), draft=str(tiny_llama_draft), num_speculative_tokens=4,
                                             draft_precision=DRAFT_PRECISION)


@pytest.fixture(scope="module")
def references(in_process):
    model = in_process.target_model.model
    refs = []
    for p in PROMPTS:
        with torch.no_grad(), stock_linears(model):
            out = model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)
        refs.append(out[0, len(p):].tolist())
    return refs


class _Pipelining:
    """A Ray engine whose every request sets `pipeline` (a request's override of the engine's default):
    one engine with a separate draft serves the pipelined and the unpipelined cases."""

    def __init__(self, engine, pipeline: bool) -> None:
        self.engine, self.pipeline = engine, pipeline

    def generate(self, prompt=None, **fields):
        return self.engine.generate(prompt, **{"pipeline": self.pipeline, **fields})

    def generate_stream(self, prompt=None, **fields):
        return self.engine.generate_stream(prompt, **{"pipeline": self.pipeline, **fields})

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.fixture(scope="module")
def ray_engines(ray_session, tiny_llama, tiny_llama_draft):
    """Engines built on first use and shut down at the end of the module (each takes ~10 s): one per
    (tp, draft, K, placement), each request pipelined or not as the test asks."""
    built = {}

    def get(tp: int, pipeline: bool, draft: str | None = None, k=4, placement: str = "separate"):
        key = (tp, draft, k, placement)
        if key not in built:
            config = EngineConfig(target=str(tiny_llama), draft=draft or str(tiny_llama_draft), num_speculative_tokens=k,
                                  draft_precision=DRAFT_PRECISION)
            small = RolePlacement(num_cpus=0.1, num_threads=1)  # several engines share the 2 test CPUs
            built[key] = build_ray_engine(RayEngineConfig(engine=config, tp=tp, draft_role=small, target_role=small,
                                                          draft_placement=placement))
        return _Pipelining(built[key], pipeline)

    yield get
    for engine in built.values():
        engine.shutdown()


@pytest.mark.parametrize("tp, pipeline, placement",
                         [(1, False, "separate"), (1, True, "separate"), (2, False, "separate"), (2, True, "separate"),
                          (1, False, "colocated"), (2, False, "colocated")],
                         ids=["tp1", "tp1-pipeline", "tp2", "tp2-pipeline", "tp1-colocated", "tp2-colocated"])
def test_greedy_equals_in_process_and_hf(ray_engines, in_process, references, tp, pipeline, placement):
    engine = ray_engines(tp, pipeline, placement=placement)
    assert engine.info["draft_placement"] == placement
    hits = 0
    for prompt, expected in zip(PROMPTS, references):
        out = engine.generate(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=MAX_TOKENS))
        local = in_process.generate(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=MAX_TOKENS))
        assert out.token_ids == expected == local.token_ids
        assert out.speculative.num_accepted_tokens == local.speculative.num_accepted_tokens or pipeline
        hits += out.speculative.pipeline_hits
    if pipeline:
        assert hits > 0  # some pre-drafted blocks were used


def test_ngram_tp2_equals_in_process(ray_engines, tiny_llama, references):
    engine = ray_engines(2, True, draft="ngram")
    local = SpeculativeEngine.from_pretrained(str(tiny_llama), draft="ngram")
    for prompt, expected in zip(PROMPTS, references):
        out = engine.generate(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=MAX_TOKENS))
        assert out.token_ids == expected == local.generate(prompt_token_ids=prompt,
                                                           sampling=SamplingParams(max_tokens=MAX_TOKENS)).token_ids


@pytest.mark.parametrize("placement", ["separate", "colocated"])
def test_seeded_sampling_is_bit_identical_to_in_process(ray_engines, in_process, placement):
    engine = ray_engines(1, False, placement=placement)
    for seed in range(5):
        params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=30, seed=seed)
        remote = engine.generate(prompt_token_ids=PROMPTS[0], sampling=params)
        local = in_process.generate(prompt_token_ids=PROMPTS[0], sampling=params)
        assert remote.token_ids == local.token_ids
        assert remote.speculative.num_accepted_tokens == local.speculative.num_accepted_tokens


@pytest.fixture(scope="module")
def target_only(tiny_llama):
    return SpeculativeEngine.from_pretrained(str(tiny_llama), draft="none")


@pytest.mark.parametrize("tp, pipeline", [(1, True), (2, False), (2, True)], ids=["tp1-pipeline", "tp2", "tp2-pipeline"])
def test_a_seed_gives_the_target_only_text_on_ray(ray_engines, in_process, target_only, tp, pipeline):
    """Invariant sampling: shards, a separate pipelined draft, batch-mates change nothing; residual
    sampling: the same text as in-process (same K, same draft)."""
    from concurrent.futures import ThreadPoolExecutor

    engine = ray_engines(tp, pipeline)
    cases = [(seed, prompt, SamplingParams(temperature=t, top_k=k, top_p=p, max_tokens=30, ignore_eos=True, seed=seed))
             for seed, prompt in enumerate(PROMPTS) for t, k, p in ((1.0, 0, 1.0), (0.7, 20, 0.8))]

    def run(eng, params):
        return [eng.generate(prompt_token_ids=prompt, sampling=params(p)).token_ids for _, prompt, p in cases]

    want = run(target_only, lambda p: p)
    assert run(engine, lambda p: p) == want
    with ThreadPoolExecutor(len(cases)) as pool:  # all at once: batched on the shards
        assert list(pool.map(lambda c: engine.generate(prompt_token_ids=c[1], sampling=c[2]).token_ids, cases)) == want
    residual = lambda p: p.replace(speculative_sampling="residual")  # noqa: E731
    assert run(engine, residual) == run(in_process, residual)


def test_text_prompts_stop_strings_and_streaming(ray_engines, in_process):
    engine = ray_engines(2, True)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    local = in_process.generate("w5 w6 w7", sampling=params)
    stop = local.text.split()[6]
    chunks = list(engine.generate_stream("w5 w6 w7", sampling=params.replace(stop=[stop])))
    out = chunks[-1].output
    expected = in_process.generate("w5 w6 w7", sampling=params.replace(stop=[stop]))
    assert (out.text, out.token_ids, out.finish_reason) == (expected.text, expected.token_ids, "stop")
    assert "".join(c.text for c in chunks) == out.text


def test_every_shard_cache_holds_the_committed_length_at_each_step(ray_engines):
    engine = ray_engines(2, True)
    committed = len(PROMPTS[0])
    steps_with_rejection = 0
    for chunk in engine.generate_stream(prompt_token_ids=PROMPTS[0], sampling=SamplingParams(max_tokens=MAX_TOKENS)):
        # When the step's forward began each shard held every committed token but the last (the
        # step's first input): the rejected tokens of the step before were dropped by that forward.
        assert chunk.cache_lengths == [committed - 1, committed - 1]
        committed += len(chunk.token_ids)
        if chunk.num_proposed and len(chunk.token_ids) <= chunk.num_proposed:
            steps_with_rejection += 1
    assert steps_with_rejection > 0


def test_caches_are_freed_when_requests_end(ray_engines, ray_session):
    engine = ray_engines(2, True)
    engine.generate(prompt_token_ids=PROMPTS[0], sampling=SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="exceeds the model's context"):
        engine.generate(prompt_token_ids=PROMPTS[0], sampling=SamplingParams(max_tokens=600))
    # An abandoned stream (the client went away) is cancelled and freed too.
    stream = engine.generate_stream(prompt_token_ids=PROMPTS[1], sampling=SamplingParams(max_tokens=MAX_TOKENS))
    next(stream)
    stream.close()
    handles = engine.handles()
    deadline = time.time() + 30
    while time.time() < deadline:
        counts = ray_session.get([a.num_requests.remote() for a in [handles["draft"], *handles["shards"]]])
        if counts == [0, 0, 0]:
            break
        time.sleep(0.2)
    assert counts == [0, 0, 0]


def test_concurrent_requests_are_batched_and_do_not_share_state(ray_engines, references, ray_session):
    """Six requests at once on tp=2 with pipelining: decoded as batches, each equal to its own reference."""
    engine = ray_engines(2, True)
    results = {}

    def run(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        results[i] = engine.generate(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=MAX_TOKENS)).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert max(ray_session.get(engine.coordinator.batch_sizes.remote())) > 1
    assert {i: results.get(i) for i in range(6)} == {i: references[i % len(PROMPTS)] for i in range(6)}


def test_dead_draft_falls_back_to_target_only_and_restarts(ray_engines, in_process, references, ray_session):
    engine = ray_engines(1, True)
    draft = engine.handles()["draft"]
    stream = engine.generate_stream(prompt_token_ids=PROMPTS[0], sampling=LONG)
    chunks = [next(stream)]
    ray_session.kill(draft, no_restart=False)
    chunks.extend(stream)
    out = chunks[-1].output
    assert out.token_ids == in_process.generate(prompt_token_ids=PROMPTS[0], sampling=LONG).token_ids
    assert out.speculative.draft_failures >= 1  # the kill hit the request in flight
    # Ray restarts the draft; later requests speculate again.
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            ray_session.get(draft.ready.remote(), timeout=10)
            break
        except Exception:
            time.sleep(0.5)
    again = engine.generate(prompt_token_ids=PROMPTS[0], sampling=SamplingParams(max_tokens=MAX_TOKENS))
    assert again.token_ids == references[0]
    assert again.speculative.draft_failures == 0 and again.speculative.num_accepted_tokens > 0


def test_colocated_draft_runs_in_the_rank0_shard_and_frees_its_state(ray_engines, ray_session):
    engine = ray_engines(2, False, placement="colocated")
    handles = engine.handles()
    assert handles["draft"] == handles["shards"][0]  # no draft actor of its own
    assert ray_session.get(handles["shards"][0].ready.remote()) == "model"
    # A pipelining request on a colocated draft runs unpipelined (one process cannot draft and verify at once).
    out = engine.generate(prompt_token_ids=PROMPTS[0], sampling=SamplingParams(max_tokens=MAX_TOKENS), pipeline=True)
    assert out.speculative.pipeline_hits == out.speculative.pipeline_misses == 0
    assert out.speculative.num_accepted_tokens > 0
    assert ray_session.get([s.num_requests.remote() for s in handles["shards"]]) == [0, 0]


def test_failing_colocated_draft_falls_back_to_target_only(ray_engines, references, ray_session):
    engine = ray_engines(1, False, placement="colocated")

    def break_draft(shard):
        def boom(*args, **kwargs):
            raise RuntimeError("draft out of memory")
        shard.draft.propose = boom

    def mend_draft(shard):
        del shard.draft.propose  # the class's method again

    shard = engine.handles()["shards"][0]
    ray_session.get(shard.__ray_call__.remote(break_draft))
    try:
        out = engine.generate(prompt_token_ids=PROMPTS[0], sampling=SamplingParams(max_tokens=MAX_TOKENS))
    finally:
        ray_session.get(shard.__ray_call__.remote(mend_draft))
    assert out.token_ids == references[0]
    assert out.speculative.draft_failures == 1 and out.speculative.num_draft_tokens == 0
    again = engine.generate(prompt_token_ids=PROMPTS[0], sampling=SamplingParams(max_tokens=MAX_TOKENS))
    assert again.token_ids == references[0] and again.speculative.draft_failures == 0


def test_dead_shard_fails_the_request_clearly_and_the_engine_recovers(ray_engines, references, ray_session):
    from actors.coordinator import TargetShardError

    engine = ray_engines(2, False)
    shard = engine.handles()["shards"][1]
    stream = engine.generate_stream(prompt_token_ids=PROMPTS[0], sampling=LONG)
    next(stream)
    ray_session.kill(shard, no_restart=True)
    started = time.time()
    with pytest.raises(TargetShardError, match="target shard failed"):
        list(stream)
    print(f"the request failed {time.time() - started:.1f}s after the kill")
    out = engine.generate(prompt_token_ids=PROMPTS[0], sampling=SamplingParams(max_tokens=MAX_TOKENS))
    assert out.token_ids == references[0]


def test_pipelined_sampling_follows_the_target_distribution(ray_session, small_vocab_pair):
    """Pipelined sampling through Ray (a draft worker of its own, 32 requests batched) is not
    bit-identical to in-process (pre-drafts consume extra draft randomness), so it is held to the
    statistical test: tokens 3 and 4, which follow a used pre-drafted block whenever the first block
    was accepted whole; the draft is a different model, more confident than the target, so a shifted
    q would show (see tests/specdec/test_lossless_sampling.py's negative controls)."""
    from tests.distribution import BATCH, chi_square_pvalue, exact_pair_distribution, sample_pair

    target, draft = small_vocab_pair
    small = RolePlacement(num_cpus=0.1, num_threads=1)
    engine = build_ray_engine(RayEngineConfig(
        engine=EngineConfig(target=str(target), draft=str(draft), num_speculative_tokens=2, max_batch_size=BATCH),
        tp=1, pipeline=True, draft_role=small, target_role=small, draft_placement="separate"))
    try:
        params = SamplingParams(temperature=1.0)
        local = SpeculativeEngine.from_pretrained(str(target), draft="none")
        exact = exact_pair_distribution(local.target_model.model, params, first=3)
        counts, acceptance, hits = sample_pair(engine, params, max_tokens=6, num_samples=1200, first=3)
        pvalue = chi_square_pvalue(counts, exact)
        print(f"pipeline hits {hits} in 1200 samples, acceptance {acceptance:.2f}, p-value {pvalue:.3f}")
        assert hits > 240  # a fifth of the samples went through a used pre-drafted block
        assert 0.05 < acceptance < 0.95
        assert pvalue > 1e-3
    finally:
        engine.shutdown()



def test_prefix_cache_hits_on_every_shard_and_the_draft_worker(ray_engines, in_process):
    """tp 2 with a separate draft: the second turn of a conversation prefills only its new tokens on
    both shards (they must agree on the cached length, or the step fails), the draft worker starts
    from its cached prefix too, and the output equals the in-process engine's."""
    engine = ray_engines(2, False)
    handles = ray.get(engine.engine.coordinator.handles.remote())
    room = 1 << 40  # evicts nothing: `fit` only reports

    def served():
        shards = [u.hit_tokens for u in ray.get([s.fit.remote(room) for s in handles["shards"]])]
        return shards, ray.get(handles["draft"].fit.remote(room)).hit_tokens

    system = [(5 * i) % 90 + 3 for i in range(40)]
    first = engine.generate(prompt_token_ids=system, sampling=SamplingParams(max_tokens=12))
    follow = system + first.token_ids + [7, 8, 9]
    shards_before, draft_before = served()
    second = engine.generate(prompt_token_ids=follow, sampling=SamplingParams(max_tokens=12))
    shards_after, draft_after = served()
    assert first.cached_tokens == 0 and second.cached_tokens >= len(system) + len(first.token_ids) - 1
    assert [a - b for a, b in zip(shards_after, shards_before)] == [second.cached_tokens] * 2
    assert draft_after - draft_before >= len(system)
    assert second.token_ids == in_process.generate(prompt_token_ids=follow,
                                                   sampling=SamplingParams(max_tokens=12)).token_ids
