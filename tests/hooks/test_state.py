import pytest
import torch
from torch.distributed.algorithms._comm_hooks import default_hooks as eager

from compiled_hooks import DefaultState, LowPrecisionState
from compiled_hooks.state import predivide_factor


@pytest.mark.parametrize("world_size", range(1, 130))
def test_factors_match_eager_original(world_size):
    pre = predivide_factor(world_size)
    assert pre == eager.DefaultState._get_gradient_predivide_factor(world_size)
    assert isinstance(pre, float)


def test_states_read_group(fake_pg):
    s = DefaultState(fake_pg)
    assert (s.world_size, s.gradient_predivide_factor, s.gradient_postdivide_factor) == (
        8,
        4.0,
        2.0,
    )
    lp = LowPrecisionState(fake_pg)
    assert lp.parameter_type is torch.float32 and lp.world_size == 8
    assert LowPrecisionState(fake_pg, torch.bfloat16).parameter_type is torch.bfloat16
    assert "world_size=8" in repr(lp) and "parameter_type=torch.float32" in repr(lp)


def test_missing_group_is_refused():
    with pytest.raises(
        ValueError, match="Expected to pass in an explicit ProcessGroup to DefaultState"
    ):
        DefaultState(None)
    with pytest.raises(ValueError, match="explicit ProcessGroup to LowPrecisionState"):
        LowPrecisionState(None)


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        predivide_factor(0)
