"""Placement plans (`actors/placement.py`, `specdec serve --plan`) on real multi-node Ray clusters
on one machine (`ray.cluster_utils.Cluster`): nodes declare GPUs, accelerator types and custom
resources to Ray's scheduler, which needs no real GPU to reserve them. Each plan is checked against
what Ray itself does: the plan's placement groups are reserved and land on the nodes the plan names.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from actors.config import RayEngineConfig, RolePlacement
from actors.placement import Node, cluster_nodes, plan, render, resolve, shard_bundles
from specdec.config import EngineConfig

ROOT = Path(__file__).parents[2]
MIB = 1024**2


def _engine(device="cuda", draft="d") -> EngineConfig:
    return EngineConfig(target="t", draft=draft, device=device, num_threads=1)


def _gpu_config(tp=1, draft="d", **roles) -> RayEngineConfig:
    return RayEngineConfig(engine=_engine(draft=draft), tp=tp, **roles)


@pytest.fixture(scope="module")
def clusters():
    """Start a cluster of the given nodes (each: num_cpus, num_gpus, resources), connected, and
    stop the last one; the session's local Ray is stopped meanwhile and started again after."""
    import ray
    from ray.cluster_utils import Cluster

    from tests.conftest import start_session_ray

    restart = ray.is_initialized()
    if restart:
        ray.shutdown()
    current: list = []

    def start(*nodes: dict):
        if current:
            ray.shutdown()
            current.pop().shutdown()
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 80 * MIB,
                                                          "include_dashboard": False})  # test_cluster.py has 8265
        ids = [c.add_node(object_store_memory=80 * MIB, **node).node_id for node in nodes]
        current.append(c)
        ray.init(address=c.address)
        c.wait_for_nodes()
        deadline = time.monotonic() + 30
        while len([n for n in ray.nodes() if n["Alive"]]) < len(nodes) + 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        return c, ids

    yield start
    ray.shutdown()
    if current:
        current.pop().shutdown()
    if restart:
        start_session_ray()


