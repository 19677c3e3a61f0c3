"""The served model: what the router asks of the model behind it (`ServedModel`, with the streaming
contract), and the one builder of what /v1/models says about it (`build_model_info`).

Two classes implement it: `deployments/model_server.py` (the Serve deployment, the coordinator of
`actors/` in each replica) and `deployments/local.py` (the in-process engine, no Ray). The router
holds a handle, not the object, and calls each method as Serve's `DeploymentHandle` does:

    chunks = handle.options(stream=True).generate.remote(request_id=..., prompt=..., sampling=...)
    text = await handle.detokenize.remote([9707, 11])
    info = await handle.model_info.remote()
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from specdec.engine.request_state import StreamChunk


class ServedModel(Protocol):
    """The model deployment's methods that the router calls, through a handle's `.remote()`.

    Streaming contract of `generate` (the engine's, passed through): chunks in commit order, each
    holding the tokens of one verification step and the text they completed; exactly one chunk, the
    last, has a `finish_reason` and the whole `GenerationOutput`. A bad request raises `ValueError`
    before the first chunk. Closing or cancelling the stream (client gone, timeout) cancels the
    request, and its KV caches are freed on every actor. The request's `timeout_s` stops it in the
    engine too (counted as a timeout).
    """

    def generate(self, **fields: Any) -> AsyncIterator[StreamChunk]:
        """Stream one request; `fields` are those of `specdec.engine.request.GenerationRequest`."""
        ...

    def detokenize(self, token_ids: list[int]) -> str:
        """Token ids -> text with the target's tokenizer (`echo` of a prompt given as ids)."""
        ...

    def model_info(self) -> dict:
        """What /v1/models says under `specdec`, from `build_model_info`."""
        ...


def build_model_info(options: dict, *, max_context: int, device: str, dtype: str, linear_kernel: str,
                     sampling_defaults: dict, startup_seconds: dict, calibration: dict,
                     engine_startup_seconds: float | None = None) -> dict:
    """The engine behind the model id, for /v1/models: `options` (target, draft, K and where the
    engine runs), then what the loaded engine reports: its context length, device, dtype and linear
    kernel, the time it took to start (`engine_startup_seconds`: actors started, models loaded and
    prepared; `startup_seconds`: the target's stages), the sampling defaults of fields a request
    omits, and what load-time measurement chose (`calibration`)."""
    precision = (calibration.get("target_precision") or {}).get("choice", "float32")
    info = {**options, "max_context": max_context, "device": device, "dtype": dtype, "target_precision": precision,
            "linear_kernel": linear_kernel}
    if engine_startup_seconds is not None:
        info["engine_startup_seconds"] = round(engine_startup_seconds, 2)
    return {**info, "sampling_defaults": sampling_defaults, "startup_seconds": startup_seconds,
            "calibration": calibration}
