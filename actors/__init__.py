"""Ray actors over the `specdec` core: draft worker, tensor-parallel target shards, coordinator.

Imports go one way: deployments -> actors -> specdec. `build_ray_engine` is the entry point. Names
are imported lazily, so importing this package (the CLI plugin does) does not import Ray.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"RayEngine": "actors.builder", "build_ray_engine": "actors.builder", "ensure_ray": "actors.builder",
            "RayEngineConfig": "actors.config", "RolePlacement": "actors.config"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'actors' has no attribute {name!r}")
