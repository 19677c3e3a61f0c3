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
    num_threads: int = 1  # torch intra-op threads in the actor
    resources: dict[str, float] = field(default_factory=dict)  # custom node labels, e.g. {"large_gpu": 1}
    accelerator_type: str | None = None  # Ray accelerator type, e.g. "A10G", "H100"

    def __post_init__(self) -> None:
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError(f"num_cpus and num_gpus must be >= 0, got {self.num_cpus}, {self.num_gpus}")
        if not isinstance(self.num_threads, int) or self.num_threads < 1:
            raise ValueError(f"num_threads must be an integer >= 1, got {self.num_threads!r}")

    def bundle(self) -> dict[str, float]:
        """This role as a placement-group bundle."""
        bundle = {"CPU": self.num_cpus, **self.resources}
        if self.num_gpus:
            bundle["GPU"] = self.num_gpus
        if self.accelerator_type:
            bundle[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return bundle


@dataclass(frozen=True)
class RayEngineConfig:
    engine: EngineConfig
    tp_size: int = 1
    pipeline: bool = True  # pre-draft block i+1 while the target verifies block i
    draft: RolePlacement = field(default_factory=lambda: RolePlacement(num_cpus=0.5))
    target: RolePlacement = field(default_factory=lambda: RolePlacement(num_cpus=0.5))
    coordinator_num_cpus: float = 0.0
    draft_max_restarts: int = 3  # a dead draft is restarted; its requests fall back to target-only
    process_group_timeout_s: float = 120.0
    placement_timeout_s: float = 60.0  # how long to wait for the shards' resources before failing

    def __post_init__(self) -> None:
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp must be an integer >= 1, got {self.tp_size!r}")
        if self.engine.draft == "none" and self.pipeline:
            object.__setattr__(self, "pipeline", False)  # nothing to pipeline
