"""What a ``data_parallel`` parameter's gradient goes through in backward."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..state import LowPrecisionState
from .accumulation import Accumulation
from .layout import Layout

__all__ = ["Reduction"]


@dataclasses.dataclass
class Reduction:
    """What a gradient goes through in backward: the gather group, the hook and its state, and
    for hybrid_shard the replicas' all-reduce hook and state. ``reduce_dtype`` casts the
    gradient before a hook whose state is not a ``LowPrecisionState`` (a compression hook
    casts by itself)."""

    shard_group: dist.ProcessGroup | None
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    hook: Callable[..., Any]
    state: Any
    replica_hook: Callable[..., Any] | None = None
    replica_state: Any = None
    # the hooks take param= (a parameter's fully qualified name): they keep state per parameter
    per_parameter: bool = False
    # torch.int8: the forward's gathers send int8 blocks and scales (None: param_dtype)
    gather_dtype: torch.dtype | None = None
    # the gradient sync switch and what accumulates while it is off (see .accumulation)
    accumulation: Accumulation = dataclasses.field(default_factory=Accumulation)

    def shard_size(self) -> int:
        return 1 if self.shard_group is None else dist.get_world_size(self.shard_group)

    def hook_shapes(self, layout: Layout) -> tuple[torch.Size, torch.Size | None]:
        """The shapes the hook gets for ``layout``'s gradient: ``(grad, output)``, ``output``
        None for the all-reduce form (no shard group); sharded, ``grad`` is padded to whole
        shards."""
        if self.shard_group is None:
            return layout.shape, None
        rest = tuple(layout.shape[1:])
        return (
            torch.Size((layout.rows * self.shard_size(), *rest)),
            torch.Size((layout.rows, *rest)),
        )

    def hook_dtypes(self, grad_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        """(dtype the hook's input is cast to, dtype of its output)."""
        if isinstance(self.state, LowPrecisionState):
            out = self.state.parameter_type
            return (grad_dtype if self.shard_group is not None else out), out
        dtype = self.reduce_dtype or grad_dtype
        return dtype, dtype
