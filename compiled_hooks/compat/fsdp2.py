"""FSDP2's internals (``fully_shard``, ``replicate``): its parameter groups, their layout and
reduce dtypes, and its replicas' all-reduce. Part of :mod:`compiled_hooks.compat`, which
re-exports every name here; read them through ``compat``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_api, _fsdp_common, _fsdp_state

__all__ = [
    "FSDPReduceScatter",
    "FSDP_GROUPS",
    "FSDPGroupLayout",
    "fsdp_is_root",
    "fsdp_param_groups",
    "fsdp_accumulated_grad",
    "fsdp_group_reduce_dtypes",
    "fsdp_group_layout",
    "fsdp_all_reduce_grads",
    "fsdp_take_over_all_reduce",
]

FSDPReduceScatter = _fsdp_api.ReduceScatter  # the base of a set_custom_reduce_scatter comm
FSDP_GROUPS = (
    "_fsdp_param_groups"
    if hasattr(_fsdp_state.FSDPState(), "_fsdp_param_groups")
    else "_fsdp_param_group"
)


def fsdp_is_root(module: FSDPModule) -> bool | None:
    """Whether an FSDP2 module is the root; None until FSDP2 decides it (its lazy init)."""
    return module._get_fsdp_state()._is_root


def fsdp_param_groups(module: FSDPModule) -> list[Any]:
    """The parameter groups of one FSDP2 module (empty when it manages no parameter)."""
    groups = getattr(module._get_fsdp_state(), FSDP_GROUPS)
    if FSDP_GROUPS == "_fsdp_param_groups":
        return list(groups)
    return [] if groups is None else [groups]


def fsdp_accumulated_grad(param: Any) -> torch.Tensor | None:
    """The unsharded gradient an FSDP2 parameter (an ``FSDPParam`` of a group) holds accumulated
    with gradient sync off: in ``reduce_dtype`` when it has one, else its unsharded ``.grad``."""
    if param.unsharded_accumulated_grad is not None:
        return param.unsharded_accumulated_grad
    unsharded = getattr(param, "_unsharded_param", None)
    return None if unsharded is None else unsharded.grad


def fsdp_group_reduce_dtypes(group: Any) -> set[torch.dtype | None]:
    """The ``reduce_dtype`` of the mixed-precision policies of a group's parameters."""
    return {p.mp_policy.reduce_dtype for p in group.fsdp_params}


@dataclasses.dataclass(frozen=True)
class FSDPGroupLayout:
    """How an FSDP2 parameter group is laid out over its mesh (size 0: not along that kind)."""

    shard_size: int
    replicate_size: int


def fsdp_group_layout(group: Any) -> FSDPGroupLayout:
    info = group.mesh_info
    sharded = isinstance(info, _fsdp_common.FSDPMeshInfo)
    replicated = isinstance(info, _fsdp_common.DDPMeshInfo)
    return FSDPGroupLayout(
        info.shard_mesh_size if sharded else 0, info.replicate_mesh_size if replicated else 0
    )


def fsdp_all_reduce_grads(group: Any) -> bool:
    """False while ``set_requires_all_reduce(False)`` holds for the group."""
    return bool(group.all_reduce_grads)


def fsdp_take_over_all_reduce(group: Any, hook: Callable[[torch.Tensor], None]) -> None:
    """Make FSDP2 skip its own all-reduce of a replicated group and call ``hook(flat_grad)``
    instead. FSDP2 all-reduces a group whose mesh info is a ``DDPMeshInfo``: the group gets a
    plain ``DataParallelMeshInfo`` over the same mesh in its place (the original object, which
    other groups may share, is left alone), and ``hook`` as its all-reduce hook."""
    info, base = group.mesh_info, _fsdp_common.DataParallelMeshInfo
    group.mesh_info = base(
        **{f.name: getattr(info, f.name) for f in dataclasses.fields(base) if f.init}
    )
    group._all_reduce_hook = hook
