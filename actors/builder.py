"""Starting the distributed engine: Ray itself, the coordinator actor, and the driver-side handle.

    from actors import RayEngineConfig, build_ray_engine
    engine = build_ray_engine(RayEngineConfig(engine=EngineConfig(target=..., draft=...), tp=2))
    out = engine.generate(prompt="def fib(n):")           # same contract as SpeculativeEngine
    for chunk in engine.generate_stream(prompt="..."): ...
    engine.shutdown()

Placement of the shards and the draft worker is `groups.py`; the coordinator (which runs the core's
batch scheduler over them) is `coordinator.py`. Ray options are applied in these two modules only.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import ray

from actors.config import RayEngineConfig
from specdec.models import model_cache
from specdec.models.presets import is_preset
from specdec.engine.api import Engine
from specdec.engine.request import as_request, as_requests
from specdec.engine.request_state import GenerationOutput, StreamChunk

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


class RayEngine(Engine):
    """Driver-side handle of the distributed engine; the same `generate` contract as SpeculativeEngine."""

    def __init__(self, coordinator, config: RayEngineConfig, info: dict) -> None:
        self.coordinator = coordinator
        self.config = config
        self.info = info

    def generate_stream(self, prompt=None, **fields) -> Iterator[StreamChunk]:
        """Yield what each step commits; the last chunk carries the finish reason and the whole output.
        Takes a `GenerationRequest` or its fields, as `SpeculativeEngine.generate_stream`.

        Contract: chunks arrive in commit order, each holding the token ids of one verification step
        (1..K+1 tokens) and the text they completed (text that may be the start of a stop string is
        held back); exactly one chunk has `finish_reason` set, the last. Dropping the iterator
        cancels the request and frees its caches.
        """
        request = as_request(prompt, **fields)
        gen = self.coordinator.generate_stream.options(num_returns="streaming").remote(request)
        try:
            for ref in gen:
                yield _get(ref)
        finally:
            if not _exhausted(gen):
                ray.cancel(gen)

    def generate_batch(self, requests) -> list[GenerationOutput]:
        """Many requests at once (the coordinator batches them); outputs in the order of `requests`."""
        from concurrent.futures import ThreadPoolExecutor

        requests = as_requests(requests)
        with ThreadPoolExecutor(max_workers=max(1, len(requests))) as pool:
            return list(pool.map(self.generate, requests))

    def handles(self) -> dict:
        """The draft worker's and the shards' actor handles (for inspection and failure drills)."""
        return ray.get(self.coordinator.handles.remote())

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
