"""Every tensor a request touches lives on its model's device, checked on a machine with one device.

The engine's scheduler thread runs with torch's default device set to `meta`, a second device: a
tensor made without naming its device (what works on a CPU and breaks on a GPU, where it lands on
the CPU beside CUDA logits) is made on `meta` and fails as soon as it meets the model's tensors,
while the models, caches and every tensor made on purpose stay on the model's device. Each kind of
request must then give the same tokens as without the guard. A negative control plants one
device-less tensor in the logits processing and shows the guard catches it.

The Ray path runs the same pools and verification (`specdec/engine/pools.py`) inside its actors; the
GPU run of these paths is `benchmarks/gpu_check.py`.
"""

from __future__ import annotations

import json

import pytest
import torch

import specdec.decoding.verify
from specdec import SamplingParams, SpeculativeEngine
from specdec.constraint import Constraint
from specdec.engine.request import GenerationRequest

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["id", "ok"], "additionalProperties": False}
REQUESTS = {
    "greedy": dict(max_tokens=16),
    "greedy, logprobs": dict(max_tokens=16, logprobs=3),
    "greedy, penalties and logit_bias": dict(max_tokens=16, repetition_penalty=1.3, logit_bias={9: 3.0}),
    "sampled": dict(max_tokens=16, temperature=1.0, seed=3),
    "sampled, logit_bias and penalties": dict(max_tokens=16, temperature=1.0, seed=3, logit_bias={7: 2.0},
                                              presence_penalty=0.5, frequency_penalty=0.3),
    "sampled, top-k/top-p, logprobs": dict(max_tokens=16, temperature=0.8, top_k=20, top_p=0.9, seed=4, logprobs=2),
    "JSON schema": dict(max_tokens=16, structured=Constraint("json_schema", json.dumps(SCHEMA))),
    "JSON schema, sampled": dict(max_tokens=16, temperature=1.0, seed=5,
                                 structured=Constraint("json_schema", json.dumps(SCHEMA))),
}
PROMPTS = ["Write JSON: {\"id\": 1, \"ok\": true} and again", "hello world, hello world, hello"]


def _guard(engine: SpeculativeEngine) -> None:
    """Run the engine's scheduler thread (from its next start) with `meta` as the default device."""
    loop = engine._loop

    def guarded():
        with torch.device("meta"):
            loop()

    engine.shutdown()
    engine._loop = guarded


def _run_all(engine: SpeculativeEngine) -> dict:
    """Each request alone, then all of them batched together; a failure is kept as its message."""
    out = {}
    for name, fields in REQUESTS.items():
        for mode in ("invariant", "residual") if "temperature" in fields else ("invariant",):
            for i, prompt in enumerate(PROMPTS):
                sampling = SamplingParams(**fields, speculative_sampling=mode)
                try:
                    result = engine.generate(prompt, sampling=sampling)
                    out[name, mode, i] = (result.token_ids, result.logprobs)
                except Exception as e:  # noqa: BLE001 - the comparison names it
                    out[name, mode, i] = f"{type(e).__name__}: {e}"
    results = engine.generate_batch([GenerationRequest(PROMPTS[i % 2], sampling=SamplingParams(**fields))
                                     for i, fields in enumerate(REQUESTS.values())])
    out["batched"] = [r.token_ids for r in results]
    return out


def _engine(pair, draft: str | None = None, **fields) -> SpeculativeEngine:
    target, model_draft = pair
    return SpeculativeEngine.from_pretrained(str(target), draft=draft or str(model_draft), num_speculative_tokens=4,
                                             draft_precision="none", **fields)


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_every_request_kind_runs_with_no_tensor_off_its_models_device(tiny_bpe_pair, draft):
    engine = _engine(tiny_bpe_pair, draft="ngram" if draft == "ngram" else None)
    expected = _run_all(engine)
    assert not [k for k, v in expected.items() if isinstance(v, str)], expected
    _guard(engine)
    guarded = _run_all(engine)
    # The prefix cache served the second pass's prompts (computed in the first): hits ran guarded too.
    assert guarded == expected
    engine.shutdown()


def test_negative_control_a_tensor_made_without_its_device_is_caught(tiny_bpe_pair, monkeypatch):
    engine = _engine(tiny_bpe_pair)
    sampling = SamplingParams(max_tokens=16, logit_bias={7: 2.0})
    expected = engine.generate(PROMPTS[0], sampling=sampling).token_ids
    original = specdec.decoding.verify.process

    def device_less(logits, *args, **kwargs):
        scores = original(logits, *args, **kwargs)
        return scores + torch.zeros(scores.shape[-1])  # the bug: made on the default device

    monkeypatch.setattr(specdec.decoding.verify, "process", device_less)
    assert engine.generate(PROMPTS[0], sampling=sampling).token_ids == expected  # harmless on one device
    _guard(engine)
    with pytest.raises(Exception, match="meta"):
        engine.generate(PROMPTS[0], sampling=sampling)
    engine.shutdown()


def test_the_gpus_one_sync_per_position_paths_choose_the_same_tokens(tiny_bpe_pair, monkeypatch):
    """Off the CPU the draft keeps each row's token on the device and reads the batch's in one sync
    per position, and invariant verification reads all K+1 positions in one sync
    (`sampling.defers_sync`). Forced on here, every kind of request gives the same tokens, and the
    deferred paths are seen to run."""
    import specdec.decoding.proposers.model as model_proposer
    import specdec.decoding.sampling as sampling_module

    engine = _engine(tiny_bpe_pair)
    expected = _run_all(engine)
    deferred = {"draft": 0, "verify": 0}
    choose, gumbel = model_proposer.choose, specdec.decoding.verify.gumbel_argmax

    def counted_choose(*args, on_device=False, **kwargs):
        deferred["draft"] += on_device
        return choose(*args, on_device=on_device, **kwargs)

    def counted_gumbel(*args, **kwargs):
        deferred["verify"] += kwargs.get("on_device", False)
        return gumbel(*args, **kwargs)

    monkeypatch.setattr(model_proposer, "choose", counted_choose)
    monkeypatch.setattr(specdec.decoding.verify, "gumbel_argmax", counted_gumbel)
    monkeypatch.setattr(specdec.decoding.verify, "defers_sync", lambda device: True)
    engine.proposer.defer_sync = True
    assert sampling_module.defers_sync(torch.device("cpu")) is False  # the default on this machine
    assert _run_all(engine) == expected
    assert deferred["draft"] > 100 and deferred["verify"] > 20, deferred
    engine.shutdown()
