"""Hook states: which process group to reduce over and how to split the averaging.

Averaging by the world size ``N`` is done in two steps, ``pre`` before the collective
and ``post = N / pre`` after it, so that neither the summed values overflow nor the
pre-divided values underflow. ``pre`` is the largest power of two with
``N % pre == 0`` reached by doubling while ``N / pre > pre`` holds, exactly the rule of
``torch.distributed.algorithms._comm_hooks.default_hooks``:

    N     1  2  4  6  8  16  32
    pre   1  2  2  4  4   4   8
    post  1  1  2  1.5 2  4   4
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["DefaultState", "LowPrecisionState", "predivide_factor"]


def predivide_factor(world_size: int) -> float:
    """The pre-division factor for ``world_size`` ranks (see the module docstring)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return float(factor)


class DefaultState:
    """State of the default hooks: a process group and its pre/post division factors.

    Args:
        process_group: the group to reduce over; ``None`` is refused (pass
            ``torch.distributed.group.WORLD`` explicitly), as in the eager original.
    """

    __slots__ = [
        "process_group",
        "world_size",
        "gradient_predivide_factor",
        "gradient_postdivide_factor",
    ]

    def __init__(self, process_group: dist.ProcessGroup):
        if process_group is None:
            raise ValueError(
                f"Expected to pass in an explicit ProcessGroup to {type(self).__name__}."
            )
        if process_group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(
                f"{type(self).__name__}: this rank is not a member of the given process group; "
                "build the state only on the group's ranks."
            )
        if not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"{type(self).__name__} expects a torch.distributed.ProcessGroup, got "
                f"{type(process_group).__name__}."
            )
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.gradient_predivide_factor = predivide_factor(self.world_size)
        self.gradient_postdivide_factor = self.world_size / self.gradient_predivide_factor

    def for_group(self, process_group: dist.ProcessGroup) -> DefaultState:
        """A state like this one over ``process_group`` (hybrid sharding's replicas), with state
        of its own where it keeps any."""
        return DefaultState(process_group)

    def prepare(
        self, key: str, shape: torch.Size, device: torch.device, *, reduce_scatter: bool
    ) -> None:
        """Make what the hook keeps for gradients of ``shape`` under ``key``, for a caller that
        traces the hook where it cannot make it (``data_parallel``'s backward); the default and
        compression hooks keep nothing. ``reduce_scatter``: the hook gets an ``output``."""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(world_size={self.world_size}, "
            f"predivide={self.gradient_predivide_factor}, "
            f"postdivide={self.gradient_postdivide_factor})"
        )


class LowPrecisionState(DefaultState):
    """State of the compression hooks: a :class:`DefaultState` plus the parameters' dtype.

    The compression hooks communicate in fp16/bf16 and write their result back in
    ``parameter_type``; the destination tensor must already have that dtype.
    """

    __slots__ = ["parameter_type"]

    def __init__(
        self, process_group: dist.ProcessGroup, parameter_type: torch.dtype = torch.float32
    ):
        super().__init__(process_group)
        if not isinstance(parameter_type, torch.dtype) or not parameter_type.is_floating_point:
            raise TypeError(
                "LowPrecisionState: parameter_type must be a floating torch.dtype, got "
                f"{parameter_type!r}."
            )
        self.parameter_type = parameter_type

    def for_group(self, process_group: dist.ProcessGroup) -> LowPrecisionState:
        return LowPrecisionState(process_group, self.parameter_type)

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", parameter_type={self.parameter_type})"
