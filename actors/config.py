"""Configuration of the distributed engine: the core `EngineConfig` plus tensor parallelism,
pipelining and where each role runs. Resources are configuration, not code: on a cluster the draft
goes to small-GPU nodes and the target shards to large-GPU nodes by labels given here."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.config import EngineConfig


@dataclass(frozen=True)
class RolePlacement:
    """Resources of one actor role (draft worker, or each target shard)."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    num_threads: int | None = None  # torch intra-op threads in the actor (None: the engine's num_threads, else 1)
    resources: dict[str, float] = field(default_factory=dict)  # custom node labels, e.g. {"large_gpu": 1}
    accelerator_type: str | None = None  # Ray accelerator type, e.g. "A10G", "H100"

    def __post_init__(self) -> None:
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError(f"num_cpus and num_gpus must be >= 0, got {self.num_cpus}, {self.num_gpus}")
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise ValueError(f"num_threads must be an integer >= 1, got {self.num_threads!r}")

    def bundle(self) -> dict[str, float]:
        """This role as a placement-group bundle."""
        bundle = {"CPU": self.num_cpus, **self.resources}
        if self.num_gpus:
            bundle["GPU"] = self.num_gpus
        if self.accelerator_type:
            bundle[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return bundle


DRAFT_PLACEMENTS = ("auto", "colocated", "separate")


@dataclass(frozen=True)
class RayEngineConfig:
    """`draft_placement`: "separate" runs the draft in its own actor, placed by `draft`'s resources
    (a small GPU, another node) and able to pre-draft while the target verifies (`pipeline`);
    "colocated" runs it inside the rank-0 target shard's process, on the shard's threads and device
    (no pipelining: one process does one thing at a time). "auto" colocates when neither role asks
    for a GPU, an accelerator type or custom resources, i.e. when both would share one node's CPU
    cores anyway: two processes there only contend for the cores (measured on a 2-core box: each
    forward ~8% slower, and draft calls pay a Ray round trip)."""

    engine: EngineConfig
    tp_size: int = 1
    pipeline: bool = True  # pre-draft block i+1 while the target verifies block i (separate draft only)
    draft_placement: str = "auto"
    draft: RolePlacement = field(default_factory=lambda: RolePlacement(num_cpus=0.5))
    target: RolePlacement = field(default_factory=lambda: RolePlacement(num_cpus=0.5))
    coordinator_num_cpus: float = 0.0
    draft_max_restarts: int = 3  # a dead draft is restarted; its requests fall back to target-only
    process_group_timeout_s: float = 120.0
    placement_timeout_s: float = 60.0  # how long to wait for the shards' resources before failing
    # The health check fails an engine with requests in flight whose actors ran no decoder layer for
    # this long (`Coordinator.check_health`). Measured: the 1.5B preset's slowest layer takes 0.57 s in
    # a 512-token prefill chunk on one thread of a busy 2-core CPU (its forward: 12 s), so 120 s is
    # 200x that: room for a much slower CPU or a first kernel build, yet a wedge fails in 2 minutes.
    health_stall_s: float = 120.0

    def __post_init__(self) -> None:
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp must be an integer >= 1, got {self.tp_size!r}")
        if not self.health_stall_s > 0:
            raise ValueError(f"health_stall_s must be > 0, got {self.health_stall_s!r}")
        if self.draft_placement not in DRAFT_PLACEMENTS:
            raise ValueError(f"draft placement must be one of {', '.join(DRAFT_PLACEMENTS)}; "
                             f"got {self.draft_placement!r}")
        if self.draft_placement == "auto":
            object.__setattr__(self, "draft_placement", "separate" if self._heterogeneous() else "colocated")
        if self.pipeline and (self.engine.draft == "none" or self.colocated):
            object.__setattr__(self, "pipeline", False)  # nothing to pipeline / no second process to do it

    def threads(self, role: RolePlacement) -> int:
        """Torch threads of an actor of `role`: the role's, else the engine's `num_threads`, else 1."""
        return role.num_threads or self.engine.num_threads or 1

    def _heterogeneous(self) -> bool:
        return any(role.num_gpus or role.accelerator_type or role.resources for role in (self.draft, self.target))

    @property
    def colocated(self) -> bool:
        """The draft runs inside the rank-0 target shard (a draft model or n-gram lookup)."""
        return self.draft_placement == "colocated" and self.engine.draft != "none"
