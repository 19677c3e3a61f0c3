"""What one step sends over Ray (`actors/wire.py` counts each actor method's calls and bytes):
proposals are verified on rank 0, where the logits are, so a sampled row's step returns token ids,
not `[K+1, vocab]` logits; the rewind rides on the next forward, so a step is one propose call and
one forward per shard; the draft worker gets what changed in a context, not the context. Measured
at two vocabulary sizes and two prompt lengths: the bytes grow with neither."""

from __future__ import annotations

import pytest
import ray

from benchmarks.wire_per_step import measure
from specdec import EngineConfig, SamplingParams, SpeculativeEngine
from specdec.engine.pools import TargetRow
from tests.tiny_models import make_model

VOCABS = (96, 4096)
PROMPT = [5, 6, 7, 8, 9, 10, 5, 6, 7]
TOKENS = 24


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    out = {}
    for vocab in VOCABS:
        target = make_model(tmp_path_factory.mktemp(f"lean-target-{vocab}"), "llama", vocab_size=vocab, seed=41)
        draft = make_model(tmp_path_factory.mktemp(f"lean-draft-{vocab}"), perturb_from=target, noise=0.03, seed=42)
        out[vocab] = (target, draft)
    return out


def _measure(target, draft, sampling: SamplingParams, tp: int = 2, prompt=PROMPT) -> tuple[dict, dict, list[int], int]:
    """One request through a Ray engine (tp shards, a separate unpipelined draft worker,
    `benchmarks.wire_per_step.measure`): what rank 0 and the draft worker counted (calls, bytes
    received and returned per method), the tokens, and the verify steps."""
    row, output = measure(target, draft, tp, prompt, sampling)

    def of(who: str) -> dict:
        return {mine: {key.split(".", 1)[1]: n for key, n in row[theirs].items() if key.startswith(who + ".")}
                for mine, theirs in (("calls", "calls"), ("received", "bytes_sent"), ("returned", "bytes_returned"))}

    return of("shard0"), of("draft"), output.token_ids, row["steps"]


def test_a_step_is_one_propose_and_one_forward_per_shard_and_its_bytes_do_not_grow_with_the_vocabulary(
        ray_session, pairs):
    sampled = SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=3)  # invariant sampling, the default
    per_step = {}
    for vocab, (target, draft) in pairs.items():
        shard, worker, tokens, steps = _measure(target, draft, sampled)
        local = SpeculativeEngine.from_pretrained(str(target), draft=str(draft), num_speculative_tokens=4,
                                                  draft_precision="none")
        assert tokens == local.generate(prompt_token_ids=PROMPT, sampling=sampled).token_ids  # same seeded text
        # One prefill and one forward per step; no rewind calls; one propose per step.
        assert shard["calls"] == {"forward": steps + 1}, (shard, steps)
        # At most one propose per step (a step with room for only the bonus token drafts nothing).
        assert set(worker["calls"]) == {"propose"} and steps - 1 <= worker["calls"]["propose"] <= steps, (worker, steps)
        per_step[vocab] = {"forward returned": shard["returned"]["forward"] / (steps + 1),
                           "forward received": shard["received"]["forward"] / (steps + 1),
                           "propose returned": worker["returned"]["propose"] / worker["calls"]["propose"]}
        print(f"vocab {vocab}: {steps} steps, bytes per call {per_step[vocab]}")
    small, large = per_step[VOCABS[0]], per_step[VOCABS[1]]
    for key in small:
        assert large[key] < 1.3 * small[key] + 200, (key, small[key], large[key])  # 43x the vocabulary
    assert large["forward returned"] < 2000  # token ids and lengths, not [K+1, 4096] float32 (80 kB)


def test_negative_control_logits_sent_back_grow_with_the_vocabulary(ray_session, pairs):
    """The same forward asked for logits instead of a verification (what every sampled row cost
    before): its reply grows with the vocabulary, so the measurement above would see growth."""
    from actors.target_shard import TargetShard

    sizes = {}
    for vocab, (target, _) in pairs.items():
        shard = ray.remote(TargetShard).options(num_cpus=0.1).remote(
            EngineConfig(target=str(target), draft="none", num_threads=1), 0, 1, 1)
        try:
            ray.get(shard.setup.remote("127.0.0.1", 0))  # one rank: no process group
            ray.get(shard.wire_log.remote(True))
            ray.get(shard.forward.remote([TargetRow("r", PROMPT + [11, 12, 13, 14], 5, 0, False)]))
            sizes[vocab] = ray.get(shard.wire_log.remote(False))["returned"]["forward"]
        finally:
            ray.kill(shard)
    assert sizes[VOCABS[1]] > 20 * sizes[VOCABS[0]] and sizes[VOCABS[1]] > 5 * 4 * VOCABS[1], sizes


def test_the_draft_worker_gets_each_prompt_once_then_deltas(ray_session, pairs):
    import pickle

    target, draft = pairs[VOCABS[0]]
    greedy = SamplingParams(max_tokens=TOKENS)
    long_prompt = [(7 * i) % 90 + 3 for i in range(400)]
    _, short, _, _ = _measure(target, draft, greedy, tp=1)
    _, long, _, _ = _measure(target, draft, greedy, tp=1, prompt=long_prompt)
    per_step_short = short["received"]["propose"] / short["calls"]["propose"]
    long_steps = long["calls"]["propose"]
    extra = long["received"]["propose"] - per_step_short * long_steps
    prompt_bytes = len(pickle.dumps(long_prompt, protocol=5))
    print(f"propose: {per_step_short:.0f} B per call; the 400-token prompt added {extra:.0f} B in all "
          f"({prompt_bytes} B pickled), over {long_steps} calls")
    assert extra < 2 * prompt_bytes  # sent once; whole contexts would add it on every call
