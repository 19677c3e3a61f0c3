"""Placement by role on a real multi-node Ray cluster on one machine (`ray.cluster_utils.Cluster`, as
Ray's own tests do): a head with no CPUs, a node labelled `specdec_draft` and a node labelled
`specdec_target` (separate raylets, CPU only). The role resources come from the engine's config,
as `deployments/cluster-serve.yaml` gives them on a real cluster.
"""

from __future__ import annotations

import time

import pytest

from actors.config import RayEngineConfig, RolePlacement
from specdec import SamplingParams, SpeculativeEngine
from specdec.config import EngineConfig

PROMPT = "w5 w6 w7 w8 w5 w6"


@pytest.fixture(scope="module")
def cluster():
    """The cluster for this module; the session's local Ray (if a test started it) is stopped
    meanwhile and started again after, for the modules that follow."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.state import list_nodes

    from tests.conftest import start_session_ray

    restart = ray.is_initialized()
    if restart:
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": True,
                                                      "object_store_memory": 100 * 1024**2})
    draft_node = c.add_node(num_cpus=1, resources={"specdec_draft": 1}, object_store_memory=100 * 1024**2)
    target_node = c.add_node(num_cpus=2, resources={"specdec_target": 2}, object_store_memory=100 * 1024**2)
    try:
        ray.init(address=c.address)
        c.wait_for_nodes()
        deadline = time.monotonic() + 60
        while len(list_nodes(address=c.address)) < 3 and time.monotonic() < deadline:  # the state API sees all three
            time.sleep(0.5)
        # The state API is asked by address: another module's cluster may be up on this machine too.
        yield {"draft": draft_node.node_id, "target": target_node.node_id, "head": c.head_node.node_id,
               "address": c.address}
    finally:
        ray.shutdown()
        c.shutdown()
        if restart:
            start_session_ray()


def _config(target, draft, target_resources=None, draft_resources=None, timeout_s=60.0) -> RayEngineConfig:
    return RayEngineConfig(
        engine=EngineConfig(target=str(target), draft=str(draft), num_speculative_tokens=4, num_threads=1),
        tp=2, draft_placement="separate", pipeline=True, placement_timeout_s=timeout_s,
        draft_role=RolePlacement(num_cpus=0.5, resources=draft_resources or {"specdec_draft": 1}),
        target_role=RolePlacement(num_cpus=0.5, resources=target_resources or {"specdec_target": 1}))


def test_roles_land_on_their_nodes_and_greedy_output_is_unchanged(cluster, tiny_llama, tiny_llama_draft):
    from ray.util.state import list_actors

    from actors.builder import build_ray_engine

    engine = build_ray_engine(_config(tiny_llama, tiny_llama_draft))
    try:
        out = engine.generate(PROMPT, sampling=SamplingParams(temperature=0.0, max_tokens=24))
        actors = list_actors(address=cluster["address"], filters=[("state", "=", "ALIVE")], detail=True)
        nodes = {}
        for a in actors:
            nodes.setdefault(a.class_name, []).append(a.node_id)
        assert nodes["DraftWorker"] == [cluster["draft"]]
        assert nodes["TargetShard"] == [cluster["target"]] * 2  # one STRICT_PACK group, one node
        assert len(nodes["Coordinator"]) == 1  # anywhere: it reserves no CPU
    finally:
        engine.shutdown()
    reference = SpeculativeEngine.from_pretrained(str(tiny_llama), draft="none").generate(
        PROMPT, sampling=SamplingParams(temperature=0.0, max_tokens=24))
    assert out.token_ids == reference.token_ids
    assert out.speculative.num_drafts > 0 and out.speculative.num_accepted_tokens > 0


@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_role_resource_no_node_offers_fails_clearly_within_the_timeout(cluster, tiny_llama, tiny_llama_draft,
                                                                         role):
    from actors.builder import build_ray_engine

    typo = {f"specdec_{role}s": 1}  # the typo a config could carry
    config = _config(tiny_llama, tiny_llama_draft, timeout_s=5.0,
                     **{f"{role}_resources": typo})
    started = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        build_ray_engine(config)
    message = str(e.value)
    what = "2 target shard(s)" if role == "target" else "the draft worker"
    assert f"cannot place {what}" in message and f"specdec_{role}s" in message
    assert "no node of the cluster offers" in message
    assert time.monotonic() - started < 60
