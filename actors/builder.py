"""The one place where Ray options are applied: actors and placement from `RayEngineConfig`.

    from actors import RayEngineConfig, build_ray_engine
    engine = build_ray_engine(RayEngineConfig(engine=EngineConfig(target=..., draft=...), tp_size=2))
    out = engine.generate(prompt="def fib(n):")           # same contract as SpeculativeEngine
    for chunk in engine.generate_stream(prompt="..."): ...
    engine.shutdown()

Target shards go into one STRICT_PACK placement group (tensor parallelism needs a fast
interconnect); a separate draft worker is placed by its own resources, so on a cluster it can sit
on a different kind of node; a colocated draft lives in the rank-0 shard's process (its CPUs are
added to that shard's bundle).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.config import RayEngineConfig, RolePlacement
from specdec import model_cache
from specdec.config import SamplingParams
from specdec.presets import is_preset
from specdec.sequence import GenerationOutput, StreamChunk

logger = logging.getLogger(__name__)

# Worker processes: quiet libraries, no tokenizer thread pools fighting torch for the cores.
_WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error",
               "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}


def ensure_ray(address: str | None = None, num_cpus: int | None = None,
               object_store_memory: int = 512 * 1024**2, metrics_export_port: int | None = None) -> None:
    """Join `address` / $RAY_ADDRESS if given, else start a small local Ray (if none is running)
    whose metrics agent exports on `metrics_export_port` (None: a free port) and whose workers
    report metrics every `actors.metrics.REPORT_INTERVAL_MS`."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    runtime_env = {"env_vars": _WORKER_ENV}
    if address:
        ray.init(address=address, runtime_env=runtime_env, logging_level=logging.WARNING)
    else:
        from actors.metrics import REPORT_INTERVAL_MS

        ray.init(num_cpus=num_cpus, object_store_memory=object_store_memory, include_dashboard=False,
                 runtime_env=runtime_env, logging_level=logging.WARNING, _metrics_export_port=metrics_export_port,
                 _system_config={"metrics_report_interval_ms": REPORT_INTERVAL_MS})


def metrics_export_port() -> int:
    """The metrics export port of the node this process runs on (Ray's agent serves /metrics there)."""
    return int(ray._private.worker.global_worker.node.metrics_export_port)


def _role_options(role: RolePlacement) -> dict:
    options: dict = {"num_cpus": role.num_cpus, "num_gpus": role.num_gpus}
    if role.resources:
        options["resources"] = dict(role.resources)
    if role.accelerator_type:
        options["accelerator_type"] = role.accelerator_type
    return options


async def reserve_draft(config: RayEngineConfig):
    """The separate draft worker's placement group (its role's resources), reserved before the target
    loads: a role no node offers fails within the placement timeout, not after minutes of loading."""
    return await _reserve([config.draft.bundle()], "the draft worker", config.placement_timeout_s)


def create_draft_worker(config: RayEngineConfig, target_vocab_size: int, pg):
    """The separate draft worker in its placement group (`reserve_draft`); Ray restarts it there."""
    from actors.draft_worker import DraftWorker

    options = _role_options(config.draft)
    options.pop("resources", None)  # reserved by the bundle
    options.pop("accelerator_type", None)
    actor = (ray.remote(DraftWorker)
             .options(max_restarts=config.draft_max_restarts, max_task_retries=0,
                      scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
                      **options)
             .remote(config.engine, target_vocab_size, config.draft.num_threads))
    return actor


async def _reserve(bundles: list[dict], what: str, timeout_s: float):
    """A STRICT_PACK placement group of `bundles`, ready, or a RuntimeError that names what is missing."""
    pg = placement_group(bundles, strategy="STRICT_PACK")
    try:
        await asyncio.wait_for(pg.ready(), timeout=timeout_s)
    except asyncio.TimeoutError:
        remove_placement_group(pg)
        raise RuntimeError(f"cannot place {what} ({_describe(bundles)}) on one node within {timeout_s:.0f}s: "
                           f"{_shortfall(bundles)}") from None
    return pg


def _total(bundles: list[dict]) -> dict[str, float]:
    total: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            total[key] = total.get(key, 0.0) + value
    return total


def _describe(bundles: list[dict]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in _total(bundles).items() if v)


def _shortfall(bundles: list[dict]) -> str:
    """Why no node holds the bundles: the resources no alive node has enough of, or busy nodes."""
    need = _total(bundles)
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    missing = [key for key, value in need.items() if value and not any(node.get(key, 0.0) >= value for node in nodes)]
    if missing:
        offered = {key: max((node.get(key, 0.0) for node in nodes), default=0.0) for key in missing}
        return ("no node of the cluster offers " + ", ".join(f"{need[k]:g} {k} (most on one node: {offered[k]:g})"
                                                             for k in missing)
                + "; start nodes with these resources (`ray start --resources`, or a node type of cluster.yaml) or "
                  "change the role's resources")
    return f"nodes offer these resources but they are in use; free now: {ray.available_resources()}"


@dataclass
class TargetGroup:
    shards: list
    placement_group: object
    info: dict


