"""``torch.ops.compiled_hooks.group_rank(group_name, device)``: this process's rank in a group,
as a one-element int64 tensor computed when the graph *runs*.

A traced graph that reads the rank through this op is the same graph on every rank (the rank
is data, not a constant baked into the code), and a pass can prove that an index is "this
rank" by finding this op, which it could not do for an arbitrary graph input.
"""

from __future__ import annotations

import torch
import torch.distributed.distributed_c10d as c10d

__all__ = ["group_rank"]


@torch.library.custom_op("compiled_hooks::group_rank", mutates_args=())
def group_rank(group_name: str, device: torch.device) -> torch.Tensor:
    """This rank's index in the process group named ``group_name``, as ``int64[1]`` on ``device``."""
    group = c10d._resolve_process_group(group_name)
    return torch.full((1,), group.rank(), dtype=torch.int64, device=device)  # a fill, no host-to-device copy


@group_rank.register_fake
def _(group_name: str, device: torch.device) -> torch.Tensor:
    return torch.empty(1, dtype=torch.int64, device=device)
