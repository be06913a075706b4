"""ZeRO's custom op (namespace ``compiled_hooks``), registered on import.

``group_rank(group_name, device) -> int64[1]``: this process's rank in the group, read when the
graph runs, so a graph that indexes by it is the same graph on every rank, and a pass can prove
that an index is "this rank" by finding this op (``passes.shard_weight_update``).
"""

from __future__ import annotations

import torch

from .. import compat

__all__ = ["group_rank", "GROUP_RANK"]


@torch.library.custom_op("compiled_hooks::group_rank", mutates_args=())
def group_rank(group_name: str, device: torch.device) -> torch.Tensor:
    """This rank's index in the group named ``group_name``, as ``int64[1]`` on ``device``."""
    group = compat.resolve_process_group(group_name)
    # a fill, no host-to-device copy
    return torch.full((1,), group.rank(), dtype=torch.int64, device=device)


@group_rank.register_fake
def _(group_name: str, device: torch.device) -> torch.Tensor:
    return torch.empty(1, dtype=torch.int64, device=device)


GROUP_RANK = torch.ops.compiled_hooks.group_rank.default
