"""Where each role of each replica goes: a plan made from the cluster's nodes before anything starts.

`RayEngineConfig` says what each role asks for; what a GPU role gets by default depends on the
machine, so the plan is made against the cluster's nodes (`ray.nodes()`), the way Ray's scheduler
will place the placement groups (`groups.py`): a replica's target shards in one STRICT_PACK group
(one node), a separate draft worker in a group of its own (any node).

The default on GPUs (no role names GPUs, an accelerator type or a custom resource), as vLLM does it:
- each target shard takes one whole GPU, all tp of them on one node;
- the draft gets a GPU of its own where a node has one more GPU than the shards take (it then
  pre-drafts while the target verifies); otherwise it runs inside the rank-0 shard, on its GPU
  (colocated), so one GPU serves tp 1 with a draft model.
A role that names its resources is placed as named (fractional GPUs such as `num_gpus: 0.5` share a
GPU through Ray's accounting); a plan that cannot fit says which resource is short, on which node,
before any model loads (`specdec serve --plan` prints it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from actors.config import RayEngineConfig

#: Resource keys Ray adds to every node that say nothing about capacity for our roles.
_IGNORED = ("memory", "object_store_memory")


@dataclass(frozen=True)
class Node:
    """A node's free resources (what `ray.available_resources()` counts per node)."""

    name: str  # its IP address (and node id prefix when several share one address)
    resources: dict[str, float]

    @classmethod
    def from_ray(cls, entry: dict) -> "Node":
        name = entry.get("NodeManagerAddress", "?")
        node_id = entry.get("NodeID", "")
        return cls(f"{name} ({node_id[:8]})" if node_id else name, dict(entry.get("Resources", {})))


@dataclass
class Placed:
    role: str  # "target shard 0", "draft"
    bundle: dict[str, float]
    node: str | None  # None: nowhere


@dataclass
class ReplicaPlan:
    replica: int
    draft_placement: str  # colocated, separate or none
    roles: list[Placed] = field(default_factory=list)
    missing: str | None = None  # why it cannot be placed

    @property
    def fits(self) -> bool:
        return self.missing is None


def cluster_nodes(available: bool = True) -> list[Node]:
    """The alive nodes of the connected Ray cluster, with their free (or total) resources."""
    import ray

    if not available:
        return [Node.from_ray(n) for n in ray.nodes() if n.get("Alive")]
    per_node = _available_per_node()
    nodes = []
    for entry in ray.nodes():
        if entry.get("Alive"):
            node = Node.from_ray(entry)
            free = per_node.get(entry.get("NodeID"))
            nodes.append(node if free is None else dataclasses.replace(node, resources=free))
    return nodes


def _available_per_node() -> dict[str, dict[str, float]]:
    """Free resources per node id (Ray's global state), {} when Ray does not report them."""
    try:
        from ray._private.state import state  # the same table `ray status` reads

        return {node_id: dict(res) for node_id, res in state.available_resources_per_node().items()}
    except Exception:  # noqa: BLE001 - an internal API: fall back to the totals
        return {}


def gpus_per_node(nodes: list[Node]) -> float:
    return max((n.resources.get("GPU", 0.0) for n in nodes), default=0.0)


def resolve(config: RayEngineConfig, nodes: list[Node]) -> RayEngineConfig:
    """`config` with its GPU defaults decided for these nodes (see the module docstring); a config
    that names its roles' resources, or runs on CPUs, is returned as it is."""
    if not config.gpu_defaults:
        return config
    need = config.tp + 1  # the shards' GPUs, plus one for a separate draft
    separate = config.engine.draft != "none" and any(n.resources.get("GPU", 0.0) >= need for n in nodes)
    placement = "separate" if separate else "colocated"
    return dataclasses.replace(config, draft_placement=placement, gpu_defaults=False,
                               pipeline=config.pipeline and separate)