def _lands_where_planned(plans, nodes: list[Node], config: RayEngineConfig) -> None:
    """Reserve each replica's placement groups as `actors.groups` does and check the node Ray chose
    is the node the plan named (or, with several equal nodes, one that offers the same resources)."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    config = resolve(config, nodes)
    by_name = {n.name: n for n in nodes}
    groups = []
    try:
        for rp in plans:
            reserved = [(shard_bundles(config), rp.roles[0].node)]
            if rp.draft_placement == "separate":
                reserved.append(([config.draft_role.bundle()], rp.roles[-1].node))
            for bundles, planned in reserved:
                pg = placement_group(bundles, strategy="STRICT_PACK")
                groups.append(pg)
                assert ray.get(pg.ready(), timeout=30)
                node_id = placement_group_table(pg)["bundles_to_node_id"][0]
                landed = next(n for n in nodes if n.name.endswith(f"({node_id[:8]})"))
                wanted = {k: v for k, v in by_name[planned].resources.items() if not k.startswith("node:")}
                got = {k: v for k, v in landed.resources.items() if not k.startswith("node:")}
                assert landed.name == planned or set(got) == set(wanted), (landed.name, planned)
    finally:
        for pg in groups:
            remove_placement_group(pg)


def test_one_gpu_runs_tp1_with_the_draft_on_the_targets_gpu(clusters):
    clusters({"num_cpus": 2, "num_gpus": 1})
    nodes = cluster_nodes()
    config = _gpu_config()
    assert config.gpu_defaults and config.colocated  # before the cluster is known: what fits one GPU
    plans = plan(config, nodes)
    assert plans[0].fits and plans[0].draft_placement == "colocated"
    assert [r.bundle.get("GPU") for r in plans[0].roles] == [1.0]
    _lands_where_planned(plans, nodes, config)
    # A second replica does not fit on one GPU: the plan says what is short.
    two = plan(config, nodes, replicas=2)
    assert two[0].fits and not two[1].fits and "1 GPU" in two[1].missing and "most on one node: 0" in two[1].missing
    # Fractional GPUs, named: two replicas share the GPU, each with a separate draft on it too.
    half = _gpu_config(target_role=RolePlacement(num_gpus=0.25, num_cpus=0.5),
                       draft_role=RolePlacement(num_gpus=0.25, num_cpus=0.5))
    assert not half.gpu_defaults and half.draft_placement == "separate"
    shared = plan(half, nodes, replicas=2)
    assert all(p.fits for p in shared) and len({r.node for p in shared for r in p.roles}) == 1
    _lands_where_planned(shared, nodes, half)


def test_two_gpus_give_the_draft_a_gpu_of_its_own_and_tp2_colocates(clusters):
    clusters({"num_cpus": 4, "num_gpus": 2})
    nodes = cluster_nodes()
    one = plan(_gpu_config(), nodes)
    assert one[0].fits and one[0].draft_placement == "separate"
    assert resolve(_gpu_config(), nodes).pipeline  # a draft GPU of its own pre-drafts
    _lands_where_planned(one, nodes, _gpu_config())
    two = plan(_gpu_config(tp=2), nodes)
    assert two[0].fits and two[0].draft_placement == "colocated" and len(two[0].roles) == 2
    _lands_where_planned(two, nodes, _gpu_config(tp=2))
    three = plan(_gpu_config(tp=3), nodes)
    assert not three[0].fits and "3 GPU" in three[0].missing


def test_an_a100_node_and_an_l4_node_take_the_roles_that_name_them(clusters):
    clusters({"num_cpus": 2, "num_gpus": 1, "resources": {"accelerator_type:A100": 1}},
             {"num_cpus": 2, "num_gpus": 1, "resources": {"accelerator_type:L4": 1}})
    nodes = cluster_nodes()
    config = _gpu_config(target_role=RolePlacement(accelerator_type="A100"),
                         draft_role=RolePlacement(accelerator_type="L4"))
    plans = plan(config, nodes)
    assert plans[0].fits and plans[0].draft_placement == "separate"
    target_node = next(n for n in nodes if "accelerator_type:A100" in n.resources).name
    draft_node = next(n for n in nodes if "accelerator_type:L4" in n.resources).name
    assert plans[0].roles[0].node == target_node and plans[0].roles[1].node == draft_node
    _lands_where_planned(plans, nodes, config)
    # More than exists fails fast, naming the resource and the most any node has.
    greedy = _gpu_config(tp=2, target_role=RolePlacement(accelerator_type="A100"),
                         draft_role=RolePlacement(accelerator_type="L4"))
    missing = plan(greedy, nodes)[0].missing
    assert "2 GPU" in missing and "accelerator_type:A100" in missing and "most on one node: 1" in missing


def test_the_shipped_cluster_yaml_fits_cluster_serve_yaml(clusters):
    """cluster.yaml's node types (one of each) and cluster-serve.yaml's args: its two replicas of tp 4
    take the A100 node's 8 GPUs (`specdec_target`), each draft a g5's GPU (`specdec_draft`). CPUs are
    left out on both sides (a raylet declaring 96 CPUs would prestart workers for them here)."""
    cluster = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    serve = yaml.safe_load((ROOT / "deployments" / "cluster-serve.yaml").read_text())
    args = dict(serve["applications"][0]["args"])
    types = cluster["available_node_types"]
    nodes = []
    for name in sorted(types):
        if name == "head":
            continue
        res = dict(types[name]["resources"])
        res.pop("CPU")
        gpus = res.pop("GPU", 0)
        nodes.append({"num_cpus": 1, "num_gpus": gpus, "resources": res})
    clusters(*nodes)
    live = cluster_nodes()
    engine = EngineConfig(target="t", draft="d", device="cuda", num_threads=1)
    config = RayEngineConfig(engine=engine, tp=args["tp"], draft_placement=args["draft_placement"],
                             target_role=RolePlacement(**{**args["target_role"], "num_cpus": 0}),
                             draft_role=RolePlacement(**{**args["draft_role"], "num_cpus": 0}))
    replicas = args["replicas"]
    per_draft_node = int(types[next(n for n in types if "specdec_draft" in types[n]["resources"])]["resources"]
                         ["specdec_draft"])
    plans = plan(config, live, replicas=per_draft_node)
    assert all(p.fits for p in plans), render(plans, live)
    _lands_where_planned(plans, live, config)
    # The yaml asks for `replicas` replicas: with one draft node of each type, the rest need more nodes.
    everything = plan(config, live, replicas=replicas)
    assert [p.fits for p in everything] == [True] * per_draft_node + [False] * (replicas - per_draft_node)
    assert "specdec_draft" in everything[-1].missing


def test_serve_plan_prints_the_plan_and_exits_1_when_it_cannot_fit(clusters, tmp_path):
    c, _ = clusters({"num_cpus": 2, "num_gpus": 1})
    target = tmp_path / "model"
    target.mkdir()  # --plan reads no model; the path only has to exist for the options' checks
    base = [sys.executable, "-m", "specdec.cli", "serve", "--plan", "--ray-address", c.address, "--target", str(target),
            "--draft", str(target), "--device", "cuda"]
    ok = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "draft colocated" in ok.stdout and "target shard 0 + draft" in ok.stdout and ok.stdout.rstrip().endswith("fits")
    short = subprocess.run(base + ["--tp", "2"], capture_output=True, text=True, timeout=120)
    assert short.returncode == 1, short.stderr
    assert "cannot place" in short.stdout and "2 GPU" in short.stdout and "most on one node: 1" in short.stdout


def test_cpu_only_plans_are_unchanged():
    nodes = [Node("cpu-box", {"CPU": 2.0})]
    config = RayEngineConfig(engine=_engine(device="cpu"), tp=2)
    assert not config.gpu_defaults and config.colocated
    plans = plan(config, nodes)
    assert plans[0].fits and [r.bundle for r in plans[0].roles] == [{"CPU": 1.0}, {"CPU": 0.5}]
