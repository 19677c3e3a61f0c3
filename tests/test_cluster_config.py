"""cluster.yaml and deployments/cluster-serve.yaml, checked offline with Ray's own validators (the
autoscaler's schema and defaults, as Ray's tests do; Serve's deploy schema) and against each other:
every role resource the Serve config asks for is offered by a node type, enough of it on one node
for a replica's TP shards, and enough node types' worth for all replicas."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
INTERNAL_PORTS = {6379, 8265, 10001, 8080, 8000}


@pytest.fixture(scope="module")
def cluster() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


@pytest.fixture(scope="module")
def serve_config() -> dict:
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load((ROOT / "deployments" / "cluster-serve.yaml").read_text())
    ServeDeploySchema.model_validate(raw)  # Serve's own schema, as `serve deploy` applies it
    return raw


def test_cluster_yaml_passes_rays_autoscaler_validation(cluster):
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(cluster))
    validate_config(prepared)
    assert prepared["provider"]["type"] == "aws"
    assert prepared["head_node_type"] == "head"


def test_a_broken_cluster_yaml_fails_the_validation(cluster):
    """The negative control: an unknown field where Ray's schema allows none."""
    import jsonschema

    from ray.autoscaler._private.util import prepare_config, validate_config

    broken = copy.deepcopy(cluster)
    broken["available_node_types"]["draft-a10g"]["resourcez"] = {"specdec_draft": 1}
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(broken))


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv("SPECDEC_API_KEY", "sk-cluster-test")  # as ~/.specdec.env gives it on the nodes


def _options(serve_config: dict):
    from deployments.config import ServeOptions

    (app,) = serve_config["applications"]
    assert app["import_path"] == "deployments.builder:build_app"
    options = ServeOptions(**app["args"])
    return options, options.ray_engine_config()  # the engine's own checks, as at deploy time


def test_cluster_serve_config_parses_and_builds_a_separate_pipelined_engine(serve_config):
    options, config = _options(serve_config)
    assert config.draft_placement == "separate" and config.pipeline and config.tp >= 2
    assert "api_key" not in serve_config["applications"][0]["args"]  # from $SPECDEC_API_KEY, never in the file
    assert serve_config["http_options"]["host"] == "127.0.0.1"


def test_the_cluster_service_refuses_to_build_without_an_api_key(serve_config, monkeypatch):
    from pydantic import ValidationError

    monkeypatch.delenv("SPECDEC_API_KEY")
    with pytest.raises(ValidationError, match="require_api_key: no API key is set"):
        _options(serve_config)


def _node_types(cluster: dict) -> dict[str, tuple[dict, int]]:
    return {name: (t["resources"], t.get("max_workers", 0)) for name, t in cluster["available_node_types"].items()
            if name != cluster["head_node_type"]}


def test_every_role_resource_is_offered_by_a_node_type_with_enough_for_the_tp_size(cluster, serve_config):
    options, config = _options(serve_config)
    node_types = _node_types(cluster)
    shard, draft = config.target_role.bundle(), config.draft_role.bundle()
    # All TP shards of one replica share one node (STRICT_PACK).
    one_replica = {key: value * config.tp for key, value in shard.items()}
    for role, need, count in (("target", one_replica, options.replicas), ("draft", draft, options.replicas)):
        fits = {name: min(int(res.get(k, 0) // v) for k, v in need.items() if v) * workers
                for name, (res, workers) in node_types.items()}
        capable = {name: n for name, n in fits.items() if n}
        assert capable, f"no node type of cluster.yaml offers the {role} role's {need}"
        assert sum(capable.values()) >= count, f"{role}: {count} replicas need more than {capable}"
    custom = set(config.target_role.resources) | set(config.draft_role.resources)
    assert custom and all(re.fullmatch(r"specdec_[a-z]+", name) for name in custom)


def test_a_role_resource_typo_is_caught(cluster, serve_config):
    """The negative control of the check above."""
    broken = copy.deepcopy(serve_config)
    broken["applications"][0]["args"]["draft_role"]["resources"] = {"specdec_drafts": 1}
    with pytest.raises(AssertionError, match="no node type"):
        test_every_role_resource_is_offered_by_a_node_type_with_enough_for_the_tp_size(cluster, broken)


def test_internal_ports_are_not_opened_and_ray_starts_as_documented(cluster):
    """Ray's AWS bootstrap opens SSH (22) to the internet and all ports to the cluster's own security
    group (`_create_default_inbound_rules`); rules added by the config must not open more."""
    text = (ROOT / "cluster.yaml").read_text()
    extra = cluster["provider"].get("security_group", {}).get("IpPermissions", [])
    public = [(r.get("FromPort"), r.get("ToPort")) for r in extra
              if any(ip.get("CidrIp") in ("0.0.0.0/0",) for ip in r.get("IpRanges", []))
              or r.get("Ipv6Ranges")]
    assert not any(lo == -1 or lo <= port <= hi for lo, hi in public for port in INTERNAL_PORTS), public
    head = " ".join(cluster["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "--metrics-export-port=8080" in head
    assert "--metrics-export-port=8080" in " ".join(cluster["worker_start_ray_commands"])
    assert "pip install -e ~/specdec" in text and "torch==2.13.0" in text
