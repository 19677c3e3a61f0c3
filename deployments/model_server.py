"""The model deployment: one engine per replica, the coordinator of `actors/` run in the replica's
own process (its target shards and draft are Ray actors it starts and owns).

A plain class: `deployments/builder.py` makes it a Serve deployment. It is the `ServedModel` of
`deployments/served_model.py` (where the streaming contract is written): the ingress calls
`generate` through a streaming handle (`handle.options(stream=True)`); each item is a core
`StreamChunk`, sent as soon as the coordinator commits it. The replica's death takes its
coordinator and actors with it (Ray owners), and Serve starts a new replica.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator

from actors.builder import prepare_models
from actors.coordinator import Coordinator
from deployments.config import ServeOptions
from deployments.served_model import ServedModel, build_model_info
from specdec.models.generation_defaults import sampling_defaults
from specdec.engine.request import GenerationRequest
from specdec.engine.request_state import StreamChunk

logger = logging.getLogger(__name__)


class ModelServer(ServedModel):
    async def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.config = options.ray_engine_config()
        prepare_models(self.config)
        # What a request's omitted sampling fields default to (checked before the engine starts).
        self.sampling_defaults = sampling_defaults(options.generation_config, options.target)
        self.coordinator = Coordinator(self.config, model_name=options.served_model_name, replica=_replica_id())
        started = time.perf_counter()
        try:
            self.info = await self.coordinator.start()
            self.engine_seconds = time.perf_counter() - started  # actors started, models loaded and prepared
        except BaseException:
            self.coordinator.shutdown()
            raise
        logger.info("engine ready: %s", self.info)

    async def generate(self, **fields) -> AsyncIterator[StreamChunk]:
        """Stream one request; `fields` are those of `specdec.engine.request.GenerationRequest`. Concurrent
        requests of this replica are batched by its engine (up to `max_ongoing_requests` per step)."""
        stream = self.coordinator.generate_stream(GenerationRequest(**fields))
        async with contextlib.aclosing(stream):  # a cancelled or closed stream frees the request at once
            async for chunk in stream:
                yield chunk

    def detokenize(self, token_ids: list[int]) -> str:
        """Token ids -> text with the target's tokenizer (`echo` of a prompt given as ids)."""
        return self.coordinator.tokenizer.decode(token_ids)

    def model_info(self) -> dict:
        """The engine's facts for /v1/models: context length, device, K policy, placement."""
        return build_model_info(
            self.options.describe(self.config), max_context=self.info["max_context"], device=self.info["device"],
            dtype=self.info["dtype"], linear_kernel=self.info["linear_kernel"],
            engine_startup_seconds=self.engine_seconds, sampling_defaults=self.sampling_defaults,
            startup_seconds=self.info.get("startup_seconds", {}),  # the target shard's stages
            # What load-time measurement chose, from what, and whether serving contradicted it.
            calibration={**self.info.get("calibration", {}),
                         "contradicted": dict(self.coordinator.calibration_check.contradicted)})

    async def request_counts(self) -> dict:
        """Requests holding state in this replica's engine (in flight, KV caches, draft states)."""
        return await self.coordinator.request_counts()

    def handles(self) -> dict:
        """The engine's actors: {"draft": handle or None, "shards": [handles]} (drills, inspection)."""
        return self.coordinator.handles()

    def batch_sizes(self) -> dict[int, int]:
        """Steps this replica's engine ran at each batch size."""
        return self.coordinator.batch_sizes()

    async def check_health(self) -> None:
        """Serve's periodic health check: the engine makes progress (shard calls complete, or decoder
        layers finish inside a long forward: slow is healthy, stuck is not), or (idle) every actor
        answers; see `Coordinator.check_health`."""
        await self.coordinator.check_health()

    def __del__(self) -> None:
        coordinator = getattr(self, "coordinator", None)
        if coordinator is not None:
            coordinator.shutdown()


def _replica_id() -> str:
    """This Serve replica's id (the `replica` label of its metrics); "0" outside Serve."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not in a replica (tests build the class directly)
        return "0"
