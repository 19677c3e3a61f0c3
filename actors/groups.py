"""The shard group and the draft worker: placement, start-up, teardown, and the group's supervision
(`TargetGroupSupervisor`); no driver logic here.

Target shards go into one STRICT_PACK placement group (tensor parallelism needs a fast
interconnect); a separate draft worker is placed by its own resources, so on a cluster it can sit
on a different kind of node; a colocated draft lives in the rank-0 shard's process (its CPUs are
added to that shard's bundle). The coordinator uses these; `builder.py` starts the coordinator.
Both kinds of actor run their `progress` method in a concurrency group of its own (`HEALTH_GROUP`):
a thread beside the one that runs forwards, so the health check gets an answer mid-forward.

Supervision: every shard call goes through `TargetGroupSupervisor`, which gives the live group's
shards, gathers their results (a dead or failed shard raises as soon as Ray reports it, not after
its siblings give up in their collective), drops a broken group at once (so the step's requests
fail fast) and rebuilds it after the step, outside any request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.config import RayEngineConfig, RolePlacement
from actors.placement import cluster_nodes, describe_bundles, shard_bundles, shortfall

logger = logging.getLogger(__name__)

#: The concurrency group of the actors' `progress` calls (`actor.progress.options(concurrency_group=...)`):
#: one thread of its own, so it answers while the default group's thread runs a forward.
HEALTH_GROUP = "health"


def _actor_class(cls):
    """`cls` as a Ray actor class with the health concurrency group (threaded: the default group
    keeps one thread, so the model's calls still run one at a time, in submission order)."""
    return ray.remote(concurrency_groups={HEALTH_GROUP: 1})(cls)


def _role_options(role: RolePlacement) -> dict:
    options: dict = {"num_cpus": role.num_cpus, "num_gpus": role.num_gpus}
    if role.resources:
        options["resources"] = dict(role.resources)
    if role.accelerator_type:
        options["accelerator_type"] = role.accelerator_type
    return options


def target_config(config: RayEngineConfig):
    """The target's Hugging Face config, read before any actor starts: for a model directory (or a
    cached preset) always, for a GGUF file or a hub id only under tensor parallelism (reading those
    costs a GGUF parse or a download). None otherwise."""
    from transformers import AutoConfig

    from specdec.models.loading import materialize, resolve_spec

    resolved = materialize(resolve_spec(config.engine.target))
    if resolved.kind != "dir" and config.tp == 1:
        return None
    kwargs = {"gguf_file": resolved.gguf_file} if resolved.gguf_file else {}
    return AutoConfig.from_pretrained(resolved.path, trust_remote_code=config.engine.trust_remote_code, **kwargs)


def _text_config(model_config):
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


def check_tp_divides(model_config, tp_size: int) -> None:
    """Tensor parallelism splits attention heads and MLP columns: refuse sizes that do not divide,
    from the target's config (`target_config`), before any resources are reserved or shards start."""
    if tp_size == 1:
        return
    text = _text_config(model_config)
    sizes = {
        "num_attention_heads": getattr(text, "num_attention_heads", None),
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None),
        "intermediate_size": getattr(text, "intermediate_size", None),
    }
    bad = {k: v for k, v in sizes.items() if v is not None and v % tp_size}
    if bad:
        detail = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise ValueError(f"tensor parallel size {tp_size} does not divide the target's {detail}")


def expected_vocab_size(model_config) -> int | None:
    """The width of the target's logits as its config states it (checked against the loaded shards)."""
    size = getattr(_text_config(model_config), "vocab_size", None) if model_config is not None else None
    return int(size) if isinstance(size, int) and size > 0 else None


async def reserve_draft(config: RayEngineConfig):
    """The separate draft worker's placement group (its role's resources), reserved before the target
    loads: a role no node offers fails within the placement timeout, not after minutes of loading."""
    return await _reserve([config.draft_role.bundle()], "the draft worker", config.placement_timeout_s)


def create_draft_worker(config: RayEngineConfig, target_vocab_size: int, pg):
    """The separate draft worker in its placement group (`reserve_draft`); Ray restarts it there."""
    from actors.draft_worker import DraftWorker

    options = _role_options(config.draft_role)
    options.pop("resources", None)  # reserved by the bundle
    options.pop("accelerator_type", None)
    actor = (_actor_class(DraftWorker)
             .options(max_restarts=config.draft_max_restarts, max_task_retries=0,
                      scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
                      **options)
             .remote(config.engine, target_vocab_size, config.draft_role.num_threads))
    return actor


async def _reserve(bundles: list[dict], what: str, timeout_s: float):
    """A STRICT_PACK placement group of `bundles`, ready, or a RuntimeError that names what is missing."""
    pg = placement_group(bundles, strategy="STRICT_PACK")
    try:
        await asyncio.wait_for(pg.ready(), timeout=timeout_s)
    except asyncio.TimeoutError:
        remove_placement_group(pg)
        raise RuntimeError(f"cannot place {what} ({describe_bundles(bundles)}) on one node within {timeout_s:.0f}s: "
                           f"{_shortfall(bundles)}") from None
    return pg


