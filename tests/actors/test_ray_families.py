"""Sliding-window families on the distributed engine: local/global and sliding layers on sharded
heads (Ray tp 2, a separate draft worker), requests crossing the window, batched, equal HF
`generate()`. A module of its own: `test_ray_engine.py` keeps its engines (and their CPUs) until it
ends."""

import pytest

from actors import RayEngineConfig, RolePlacement, build_ray_engine
from specdec import EngineConfig, SamplingParams
from specdec.engine.request import GenerationRequest
from tests.tiny_models import hf_greedy_references, make_family_pair

PROMPTS = [[5, 6, 7, 8, 9], [3], [10, 20, 30, 10, 20, 30, 10, 20]]
MAX_TOKENS = 40


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_sliding_window_family_tp2_batched_equals_hf(ray_session, tmp_path, family):
    """Sliding-window layers on sharded heads: requests crossing the window, batched, through Ray tp 2."""
    target, draft = make_family_pair(tmp_path, family)
    references = hf_greedy_references(target, PROMPTS, MAX_TOKENS)
    config = EngineConfig(target=str(target), draft=str(draft), num_speculative_tokens=4,
                          draft_precision="none")
    small = RolePlacement(num_cpus=0.1, num_threads=1)
    engine = build_ray_engine(RayEngineConfig(engine=config, tp=2, draft_role=small, target_role=small))
    try:
        outs = engine.generate_batch([GenerationRequest(prompt_token_ids=p,
                                                        sampling=SamplingParams(max_tokens=MAX_TOKENS))
                                      for p in PROMPTS])
        assert [o.token_ids for o in outs] == references
    finally:
        engine.shutdown()
