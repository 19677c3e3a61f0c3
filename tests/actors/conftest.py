"""Real Ray for the actor tests: one small local instance for the whole session."""

import pytest


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from actors.builder import ensure_ray

    ensure_ray(num_cpus=2, object_store_memory=256 * 1024**2)
    yield ray
    ray.shutdown()