def _shortfall(bundles: list[dict]) -> str:
    """Why no node holds the bundles: the resources no alive node has enough of, or busy nodes."""
    nodes = cluster_nodes(available=False)
    short = shortfall({n.name: n.resources for n in nodes}, bundles)
    if short.startswith("no node has"):
        return (short.replace(" free (most", " (most").replace("no node has", "no node of the cluster offers", 1)
                + "; start nodes with these resources (`ray start --resources`, or a node type of cluster.yaml) "
                  "or change the role's resources")
    return f"nodes offer these resources but they are in use; free now: {ray.available_resources()}"


@dataclass
class TargetGroup:
    shards: list
    placement_group: object
    info: dict


async def create_target_group(config: RayEngineConfig) -> TargetGroup:
    """tp shard actors in one STRICT_PACK placement group, joined into one process group."""
    from actors.target_shard import TargetShard

    bundles = shard_bundles(config)  # rank 0 also holds a colocated draft's CPUs
    pg = await _reserve(bundles, f"{config.tp} target shard(s)", config.placement_timeout_s)
    shards = []
    for rank in range(config.tp):
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)
        options = _role_options(config.target_role)
        options.pop("resources", None)  # already reserved by the bundle
        options.pop("accelerator_type", None)
        options["num_cpus"] = bundles[rank].get("CPU", 0.0)
        host_draft = config.colocated and rank == 0
        shards.append(_actor_class(TargetShard)
                      .options(scheduling_strategy=strategy, max_restarts=0, max_task_retries=0, **options)
                      .remote(config.engine, rank, config.tp, config.target_role.num_threads, host_draft))
    try:
        host, port = await shards[0].address.remote()
        infos = await asyncio.gather(*[s.setup.remote(host, port, config.process_group_timeout_s) for s in shards])
    except BaseException:
        kill_target_group(TargetGroup(shards, pg, {}))
        raise
    # Rank 0 speaks for the group, but KV memory is each shard's: the coordinator's budget needs all.
    return TargetGroup(shards, pg, {**infos[0], "available_memory": [i.get("available_memory") for i in infos]})


def kill_target_group(group: TargetGroup | None) -> None:
    if group is None:
        return
    for shard in group.shards:
        try:
            ray.kill(shard, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass
    try:
        remove_placement_group(group.placement_group)
    except Exception:  # noqa: BLE001
        pass


class TargetShardError(RuntimeError):
    """A target shard failed or died; the request cannot complete."""


class TargetGroupSupervisor:
    """One engine's target shard group, kept up. `shards()` gives the live group (rebuilding it first
    if it is down), `gather` waits for every shard's result, `drop` kills a broken group without
    waiting for a new one, and `rebuild_if_broken` (after the step) replaces it. A group being rebuilt
    is recovering (`rebuilding`); one whose rebuild failed is `broken` until the next try."""

    def __init__(self, config: RayEngineConfig) -> None:
        self.config = config
        self.group: TargetGroup | None = None
        self.broken: str | None = None  # why the group was dropped, until it is rebuilt
        self.rebuilding = False  # a new group is being built (or will be, after this step)
        self.stopping = False
        self.last_progress = time.monotonic()  # when a shard call last completed
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> dict:
        """Start the group (on the caller's event loop, which later rebuilds use); its rank 0's info."""
        self._loop = asyncio.get_running_loop()
        self.group = await create_target_group(self.config)
        return self.group.info

    def shards(self) -> list:
        if self.group is None:
            self.rebuild(self.broken or "no shard group")
        if self.group is None:
            raise TargetShardError("the target shard group is down and could not be rebuilt")
        return self.group.shards

    def gather(self, refs: list) -> list:
        """Every shard's result. A failed or dead shard raises as soon as Ray reports it: not after
        the others, which wait in their collective for it, give up."""
        pending = refs
        while len(pending) > 1:
            ready, pending = ray.wait(pending, num_returns=1)
            ray.get(ready)
        results = ray.get(refs)
        self.last_progress = time.monotonic()
        return results

    def drop(self, reason: str) -> None:
        """Kill a broken group (its process group cannot lose a member) without waiting for a new one:
        the step's requests fail at once, and `rebuild_if_broken` rebuilds it after the step."""
        kill_target_group(self.group)
        self.group = None
        self.broken = reason
        self.rebuilding = not self.stopping

    def rebuild_if_broken(self) -> None:
        """After a step (its requests already answered, a failed one's with its error): rebuild a group
        the step found broken, so the next request and the health check find it up."""
        if self.group is None and self.broken is not None and not self.stopping:
            self.rebuild(self.broken)

    def rebuild(self, reason: str) -> None:
        """Replace the whole group; blocks the calling (scheduler) thread. Not while shutting down: the
        kill that fails a running call would otherwise start a group (actors and a placement group)
        that nothing owns any more."""
        kill_target_group(self.group)
        self.group = None
        if self.stopping:
            self.rebuilding = False
            return
        logger.warning("rebuilding the target shard group: %s", reason)
        started = time.monotonic()
        self.rebuilding = True
        try:
            group = asyncio.run_coroutine_threadsafe(create_target_group(self.config), self._loop).result()
        except Exception:  # noqa: BLE001 - the next step fails with a clear error and retries
            logger.exception("rebuilding the target shard group failed")
            self.rebuilding = False
            return
        if self.stopping:  # shut down while it was being built
            kill_target_group(group)
            self.rebuilding = False
            return
        self.group, self.broken, self.rebuilding = group, None, False
        logger.warning("target shard group rebuilt in %.1fs", time.monotonic() - started)

    def shutdown(self) -> None:
        self.stopping = True
        kill_target_group(self.group)
        self.group = None
