"""Ray actors over the `specdec` core: draft worker, tensor-parallel target shards, coordinator.

Imports go one way: deployments -> actors -> specdec. `build_ray_engine` is the entry point.
"""

from actors.builder import RayEngine, build_ray_engine, ensure_ray
from actors.config import RayEngineConfig, RolePlacement

__all__ = ["RayEngine", "RayEngineConfig", "RolePlacement", "build_ray_engine", "ensure_ray"]