def plan(config: RayEngineConfig, nodes: list[Node], replicas: int = 1) -> list[ReplicaPlan]:
    """Each replica's roles on `nodes`, placed as Ray will (first fit, in node order, resources
    taken as they are placed); a replica that does not fit names what is short."""
    config = resolve(config, nodes)
    free = {n.name: {k: v for k, v in n.resources.items() if k not in _IGNORED} for n in nodes}
    plans = []
    for replica in range(replicas):
        has_draft = config.engine.draft != "none"
        placement = "none" if not has_draft else ("colocated" if config.colocated else "separate")
        rp = ReplicaPlan(replica, placement)
        shards = shard_bundles(config)
        node = _first_fit(free, shards)
        for rank, bundle in enumerate(shards):
            rp.roles.append(Placed(f"target shard {rank}" + (" + draft" if rank == 0 and config.colocated else ""),
                                   bundle, node))
        if node is None:
            rp.missing = (f"{config.tp} target shard(s) need {describe_bundles(shards)} on one node: "
                          f"{shortfall(free, shards)}")
        else:
            _take(free[node], shards)
        if placement == "separate":
            draft = [config.draft_role.bundle()]
            where = _first_fit(free, draft)
            rp.roles.append(Placed("draft", draft[0], where))
            if where is None:
                rp.missing = (rp.missing + "; " if rp.missing else "") + \
                    f"the draft worker needs {describe_bundles(draft)}: {shortfall(free, draft)}"
            else:
                _take(free[where], draft)
        plans.append(rp)
    return plans


def shard_bundles(config: RayEngineConfig) -> list[dict[str, float]]:
    """The target group's placement-group bundles, one per shard; rank 0 also holds a colocated
    draft's CPUs (the draft runs in its process, on its device)."""
    bundles = [dict(config.target_role.bundle()) for _ in range(config.tp)]
    if config.colocated:
        bundles[0]["CPU"] = bundles[0].get("CPU", 0.0) + (config.draft_role.num_cpus or 0.0)
    return bundles


def _total(bundles: list[dict]) -> dict[str, float]:
    total: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            total[key] = total.get(key, 0.0) + value
    return total


def describe_bundles(bundles: list[dict]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in _total(bundles).items() if v)


def _fits(free: dict[str, float], need: dict[str, float]) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in need.items() if v)


def _first_fit(free: dict[str, dict[str, float]], bundles: list[dict]) -> str | None:
    need = _total(bundles)
    return next((name for name, res in free.items() if _fits(res, need)), None)


def _take(free: dict[str, float], bundles: list[dict]) -> None:
    for k, v in _total(bundles).items():
        free[k] = free.get(k, 0.0) - v


def shortfall(free: dict[str, dict[str, float]], bundles: list[dict]) -> str:
    """What no node has enough of: per missing resource the most any one node has free."""
    need = _total(bundles)
    missing = [k for k, v in need.items() if v and not any(res.get(k, 0.0) + 1e-9 >= v for res in free.values())]
    if missing:
        return "no node has " + ", ".join(
            f"{need[k]:g} {k} free (most on one node: {max((r.get(k, 0.0) for r in free.values()), default=0.0):g})"
            for k in missing)
    return "each resource is free on some node, but no node has all of them at once"


def render(plans: list[ReplicaPlan], nodes: list[Node]) -> str:
    """The plan as text: the nodes, then each replica's roles and where they go."""
    lines = ["nodes (free resources):"]
    for n in nodes:
        res = ", ".join(f"{v:g} {k}" for k, v in sorted(n.resources.items()) if k not in _IGNORED
                        and not k.startswith("node:"))
        lines.append(f"  {n.name}: {res or 'nothing free'}")
    for rp in plans:
        lines.append(f"replica {rp.replica} (draft {rp.draft_placement}):")
        for placed in rp.roles:
            bundle = ", ".join(f"{v:g} {k}" for k, v in placed.bundle.items() if v)
            lines.append(f"  {placed.role:<24} {bundle:<36} -> {placed.node or 'NOWHERE'}")
        if rp.missing:
            lines.append(f"  cannot place: {rp.missing}")
    ok = all(rp.fits for rp in plans)
    lines.append("fits" if ok else "does not fit: start nodes with the missing resources (`ray start --num-gpus`, "
                                   "`--resources`, or a node type of cluster.yaml), or ask for less")
    return "\n".join(lines)