async def create_target_group(config: RayEngineConfig) -> TargetGroup:
    """tp_size shard actors in one STRICT_PACK placement group, joined into one process group."""
    from actors.target_shard import TargetShard

    bundle = config.target.bundle()
    bundles = [dict(bundle) for _ in range(config.tp_size)]
    if config.colocated:  # rank 0 also runs the draft
        bundles[0]["CPU"] = bundles[0].get("CPU", 0.0) + config.draft.num_cpus
    pg = await _reserve(bundles, f"{config.tp_size} target shard(s)", config.placement_timeout_s)
    shards = []
    for rank in range(config.tp_size):
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)
        options = _role_options(config.target)
        options.pop("resources", None)  # already reserved by the bundle
        options.pop("accelerator_type", None)
        options["num_cpus"] = bundles[rank].get("CPU", 0.0)
        host_draft = config.colocated and rank == 0
        shards.append(ray.remote(TargetShard)
                      .options(scheduling_strategy=strategy, max_restarts=0, max_task_retries=0, **options)
                      .remote(config.engine, rank, config.tp_size, config.target.num_threads, host_draft))
    try:
        host, port = await shards[0].address.remote()
        infos = await asyncio.gather(*[s.setup.remote(host, port, config.process_group_timeout_s) for s in shards])
    except BaseException:
        kill_target_group(TargetGroup(shards, pg, {}))
        raise
    return TargetGroup(shards, pg, infos[0])


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


class RayEngine:
    """Driver-side handle of the distributed engine; the same `generate` contract as SpeculativeEngine."""

    def __init__(self, coordinator, config: RayEngineConfig, info: dict) -> None:
        self.coordinator = coordinator
        self.config = config
        self.info = info

    def generate_stream(self, prompt: str | None = None, *, prompt_token_ids: Sequence[int] | None = None,
                        sampling: SamplingParams | None = None, chat: bool = False,
                        request_id: str | None = None, num_speculative_tokens: int | str | None = None,
                        pipeline: bool | None = None) -> Iterator[StreamChunk]:
        """Yield what each step commits; the last chunk carries the finish reason and the whole output.

        Contract: chunks arrive in commit order, each holding the token ids of one verification step
        (1..K+1 tokens) and the text they completed (text that may be the start of a stop string is
        held back); exactly one chunk has `finish_reason` set, the last. Dropping the iterator
        cancels the request and frees its caches.
        """
        gen = self.coordinator.generate_stream.options(num_returns="streaming").remote(
            prompt, list(prompt_token_ids) if prompt_token_ids is not None else None, sampling, chat, request_id,
            num_speculative_tokens, pipeline)
        try:
            for ref in gen:
                yield _get(ref)
        finally:
            if not _exhausted(gen):
                ray.cancel(gen)

    def generate(self, prompt: str | None = None, *, prompt_token_ids: Sequence[int] | None = None,
                 sampling: SamplingParams | None = None, chat: bool = False,
                 num_speculative_tokens: int | str | None = None, pipeline: bool | None = None) -> GenerationOutput:
        last = None
        for last in self.generate_stream(prompt, prompt_token_ids=prompt_token_ids, sampling=sampling, chat=chat,
                                         num_speculative_tokens=num_speculative_tokens, pipeline=pipeline):
            pass
        return last.output

    def handles(self) -> dict:
        """The draft worker's and the shards' actor handles (for inspection and failure drills)."""
        return ray.get(self.coordinator.handles.remote())

    def cache_lengths(self, request_id: str) -> list:
        return ray.get(self.coordinator.cache_lengths.remote(request_id))

    def shutdown(self) -> None:
        """Stop every actor and give back the shards' placement group."""
        try:
            ray.get(self.coordinator.shutdown.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - a dead coordinator took its children with it
            pass
        try:
            ray.kill(self.coordinator, no_restart=True)
        except Exception:  # noqa: BLE001
            pass


def _get(ref):
    """ray.get that re-raises the remote exception's own type (a ValueError stays a ValueError)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else None
        if cause is not None:
            raise cause from None
        raise


def _exhausted(gen) -> bool:
    try:
        return gen.is_finished()
    except Exception:  # noqa: BLE001
        return False


def prepare_models(config: RayEngineConfig) -> None:
    """Pull preset models into this node's cache (with progress bars) before any actor loads them."""
    for spec in (config.engine.target, config.engine.draft):
        if is_preset(spec):
            model_cache.ensure(spec)


def build_ray_engine(config: RayEngineConfig, address: str | None = None) -> RayEngine:
    """Start the coordinator (which starts the draft worker and the target shards) and wait until
    every model is loaded. Presets are pulled here first, so actors on this node find them cached."""
    from actors.coordinator import Coordinator

    prepare_models(config)
    ensure_ray(address)
    coordinator = (ray.remote(Coordinator)
                   .options(num_cpus=config.coordinator_num_cpus, max_restarts=0, max_concurrency=1000)
                   .remote(config))
    try:
        info = _get(coordinator.start.remote())
    except BaseException:
        ray.kill(coordinator, no_restart=True)
        raise
    return RayEngine(coordinator, config, info)
