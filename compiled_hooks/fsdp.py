"""Communication hooks for FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP1's ``FullyShardedDataParallel.register_comm_hook(state, hook)`` does not exist for FSDP2,
which offers lower-level hook points instead. :func:`register_comm_hook` uses them to run one of
this package's reduce-scatter hooks (``reduce_scatter_hook``, ``fp16_compress_hook``,
``bf16_compress_hook``, or any ``hook(state, grad, output)``) for the root module and every
FSDP module below it:

- ``set_custom_reduce_scatter``: FSDP2 hands the hook its flat reduce-scatter input (all of a
  module's gradients, rank-major) and output (this rank's shard);
- ``set_gradient_divide_factor(1.0)`` and ``set_force_sum_reduction_for_comms(True)``: FSDP2
  itself neither divides nor averages, so the hook's pre/post division is the only one.

The registration rules of FSDP1 hold: only the root accepts a hook (``register_comm_hook can
only be called on a root instance.``), and a module that already has one refuses another
(``A communication hook is already registered``). :func:`get_comm_hook` tells which hook and
state a module uses (``(None, None)`` by default).

Limits: modules that FSDP2 all-reduces itself (``replicate`` / HSDP replication) are refused
with ``NotImplementedError``: FSDP2 issues that all-reduce with c10d directly, and no hook point
replaces it. Do not combine a compression hook with ``MixedPrecisionPolicy(reduce_dtype=...)``:
the hook compresses by itself (refused with ``ValueError``).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from .state import DefaultState

__all__ = ["register_comm_hook", "get_comm_hook", "HookReduceScatter"]

ROOT_ONLY = "register_comm_hook can only be called on a root instance."
ALREADY = "A communication hook is already registered"


class HookReduceScatter(ReduceScatter):
    """FSDP2 reduce-scatter comm that runs ``hook(state, input, output)``.

    With ``compile=True`` the hook runs as a ``torch.compile(fullgraph=True)`` region, so its
    division and casts are fused around the collective.
    """

    def __init__(self, state: DefaultState, hook: Callable[..., Any], root: FSDPModule, compile: bool = False):
        self.state, self.hook, self.root = state, hook, root
        self._run = torch.compile(hook, fullgraph=True) if compile else hook

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False) -> Optional[dist.Work]:
        # FSDP2 decides the root lazily (first forward); a hook registered on a module that
        # turned out not to be the root is refused here, on every rank, before any collective.
        if self.root._get_fsdp_state()._is_root is False:
            raise AssertionError(ROOT_ONLY)
        if async_op:
            raise NotImplementedError("HookReduceScatter: async_op=True is not supported")
        if group.size() != self.state.world_size:
            raise ValueError(
                f"register_comm_hook: the state's group has {self.state.world_size} ranks but FSDP reduces "
                f"over a group of {group.size()}; build the state with the FSDP shard group."
            )
        self._run(self.state, input_tensor, output_tensor)
        return None


def _fsdp_modules(module: torch.nn.Module) -> list[FSDPModule]:
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def get_comm_hook(module: torch.nn.Module) -> tuple[Optional[Callable[..., Any]], Any]:
    """``(hook, state)`` registered for this FSDP module, or ``(None, None)``."""
    return getattr(module, "_comm_hook", None), getattr(module, "_comm_hook_state", None)


def register_comm_hook(module: torch.nn.Module, state: DefaultState, hook: Callable[..., Any],
                       *, compile: bool = False) -> None:
    """Run ``hook`` for the gradient reduction of ``module`` (a root ``fully_shard`` module)
    and of every FSDP module below it. See the module docstring."""
    if not isinstance(module, FSDPModule):
        raise TypeError(f"register_comm_hook: expected a module to which fully_shard was applied, "
                        f"got {type(module).__name__}")
    if not isinstance(state, DefaultState):
        raise TypeError(f"register_comm_hook: state must be a DefaultState or LowPrecisionState, "
                        f"got {type(state).__name__}")
    params = [p for p in inspect.signature(hook).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) < 3:
        raise TypeError(f"register_comm_hook: {getattr(hook, '__name__', hook)!r} takes no output shard; FSDP2 "
                        "reduce-scatters, so the hook must be callable as hook(state, grad, output)")
    if module._get_fsdp_state()._is_root is False:
        raise AssertionError(ROOT_ONLY)
    modules = _fsdp_modules(module)
    if any(get_comm_hook(m)[0] is not None for m in modules):
        raise AssertionError(ALREADY)
    for m in modules:
        for group in m._get_fsdp_state()._fsdp_param_groups:
            info = group.mesh_info
            if getattr(info, "replicate_mesh_size", 1) > 1 or not hasattr(info, "shard_mesh_size"):
                raise NotImplementedError(
                    "register_comm_hook: FSDP2 all-reduces replicated modules (replicate / HSDP) with c10d "
                    "itself, and no hook point replaces that all-reduce; only sharded modules are supported."
                )
            reduce_dtype = group.mp_policy.reduce_dtype
            if reduce_dtype is not None and reduce_dtype != getattr(state, "parameter_type", reduce_dtype):
                raise ValueError(
                    f"register_comm_hook: the module's MixedPrecisionPolicy casts gradients to {reduce_dtype} "
                    "before the hook; a compression hook compresses by itself, so leave reduce_dtype unset."
                )
            if group.mesh_info.shard_mesh_size != state.world_size:
                raise ValueError(
                    f"register_comm_hook: the state's group has {state.world_size} ranks but the module is "
                    f"sharded over {group.mesh_info.shard_mesh_size}."
                )
    comm = HookReduceScatter(state, hook, module, compile=compile)
    for m in modules:
        m.set_custom_reduce_scatter(comm)
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
        m._comm_hook, m._comm_hook_state = hook, state
