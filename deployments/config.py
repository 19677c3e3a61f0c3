"""What `specdec serve`, `serve run deployments/serve.yaml` and the app builder accept: one pydantic
model (`ServeOptions`), converted to the core's and the actors' frozen configs in one place
(`ServeOptions.ray_engine_config`)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from actors.config import DRAFT_PLACEMENTS, RayEngineConfig, RolePlacement
from specdec.config import DRAFT_PRECISIONS as DRAFT_QUANTIZATIONS, SAMPLING_MODES, EngineConfig, env
from specdec.kernels.linear import LINEAR_KERNELS
from specdec.models.presets import DEFAULT_TARGET, short_name, suggest_draft


class RoleOptions(BaseModel):
    """Resources of one actor role; unset fields take the defaults of the local machine."""

    model_config = ConfigDict(extra="forbid")

    num_cpus: float | None = Field(None, ge=0, description="CPUs reserved per actor [default: 0.5 on CPU, 1 on GPU]")
    num_gpus: float | None = Field(None, ge=0, description="GPUs per actor [default: 1 when the device is CUDA]")
    num_threads: int | None = Field(None, ge=1, description="torch threads per actor [default: --threads]")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources, e.g. node labels")
    accelerator_type: str | None = Field(None, description="Ray accelerator type, e.g. A10G or H100")


class ServeOptions(BaseModel):
    """Options of the OpenAI-compatible service (the `args` of `deployments/serve.yaml`)."""

    model_config = ConfigDict(extra="forbid")

    # --- models and speculation (as `specdec generate`)
    target: str = Field(DEFAULT_TARGET, description="target model: preset, HF directory, .gguf file or hub id")
    draft: str | None = Field(None, description="draft model, 'ngram' or 'none' [default: the preset's draft, "
                                                "else ngram]")
    k: int | Literal["auto"] = Field(4, description="speculative tokens per step, or 'auto'")
    max_k: int = Field(8, ge=1, description="largest K with k='auto'")
    tp: int = Field(1, ge=1, description="tensor-parallel target shards per replica")
    draft_placement: Literal[DRAFT_PLACEMENTS] = Field("auto", description="colocated (in the rank-0 shard), "
                                                                           "separate (own actor), or auto")
    pipeline: bool = Field(True, description="pre-draft the next block while the target verifies (separate draft)")
    device: str | None = Field(None, description="cpu, cuda, ... [default: cuda if available]")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    threads: int | None = Field(None, ge=1, description="torch threads per actor [default on CPU: the cores "
                                                        "divided among the replicas' shards]")
    linear_kernel: Literal[LINEAR_KERNELS] = "auto"
    draft_quantization: Literal[DRAFT_QUANTIZATIONS] = Field(
        "auto", description="draft precision: none, bfloat16, int8, int8-weight, or auto (measured at load)")
    draft_vocab: int | None = Field(None, ge=1, description="the draft proposes from the N most frequent tokens "
                                                            "[default: all]")
    ngram_first: int = Field(0, ge=0, description="prompt-lookup matches of N+ tokens propose before the draft "
                                                  "model (0 = off)")
    speculative_sampling: Literal[SAMPLING_MODES] = Field(
        "invariant", description="how sampled requests that name no mode sample: invariant (a seed gives the "
                                 "target-only text) or residual (the most acceptance)")
    trust_remote_code: bool = Field(False, description="run Python code shipped with a model (auto_map)")
    allow_pickle_weights: bool = Field(False, description="load .bin/.pt pickle weights when a model has no "
                                                          "safetensors (pickles can run code as they load)")
    target_role: RoleOptions = Field(default_factory=RoleOptions, description="resources of each target shard")
    draft_role: RoleOptions = Field(default_factory=RoleOptions, description="resources of the separate draft")

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

    @field_validator("k", mode="before")
    @classmethod
    def _k(cls, value):
        if isinstance(value, str) and value.strip().lower() != "auto":
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"k must be an integer >= 1 or 'auto', got {value!r}") from None
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError(f"k must be an integer >= 1 or 'auto', got {value!r}")
        return value

    def model_post_init(self, __context) -> None:
        if self.api_key is None and env("API_KEY"):
            self.api_key = SecretStr(env("API_KEY"))
        if self.require_api_key and (self.api_key is None or not self.api_key.get_secret_value()):
            raise ValueError("require_api_key: no API key is set; set SPECDEC_API_KEY in the environment of the "
                             "nodes that build and serve the app (cluster.yaml sources ~/.specdec.env)")
        if self.draft is None:
            self.draft = suggest_draft(self.target)
        if self.served_model_name is None:
            self.served_model_name = short_name(self.target)

    # ------------------------------------------------------------------ conversion, one place

    def engine_config(self) -> EngineConfig:
        return EngineConfig(target=self.target, draft=self.draft, num_speculative_tokens=self.k,
                            max_speculative_tokens=self.max_k, device=self.device, dtype=self.dtype,
                            num_threads=self.threads, linear_kernel=self.linear_kernel,
                            draft_quantization=self.draft_quantization, draft_vocab_size=self.draft_vocab,
                            ngram_first=self.ngram_first, speculative_sampling=self.speculative_sampling,
                            trust_remote_code=self.trust_remote_code,
                            allow_pickle_weights=self.allow_pickle_weights,
                            # The replica's concurrent requests are decoded as one batch.
                            max_batch_size=self.max_ongoing_requests,
                            max_batch_tokens=max(512, self.max_ongoing_requests))

    def ray_engine_config(self) -> RayEngineConfig:
        engine = self.engine_config()
        on_gpu = _uses_cuda(self.device)
        threads = self.threads or max(1, (os.cpu_count() or 1) // (self.tp * self.replicas))
        return RayEngineConfig(engine=engine, tp_size=self.tp, pipeline=self.pipeline,
                               draft_placement=self.draft_placement,
                               draft=_role(self.draft_role, on_gpu, threads),
                               target=_role(self.target_role, on_gpu, threads))

    def describe(self, config: RayEngineConfig) -> dict:
        """What /v1/models tells about the engine behind the model id."""
        return {"target": self.target, "draft": self.draft, "num_speculative_tokens": self.k,
                "max_speculative_tokens": self.max_k, "tp_size": config.tp_size,
                "draft_placement": config.draft_placement if self.draft != "none" else None,
                "pipeline": config.pipeline, "replicas": self.replicas}


def _uses_cuda(device: str | None) -> bool:
    if device is not None:
        return device.startswith("cuda")
    import torch

    return torch.cuda.is_available()


def _role(options: RoleOptions, on_gpu: bool, threads: int) -> RolePlacement:
    return RolePlacement(
        num_cpus=options.num_cpus if options.num_cpus is not None else (1.0 if on_gpu else 0.5),
        num_gpus=options.num_gpus if options.num_gpus is not None else (1.0 if on_gpu else 0.0),
        num_threads=options.num_threads or threads,
        resources=dict(options.resources),
        accelerator_type=options.accelerator_type,
    )
