"""Communication hooks for FSDP2 (``torch.distributed.fsdp.fully_shard`` and its replicating
sibling ``torch.distributed._composable.replicate_with_fsdp.replicate``).

FSDP1's ``FullyShardedDataParallel.register_comm_hook(state, hook)`` does not exist for FSDP2,
which offers lower-level hook points instead. :func:`register_comm_hook` uses them to run one of
this package's hooks for the root module and every FSDP module below it:

- sharded modules (``fully_shard``, FSDP1's FULL_SHARD / SHARD_GRAD_OP): the reduce-scatter
  hook ``hook(state, grad, output)`` (``reduce_scatter_hook``, ``fp16_compress_hook``,
  ``bf16_compress_hook``) runs as FSDP2's ``set_custom_reduce_scatter`` comm: it gets the flat
  reduce-scatter input (all of a module's gradients, rank-major) and this rank's output shard;
- replicated modules (``replicate``, FSDP1's NO_SHARD): the all-reduce hook ``hook(state, grad)``
  (``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``) gets the module's flat
  gradient buffer and reduces it in place. FSDP2 has no public hook point that *replaces* its
  all-reduce (``set_all_reduce_hook`` runs after it), so this goes through FSDP2 internals,
  per parameter group (:func:`compiled_hooks.compat.fsdp_take_over_all_reduce`): FSDP2 skips
  its own all-reduce and calls the hook instead. The mesh and the parameters' DTensor
  placements are left untouched.
- everywhere, ``set_gradient_divide_factor(1.0)`` and ``set_force_sum_reduction_for_comms(True)``:
  FSDP2 itself neither divides nor averages, so the hook's pre/post division is the only one.

A hook that keeps state per parameter (it takes ``param=``: ``int8_compress_hook``) is called
with a key per FSDP module, ``"module<i>"`` (``"group<i>"`` per replicated parameter group), in
the order of ``module.modules()``; ``compile=True`` is refused for it (one graph per key).

The registration rules of FSDP1 hold: only the root accepts a hook (``register_comm_hook can
only be called on a root instance.``), and a module that already has one refuses another
(``A communication hook is already registered``). :func:`get_comm_hook` tells which hook and
state a module uses (``(None, None)`` by default).

Limits: HSDP (sharded *and* replicated over a 2-D mesh) is refused with
``NotImplementedError``; so is ``set_requires_all_reduce(False)`` (gradient accumulation without
communication) on a replicated module with a hook, at the backward that would need it. Do not
combine a compression hook with ``MixedPrecisionPolicy(reduce_dtype=...)``: the hook compresses
by itself (refused with ``ValueError``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from .. import compat
from ..hook_kind import hook_kind
from ..state import DefaultState, LowPrecisionState

__all__ = ["register_comm_hook", "get_comm_hook", "HookReduceScatter", "HookAllReduce"]

ROOT_ONLY = "register_comm_hook can only be called on a root instance."
ALREADY = "A communication hook is already registered"


class _HookRunner:
    """Runs ``hook(state, *tensors)`` for the FSDP modules under ``root`` (compiled with
    ``torch.compile(fullgraph=True)`` when asked, so the hook's division and casts are fused
    around its collective), refusing, on every rank and before any collective, a hook that was
    registered on a module that turned out not to be the root (FSDP2 decides it lazily)."""

    def __init__(
        self,
        state: DefaultState,
        hook: Callable[..., Any],
        root: FSDPModule,
        compile: bool = False,
        key: str | None = None,
    ):
        self.state, self.hook, self.root, self.key = state, hook, root, key
        self._run = torch.compile(hook, fullgraph=True) if compile else hook

    def run(self, *tensors: torch.Tensor) -> None:
        if compat.fsdp_is_root(self.root) is False:
            raise AssertionError(ROOT_ONLY)
        if self.key is None:
            self._run(self.state, *tensors)
        else:  # a hook that keeps state per parameter: per FSDP module (or parameter group) here
            self._run(self.state, *tensors, param=self.key)


class HookReduceScatter(_HookRunner, compat.FSDPReduceScatter):
    """FSDP2 reduce-scatter comm (``set_custom_reduce_scatter``) that runs
    ``hook(state, input, output)``."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor, input_tensor, group, op, async_op: bool = False
    ) -> dist.Work | None:
        if async_op:
            raise NotImplementedError("HookReduceScatter: async_op=True is not supported")
        if group.size() != self.state.world_size:
            raise ValueError(
                f"register_comm_hook: the state's group has {self.state.world_size} ranks but "
                f"FSDP reduces over a group of {group.size()}; build the state with the FSDP "
                "shard group."
            )
        self.run(input_tensor, output_tensor)
        return None


