"""``register_comm_hook`` for a ``data_parallel`` root: the hook its traced backward reduces
gradients with (FSDP1's rules)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn

from ..hook_kind import hook_kind
from ..hooks import allreduce_hook, reduce_scatter_hook
from ..state import DefaultState, LowPrecisionState
from .fsdp2 import ALREADY, ROOT_ONLY
from .root import DataParallelModule, data_parallel_state

__all__ = ["register_comm_hook"]


def register_comm_hook(module: nn.Module, state: DefaultState, hook: Callable[..., Any]) -> None:
    """Reduce the gradients of a ``data_parallel`` root through ``hook`` (FSDP1's rules: root
    only, once, before the first forward). ``"fully_shard"`` and ``"hybrid_shard"`` call
    ``hook(state, grad, output)`` with ``state`` over the shard group; ``"hybrid_shard"`` then
    all-reduces the shard across the replicas with the same hook's ``hook(state, grad)`` form
    (``allreduce_hook`` for ``reduce_scatter_hook``) over the replicate group, so the result is
    averaged over all ranks. ``"replicate"`` calls ``hook(state, grad)``. A hook that takes
    ``param=`` (``int8_compress_hook``) gets the parameter's fully qualified name; the state
    makes what it keeps per parameter here (``QuantizedState``: its residuals), since the
    traced backward cannot."""
    name = "register_comm_hook"
    dp = data_parallel_state(module) if isinstance(module, DataParallelModule) else None
    if dp is None:
        raise AssertionError(ROOT_ONLY)
    if not isinstance(state, DefaultState):
        raise TypeError(
            f"{name}: state must be a DefaultState or LowPrecisionState, got {type(state).__name__}"
        )
    if dp.comm_hook is not None:
        raise AssertionError(ALREADY)
    if dp.started:
        raise RuntimeError(
            f"{name}: register the hook before the first forward; compiled graphs already hold "
            "the default reduction"
        )
    kind = hook_kind(hook, name)
    replica_hook = None
    if dp.mode == "replicate":
        ok, need, group = (
            kind.all_reduce,
            "hook(state, grad) (an all-reduce hook)",
            dp.replicate_group,
        )
    else:
        ok, need, group = (
            kind.reduce_scatter,
            "hook(state, grad, output) (a reduce-scatter hook)",
            dp.shard_group,
        )
        if dp.mode == "hybrid_shard":
            replica_hook = (
                allreduce_hook
                if kind.fn is reduce_scatter_hook
                else (hook if kind.all_reduce else None)
            )
            if replica_hook is None:
                ok, need = False, "a hook that also reduces as hook(state, grad), for the replicas"
    if not ok:
        raise TypeError(
            f"{name}: {kind.name!r} cannot reduce a {dp.mode!r} module, which calls {need}"
        )
    if state.world_size != dist.get_world_size(group):
        built = "the mesh group"
        if dp.mode == "hybrid_shard":
            built = "mesh.get_group(1), the shard group"
        raise ValueError(
            f"{name}: the state's group has {state.world_size} ranks but the module reduces over "
            f"a group of {dist.get_world_size(group)}; build the state with {built}"
        )
    low_precision = isinstance(state, LowPrecisionState)
    if low_precision and dp.mp_policy.reduce_dtype is not None:
        raise ValueError(
            f"{name}: the MixedPrecisionPolicy casts gradients to {dp.mp_policy.reduce_dtype} "
            "before the hook; a compression hook compresses by itself, so leave reduce_dtype "
            "unset."
        )
    dp.set_comm_hook(hook, state, kind.fn, kind.per_parameter, replica_hook)
