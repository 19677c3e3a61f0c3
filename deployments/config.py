"""What `specdec serve`, `serve run deployments/serve.yaml` and the app builder accept: one pydantic
model (`ServeOptions`), converted to the core's and the actors' frozen configs in one place
(`ServeOptions.ray_engine_config`)."""

from __future__ import annotations

import logging
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from pydantic import create_model, model_validator
from pydantic_core import PydanticCustomError

from actors.config import RayEngineConfig
from specdec.config import EngineConfig, env
from specdec.models.presets import DEFAULT_TARGET, short_name, suggest_draft
from specdec.options import ConfigError, options, pydantic_fields, renamed_keys

logger = logging.getLogger(__name__)


class _Serving(BaseModel):
    """Options of the OpenAI-compatible service (the `args` of `deployments/serve.yaml`, the flags of
    `specdec serve`). The engine's options are added to this class from their one definition, the
    fields of `EngineConfig` and `RayEngineConfig` (`ServeOptions` below)."""

    model_config = ConfigDict(extra="forbid")

    # --- serving
    served_model_name: str | None = Field(None, description="the model id clients send [default: the target's "
                                                            "name]")
    replicas: int = Field(1, ge=1, description="independent engine copies behind one ingress")
    max_ongoing_requests: int = Field(16, ge=1, description="requests generating at once per replica")
    max_queued_requests: int = Field(64, ge=0, description="requests waiting beyond those; more get 503")
    request_timeout_s: float = Field(600.0, gt=0, description="a request still running after this fails with 408")
    max_n: int = Field(8, ge=1, description="largest n (choices per prompt) and number of prompts per request")
    generation_config: str = Field("auto", description="sampling defaults for fields a request omits: auto (the "
                                   "model's generation_config.json, a preset's from the catalog), vllm or none "
                                   "(OpenAI's), or a directory holding a generation_config.json")
    tool_call_parser: Literal["hermes", "none"] = Field(
        "hermes", description="how the model writes tool calls (vLLM's names): hermes = <tool_call>{json}</tool_call> "
                              "(Qwen2.5, Qwen3, Hermes); none = refuse tools")
    max_request_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="larger request bodies get 413")
    api_key: SecretStr | None = Field(None, description="require 'Authorization: Bearer <key>' [default: "
                                                        "$SPECDEC_API_KEY]")
    retry_after_s: int = Field(1, ge=0, description="the Retry-After of 503 answers")
    require_api_key: bool = Field(False, description="refuse to build the app without an API key (a service "
                                                     "other machines can reach; deployments/cluster-serve.yaml)")

    @field_validator("generation_config")
    @classmethod
    def _generation_config(cls, value: str) -> str:
        from pathlib import Path

        from specdec.models.generation_defaults import MODES

        if value not in MODES and not (Path(value).expanduser() / "generation_config.json").is_file():
            raise ValueError(f"must be one of {', '.join(MODES)} or a directory holding generation_config.json, "
                             f"got {value!r}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, values):
        """Options renamed in 0.1.0 (`specdec.options.RENAMED`) still work in a config file's `args`."""
        if isinstance(values, dict):
            values = renamed_keys(values, logger.warning)
        return values

    @model_validator(mode="after")
    def _resolve_and_check(self):
        if self.api_key is None and env("API_KEY"):
            self.api_key = SecretStr(env("API_KEY"))
        if self.require_api_key and (self.api_key is None or not self.api_key.get_secret_value()):
            raise ValueError("require_api_key: no API key is set; set SPECDEC_API_KEY in the environment of the "
                             "nodes that build and serve the app (cluster.yaml sources ~/.specdec.env)")
        if self.draft is None:
            self.draft = suggest_draft(self.target)
        if self.served_model_name is None:
            self.served_model_name = short_name(self.target)
        try:  # the core's and the actors' checks (one definition each), named by their field
            self.ray_engine_config()
        except ConfigError as e:
            raise PydanticCustomError("config", "{field}: {message}", {"field": e.field, "message": str(e)}) from None
        return self

    # ------------------------------------------------------------------ conversion, one place

    def engine_config(self) -> EngineConfig:
        values = {name: getattr(self, name) for name in ENGINE_OPTIONS}
        threads = self.num_threads or max(1, (os.cpu_count() or 1) // max(1, self.tp * self.replicas))
        # The replica's concurrent requests are decoded as one batch.
        return EngineConfig(**values, num_threads=threads, max_batch_size=self.max_ongoing_requests,
                            max_batch_tokens=max(512, self.max_ongoing_requests))

    def ray_engine_config(self) -> RayEngineConfig:
        return RayEngineConfig(engine=self.engine_config(), **{name: getattr(self, name) for name in RAY_OPTIONS})

    def describe(self, config: RayEngineConfig | None = None) -> dict:
        """What /v1/models tells about the engine behind the model id: the Ray engine's layout
        (`config`), or an engine in this process (None: `deployments/local.py`)."""
        info = {"target": self.target, "draft": self.draft, "num_speculative_tokens": self.num_speculative_tokens,
                "max_speculative_tokens": self.max_speculative_tokens, "replicas": self.replicas}
        if config is None:
            return {**info, "in_process": True}
        return {**info, "tp": config.tp, "draft_placement": config.draft_placement if self.draft != "none" else None,
                "pipeline": config.pipeline}


#: The engine options a service takes: `EngineConfig`'s but the batch (it follows
#: `max_ongoing_requests`), and `RayEngineConfig`'s.
_BATCH = ("max_batch_size", "max_batch_tokens")
ENGINE_OPTIONS = [f.name for f in options(EngineConfig, exclude=(*_BATCH, "num_threads"))]
RAY_OPTIONS = [f.name for f in options(RayEngineConfig)]
#: The service's own options (pydantic fields).
SERVING_OPTIONS = dict(_Serving.model_fields)

ServeOptions = create_model(
    "ServeOptions", __base__=_Serving, __doc__=_Serving.__doc__,
    **pydantic_fields(EngineConfig, exclude=_BATCH, defaults={"target": DEFAULT_TARGET, "draft": None}),
    **pydantic_fields(RayEngineConfig))