class HookAllReduce(_HookRunner):
    """All-reduce hook of one replicated FSDP2 parameter group: ``hook(state, flat_grad)``."""

    def __init__(self, group: Any, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.group = group

    def __call__(self, flat_grad: torch.Tensor) -> None:
        if not compat.fsdp_all_reduce_grads(self.group):
            raise NotImplementedError(
                "register_comm_hook: set_requires_all_reduce(False) on a replicated module is not "
                "supported with a communication hook (the hook would reduce only the last "
                "micro-batch)."
            )
        self.run(flat_grad)


def _fsdp_modules(module: torch.nn.Module) -> list[FSDPModule]:
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _check_group(group: Any, state: DefaultState, hook: Callable[..., Any]) -> None:
    kind = hook_kind(hook, "register_comm_hook")
    name = kind.name
    layout = compat.fsdp_group_layout(group)
    if layout.shard_size and layout.replicate_size:
        raise NotImplementedError(
            "register_comm_hook: HSDP (a module both sharded and replicated) is not supported; "
            "use fully_shard over one mesh dimension or replicate."
        )
    if layout.shard_size:
        kind_name, size, ok = "sharded", layout.shard_size, kind.reduce_scatter
        need = "hook(state, grad, output) (a reduce-scatter hook)"
    else:
        kind_name, size, ok = "replicated", layout.replicate_size, kind.all_reduce
        need = "hook(state, grad) (an all-reduce hook)"
    if not ok:
        raise TypeError(
            f"register_comm_hook: {name!r} cannot reduce a {kind_name} module: FSDP2 calls {need}"
        )
    sends = state.parameter_type if isinstance(state, LowPrecisionState) else None
    for reduce_dtype in compat.fsdp_group_reduce_dtypes(group):
        if sends is not None and reduce_dtype not in (None, sends):
            raise ValueError(
                "register_comm_hook: the module's MixedPrecisionPolicy casts gradients to "
                f"{reduce_dtype} before the hook; a compression hook compresses by itself, so "
                "leave reduce_dtype unset."
            )
    if size != state.world_size:
        raise ValueError(
            f"register_comm_hook: the state's group has {state.world_size} ranks but the module "
            f"is {kind_name} over {size}."
        )


def get_comm_hook(module: object) -> tuple[Callable[..., Any] | None, Any]:
    """``(hook, state)`` registered for this FSDP module, or ``(None, None)``."""
    return getattr(module, "_comm_hook", None), getattr(module, "_comm_hook_state", None)


def register_comm_hook(
    module: torch.nn.Module, state: DefaultState, hook: Callable[..., Any], *, compile: bool = False
) -> None:
    """Run ``hook`` for the gradient reduction of ``module`` (a root ``fully_shard`` or
    ``replicate`` module) and of every FSDP module below it. See the module docstring."""
    if not isinstance(module, FSDPModule):
        raise TypeError(
            f"register_comm_hook: expected a module to which fully_shard or replicate was "
            f"applied, got {type(module).__name__}"
        )
    if not isinstance(state, DefaultState):
        raise TypeError(
            "register_comm_hook: state must be a DefaultState or LowPrecisionState, got "
            f"{type(state).__name__}"
        )
    if compat.fsdp_is_root(module) is False:
        raise AssertionError(ROOT_ONLY)
    modules = _fsdp_modules(module)
    if any(get_comm_hook(m)[0] is not None for m in modules):
        raise AssertionError(ALREADY)
    groups = [g for m in modules for g in compat.fsdp_param_groups(m)]
    for group in groups:
        _check_group(group, state, hook)
    per_parameter = hook_kind(hook, "register_comm_hook").per_parameter
    if per_parameter and compile:
        raise ValueError(
            "register_comm_hook: compile=True compiles the hook once for every module, and a hook "
            "that keeps state per parameter (param=) would recompile for each; leave compile "
            "unset for this hook."
        )
    for i, group in enumerate(groups):
        if compat.fsdp_group_layout(group).replicate_size:
            key = f"group{i}" if per_parameter else None
            compat.fsdp_take_over_all_reduce(
                group, HookAllReduce(group, state, hook, module, compile=compile, key=key)
            )
    for i, m in enumerate(modules):
        key = f"module{i}" if per_parameter else None
        m.set_custom_reduce_scatter(
            HookReduceScatter(state, hook, module, compile=compile, key=key)
        )
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
        cast(Any, m)._comm_hook, cast(Any, m)._comm_hook_state = hook, state
