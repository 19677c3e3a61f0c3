"""Where the draft runs: `draft_placement` resolution (no Ray needed)."""

import pytest

from actors import RayEngineConfig, RolePlacement
from specdec import EngineConfig

CONFIG = EngineConfig(target="t", draft="d")


def test_auto_colocates_when_both_roles_share_cpu_cores():
    config = RayEngineConfig(engine=CONFIG)
    assert config.draft_placement == "colocated" and config.colocated
    assert config.pipeline is False  # one process cannot draft while it verifies


@pytest.mark.parametrize("role", [RolePlacement(num_gpus=1), RolePlacement(resources={"small_gpu": 1}),
                                  RolePlacement(accelerator_type="A10G")])
def test_auto_separates_the_draft_on_heterogeneous_hardware(role):
    config = RayEngineConfig(engine=CONFIG, draft_role=role)
    assert config.draft_placement == "separate" and not config.colocated
    assert config.pipeline is True


def test_explicit_placements_and_errors():
    assert RayEngineConfig(engine=CONFIG, draft_placement="separate").pipeline is True
    assert RayEngineConfig(engine=CONFIG, draft_placement="colocated", draft_role=RolePlacement(num_gpus=1)).colocated
    assert not RayEngineConfig(engine=EngineConfig(target="t", draft="none")).colocated  # nothing to colocate
    with pytest.raises(ValueError, match="draft_placement must be one of auto, colocated, separate"):
        RayEngineConfig(engine=CONFIG, draft_placement="nearby")


def test_health_stall_limit_must_be_positive():
    assert RayEngineConfig(engine=CONFIG).health_stall_s == 120.0
    with pytest.raises(ValueError, match="health_stall_s must be > 0"):
        RayEngineConfig(engine=CONFIG, health_stall_s=0)
