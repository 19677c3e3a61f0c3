"""Configuration of the distributed engine: the core `EngineConfig` plus tensor parallelism,
pipelining and where each role runs. Resources are configuration, not code: on a cluster the draft
goes to small-GPU nodes and the target shards to large-GPU nodes by labels given here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from specdec.config import EngineConfig
from specdec.options import ConfigError, option


@dataclass(frozen=True)
class RolePlacement:
    """Resources of one actor role (the draft worker, or each target shard). A field left None takes
    the local default when the `RayEngineConfig` is made (`resolved`): on a CUDA device 1 CPU and
    1 GPU, else 0.5 CPU; the threads of the engine (`num_threads`), else 1."""

    num_cpus: float | None = None
    num_gpus: float | None = None
    num_threads: int | None = None  # torch intra-op threads in the actor
    resources: dict[str, float] = field(default_factory=dict)  # custom node labels, e.g. {"large_gpu": 1}
    accelerator_type: str | None = None  # Ray accelerator type, e.g. "A10G", "H100"

    def __post_init__(self) -> None:
        for name in ("num_cpus", "num_gpus"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise ValueError(f"num_threads must be an integer >= 1, got {self.num_threads!r}")

    #: As a field of `specdec serve`'s options (pydantic), an unknown key is an error.
    __pydantic_config__ = {"extra": "forbid"}

    def resolved(self, on_gpu: bool, threads: int) -> "RolePlacement":
        """This role with its unset fields at the local defaults."""
        return dataclasses.replace(
            self, num_cpus=self.num_cpus if self.num_cpus is not None else (1.0 if on_gpu else 0.5),
            num_gpus=self.num_gpus if self.num_gpus is not None else (1.0 if on_gpu else 0.0),
            num_threads=self.num_threads or threads)

    def bundle(self) -> dict[str, float]:
        """This role as a placement-group bundle."""
        bundle = {"CPU": self.num_cpus or 0.0, **self.resources}
        if self.num_gpus:
            bundle["GPU"] = self.num_gpus
        if self.accelerator_type:
            bundle[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return bundle


def uses_cuda(device: str | None) -> bool:
    """Whether an engine on `device` (None: CUDA if this machine has it) runs on CUDA."""
    if device is not None:
        return device.startswith("cuda")
    import torch

    return torch.cuda.is_available()


DRAFT_PLACEMENTS = ("auto", "colocated", "separate")


@dataclass(frozen=True)
class RayEngineConfig:
    """`draft_placement`: "separate" runs the draft in its own actor, placed by `draft_role`'s resources
    (a small GPU, another node) and able to pre-draft while the target verifies (`pipeline`);
    "colocated" runs it inside the rank-0 target shard's process, on the shard's threads and device
    (no pipelining: one process does one thing at a time). "auto" is separate when a role asks for
    GPUs, an accelerator type or custom resources (they are placed as named); on CPUs it colocates,
    since both would share one node's cores anyway and two processes only contend for them
    (measured on a 2-core box: each forward ~8% slower, and draft calls pay a Ray round trip); on
    GPUs with the defaults it is decided against the cluster (`actors.placement.resolve`): a draft
    GPU of its own where a node has one more GPU than the shards take, else colocated on rank 0's
    GPU, so one GPU serves tp 1 with a draft model."""

    engine: EngineConfig
    tp: int = option(1, metavar="N", help="tensor-parallel target shards (per replica)")
    draft_placement: str = option("auto", choices=DRAFT_PLACEMENTS,
                                  help="the draft inside the rank-0 target shard (colocated) or in its own actor "
                                       "(separate); auto: separate when a role names GPUs or resources; on CPUs "
                                       "colocated (both would share the cores); on GPUs separate when a node has a "
                                       "GPU more than the shards take, else colocated on rank 0's GPU")
    pipeline: bool = option(True, help="pre-draft the next block while the target verifies (a separate draft "
                                       "only)")
    draft_role: RolePlacement = option(default_factory=RolePlacement, cli=False,
                                       help="resources of the separate draft worker")
    target_role: RolePlacement = option(default_factory=RolePlacement, cli=False,
                                        help="resources of each target shard")
    coordinator_num_cpus: float = 0.0
    draft_max_restarts: int = 3  # a dead draft is restarted; its requests fall back to target-only
    process_group_timeout_s: float = 120.0
    placement_timeout_s: float = 60.0  # how long to wait for the shards' resources before failing
    # The health check fails an engine with requests in flight whose actors ran no decoder layer for
    # this long (`Coordinator.check_health`). Measured: the 1.5B preset's slowest layer takes 0.57 s in
    # a 512-token prefill chunk on one thread of a busy 2-core CPU (its forward: 12 s), so 120 s is
    # 200x that: room for a much slower CPU or a first kernel build, yet a wedge fails in 2 minutes.
    health_stall_s: float = 120.0
    # On GPUs with no role naming its resources, where the draft goes depends on the nodes' GPUs:
    # `actors.placement.resolve` decides it against the cluster (until then: colocated, which fits one GPU).
    gpu_defaults: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ConfigError("tp", f"tp must be an integer >= 1, got {self.tp!r}")
        if self.tp > 1 and self.engine.target_precision in ("int4", "int8-weight"):
            raise ConfigError("target_precision", f"target_precision {self.engine.target_precision} does not shard "
                                                  f"across tensor-parallel ranks yet (tp {self.tp}): use "
                                                  "target_precision float32 (or auto) with tp > 1, or tp 1")
        on_gpu, threads = uses_cuda(self.engine.device), self.engine.num_threads or 1
        named = self._heterogeneous()  # before the defaults fill the roles in: what the user asked for
        for role in ("draft_role", "target_role"):
            object.__setattr__(self, role, getattr(self, role).resolved(on_gpu, threads))
        if not self.health_stall_s > 0:
            raise ValueError(f"health_stall_s must be > 0, got {self.health_stall_s!r}")
        if self.draft_placement not in DRAFT_PLACEMENTS:
            raise ConfigError("draft_placement", f"draft_placement must be one of "
                                                 f"{', '.join(DRAFT_PLACEMENTS)}; got {self.draft_placement!r}")
        if self.draft_placement == "auto":
            object.__setattr__(self, "draft_placement", "separate" if named else "colocated")
            object.__setattr__(self, "gpu_defaults", on_gpu and not named and self.engine.draft != "none")
        if self.pipeline and (self.engine.draft == "none" or self.colocated) and not self.gpu_defaults:
            object.__setattr__(self, "pipeline", False)  # nothing to pipeline / no second process to do it

    def _heterogeneous(self) -> bool:
        """A role names GPUs, an accelerator type or a custom resource: the roles are placed as named."""
        return any(role.num_gpus or role.accelerator_type or role.resources
                   for role in (self.draft_role, self.target_role))

    @property
    def colocated(self) -> bool:
        """The draft runs inside the rank-0 target shard (a draft model or n-gram lookup)."""
        return self.draft_placement == "colocated" and self.engine.draft != "none"
