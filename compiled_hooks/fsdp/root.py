"""What ``data_parallel`` keeps on the root module: its :class:`DataParallelState`, and
FSDP2's switches under FSDP2's names (:class:`DataParallelModule`, a base of the root's class).

- ``set_requires_gradient_sync(False)`` / ``no_sync()``: backwards accumulate the unsharded
  gradients locally and the next synced backward reduces their sum once (:mod:`.accumulation`;
  compiled, a switch applies from the next forward).
- ``set_is_last_backward``, ``set_reshard_after_backward``: accepted (checked), with no
  effect: ``data_parallel`` holds no gathered parameter across a backward and waits for its
  reductions inside it.
- ``reshard()`` drops the gathered parameters an eager ``reshard_after_forward=False`` forward
  keeps for its backward; ``unshard()`` communicates nothing (a forward gathers what it reads).
- ``set_manual_backward_finalization(True)`` (torch 2.15's FSDP2 name): every backward
  accumulates, and ``finalize_backward()`` reduces the sum, one collective per block
  (:mod:`.finalize`). A pipeline stage (:class:`DataParallelStage`) starts in this mode.

Each switch runs between steps: inside the root's forward it raises, before any collective. A
switch must be set alike on every rank, as FSDP2's: a rank that reduces alone waits for the
others.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, UnshardHandle
from torch.distributed.tensor import DTensor

from .. import compat
from ..hooks import allreduce_hook, reduce_scatter_hook
from ..state import DefaultState
from .finalize import reduce_accumulated
from .gather import Gathers, Layout, Reduction
from .leaves import Leaves, Slot

__all__ = [
    "DataParallelState",
    "DataParallelModule",
    "DataParallelStage",
    "Completed",
    "as_pipeline_stage",
    "attach",
    "data_parallel_state",
]


class DataParallelState:
    """What ``data_parallel`` keeps for one root and every module under it
    (:func:`data_parallel_state`)."""

    def __init__(
        self,
        mode: str,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy,
        reshard: bool,
        gather_dtype: torch.dtype | None = None,
    ):
        self.mode, self.mesh, self.mp_policy, self.reshard = mode, mesh, mp_policy, reshard
        self.shard_group = None if mode == "replicate" else mesh.get_group(mesh.ndim - 1)
        self.replicate_group = mesh.get_group(0) if mode != "fully_shard" else None
        hook_group = self.replicate_group if mode == "replicate" else self.shard_group
        assert hook_group is not None, "replicate has a replicate group, the others a shard group"
        self.reduction = Reduction(
            self.shard_group,
            mp_policy.param_dtype,
            mp_policy.reduce_dtype,
            allreduce_hook if mode == "replicate" else reduce_scatter_hook,
            DefaultState(hook_group),
            gather_dtype=gather_dtype,
        )
        if self.replicate_group is not None and mode == "hybrid_shard":
            self.reduction.replica_hook, self.reduction.replica_state = (
                allreduce_hook,
                DefaultState(self.replicate_group),
            )
        self.comm_hook: Callable[..., Any] | None = None
        self.comm_hook_state: Any = None
        # Per running root forward (empty outside one, where reads give the DTensor), the shared
        # parameters gathered so far (gathered once per forward): a dict made and dropped inside
        # the root's forward, so Dynamo keeps no tensor of it.
        self.gathered: list[dict[str, torch.Tensor]] = []
        self.started = False  # a forward ran: the (compiled) reduction is fixed
        self.traced_root = False  # the running root forward is being traced (whole-model compile)
        # per running block region (see .regions): the index of each (id(module), name) of the
        # block in its gathered parameters, and those parameters
        self.region_reads: list[tuple[dict[tuple[int, str], int], tuple[torch.Tensor, ...]]] = []
        # per running root forward, like gathered: block key -> the input sizes of its variants
        self.region_sizes: list[dict[int, list[Any]]] = []
        # reshard_after_forward=False, eager: the gathered parameters a recompute reuses
        self.kept: dict[str, torch.Tensor] = {}
        self.gathers: Gathers | None = None  # its parameters, as a traced root gathers them
        # each parameter's slot for its (accumulator, marker): (the map of its module's
        # attributes that a traced forward reads, the module, the attribute, its layout)
        self.accumulator_slots: list[tuple[dict[str, Any], nn.Module, str, Layout]] = []
        # what compiled reads gather from, and where they find it (.leaves.Slot)
        self.leaves = Leaves()
        self.leaf_slots: list[Slot] = []

    def keep(self, name: str, full: torch.Tensor) -> None:
        """``reshard_after_forward=False``, eager: hold the gathered ``full`` for a recompute
        until autograd has reduced its gradient (compiled, the partitioner saves it instead)."""
        if torch.compiler.is_compiling() or full.grad_fn is None:
            return
        self.kept[name] = full
        ref = weakref.ref(full)

        def drop(*_: Any) -> None:
            if self.kept.get(name) is ref():  # not a later forward's
                del self.kept[name]

        full.grad_fn.register_hook(drop)

    def link_leaves(self) -> None:
        """Make every parameter's leaf (:mod:`.leaves`) from the parameter as it is now."""
        self.leaves.link(self.leaf_slots)

    def parameters(self) -> list[tuple[nn.Module, str, Layout]]:
        """Each parameter once, as (a module that holds it, its attribute there, its layout):
        a parameter of several modules has a slot in each."""
        seen: dict[str, tuple[nn.Module, str, Layout]] = {}
        for _, module, attr, layout in self.accumulator_slots:
            seen.setdefault(layout.name, (module, attr, layout))
        return list(seen.values())

    def set_comm_hook(
        self,
        hook: Callable[..., Any],
        state: DefaultState,
        traced: Callable[..., Any],
        per_parameter: bool,
        replica_hook: Callable[..., Any] | None,
    ) -> None:
        """Reduce through ``traced(state, ...)`` (the function of ``hook``, a registered hook
        that ``get_comm_hook`` gives back) from the next trace, and through ``replica_hook`` over
        the replicas with ``state`` made for their group. Each state makes, now, what it keeps
        per parameter (:meth:`~compiled_hooks.state.DefaultState.prepare`)."""
        r = self.reduction
        r.hook, r.state, r.per_parameter = traced, state, per_parameter
        if replica_hook is not None:
            assert self.replicate_group is not None, "a replica hook reduces over the replicas"
            r.replica_hook, r.replica_state = replica_hook, state.for_group(self.replicate_group)
        self.comm_hook, self.comm_hook_state = hook, state
        if self.gathers is not None:
            self.gathers.rekey()
        for module, attr, layout in self.parameters():
            device = module.get_parameter(attr).device
            grad, out = r.hook_shapes(layout)
            r.state.prepare(layout.name, grad, device, reduce_scatter=out is not None)
            if r.replica_hook is not None and out is not None:
                r.replica_state.prepare(layout.name, out, device, reduce_scatter=False)


def attach(module: nn.Module, dp: DataParallelState) -> None:
    """Make ``dp`` the state of ``module`` (a module ``data_parallel`` manages), as
    ``module._data_parallel_root``: the attribute a traced forward reads."""
    module._data_parallel_root = dp  # type: ignore[assignment]


def data_parallel_state(module: nn.Module) -> DataParallelState | None:
    """The state of the ``data_parallel`` root that manages ``module`` (the root or a module
    under it); None for a module no ``data_parallel`` manages."""
    return getattr(module, "_data_parallel_root", None)


class Completed(UnshardHandle):
    """What ``unshard(async_op=True)`` and ``finalize_backward(async_op=True)`` return: a
    handle with nothing left to wait for."""

    def wait(self) -> None:
        return None


def _check_bool(value: Any, switch: str, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{switch}: {name} must be a bool, got {type(value).__name__}")
    return value


def _prepare_accumulators(dp: DataParallelState) -> None:
    """Give every parameter its accumulator and marker, in its slot."""
    r = dp.reduction
    for slots, module, attr, layout in dp.accumulator_slots:
        shard = cast(DTensor, module.get_parameter(attr)).to_local()
        dtype = r.hook_dtypes(r.param_dtype or shard.dtype)[0]
        slots[attr] = r.accumulation.prepare(layout.name, layout.shape, dtype, shard.device)


class DataParallelModule:
    """The switches of a ``data_parallel`` root, named and called as FSDP2's ``FSDPModule``'s
    (see the module docstring). ``recurse`` is accepted for FSDP2's signature: one root's
    switches apply to all its blocks."""

    _data_parallel_root: DataParallelState  # set by attach(), on every module it manages

    def _state(self, switch: str) -> DataParallelState:
        """The root's state, checked to be outside its forward (where a switch would split one
        step's gradients between two modes)."""
        dp = self._data_parallel_root
        if dp.gathered:
            raise RuntimeError(
                f"{switch}: called inside the data_parallel module's forward; set it between "
                "steps, before the forward whose backward it is for"
            )
        return dp

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True):
        name = "set_requires_gradient_sync"
        dp = self._state(name)
        sync = _check_bool(requires_gradient_sync, name, "requires_gradient_sync")
        if not sync and not dp.reduction.accumulation.leaves:
            _prepare_accumulators(dp)
        dp.reduction.accumulation.switch(sync=sync)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's form: the backwards of the forwards inside accumulate; the first synced
        backward after reduces the sum."""
        dp = self._state("no_sync")
        before = dp.reduction.accumulation.sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            dp.reduction.accumulation.switch(sync=before)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        name = "set_is_last_backward"
        self._state(name)
        _check_bool(is_last_backward, name, "is_last_backward")

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True):
        name = "set_reshard_after_backward"
        self._state(name)
        _check_bool(reshard_after_backward, name, "reshard_after_backward")

    def reshard(self) -> None:
        self._state("reshard").kept.clear()

    def unshard(self, async_op: bool = False) -> Completed | None:
        self._state("unshard")
        return Completed() if _check_bool(async_op, "unshard", "async_op") else None

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """FSDP2's (torch 2.15): while enabled, every backward accumulates and
        :meth:`finalize_backward` reduces (compiled: from the next forward)."""
        name = "set_manual_backward_finalization"
        dp = self._state(name)
        manual = _check_bool(enabled, name, "enabled")
        if manual and not dp.reduction.accumulation.leaves:
            _prepare_accumulators(dp)
        dp.reduction.accumulation.switch(manual=manual)

    def finalize_backward(self, *, async_op: bool = False) -> Completed | None:
        """Reduce what the backwards accumulated, one collective per block, into the shards'
        ``.grad`` (:mod:`.finalize`), if gradient sync is on; it is kept otherwise."""
        dp = self._state("finalize_backward")
        if dp.reduction.accumulation.sync:
            reduce_accumulated(dp.parameters(), dp.reduction)
        return Completed() if _check_bool(async_op, "finalize_backward", "async_op") else None

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own ``_apply`` (a stage's skips ``FSDPModule``'s, which reads an FSDP2
        state), then its leaves and accumulators made again like its parameters now are (after
        ``.to(torch.float64)``, say)."""
        dp = self._data_parallel_root
        acc = dp.reduction.accumulation
        if acc.pending_bytes():
            raise RuntimeError(
                "data_parallel: the module holds accumulated gradients; reduce them (a synced "
                "backward, or finalize_backward()) before moving it"
            )
        skip = FSDPModule if isinstance(self, FSDPModule) else DataParallelModule
        result = super(skip, self)._apply(*args, **kwargs)  # type: ignore[arg-type]
        dp.link_leaves()
        if acc.leaves:
            acc.leaves.clear()
            _prepare_accumulators(dp)
        return result

    def accumulated_gradient_bytes(self) -> int:
        """The bytes the unsharded gradients accumulated so far hold (0 when synced)."""
        dp = self._state("accumulated_gradient_bytes")
        return dp.reduction.accumulation.pending_bytes()


class DataParallelStage(DataParallelModule, FSDPModule):
    """A ``data_parallel`` root whose mesh is a sibling of a ``"pp"`` dimension: an
    ``FSDPModule`` too, the type through which torch's ``PipelineStage`` and schedules drive a
    stage's switches (:func:`as_pipeline_stage`). Its FSDP2 methods are
    :class:`DataParallelModule`'s; those it has not refuse with ``NotImplementedError``."""

    # where FSDPModule.__new__ finds the module's own class in the MRO of the class
    # data_parallel makes: (that class, DataParallelStage, DataParallelModule, FSDPModule, it)
    _orig_cls_mro_index = 4

    def _get_fsdp_state(self) -> Any:
        raise NotImplementedError(
            "a data_parallel module has no FSDP2 state: of FSDPModule's methods it has "
            "set_requires_gradient_sync, set_is_last_backward, set_reshard_after_backward, "
            "set_manual_backward_finalization, finalize_backward, reshard and unshard"
        )


def as_pipeline_stage(module: nn.Module, dp: DataParallelState) -> None:
    """Set up a :class:`DataParallelStage` root: every backward accumulates (manual backward
    finalization, which torch 2.15's ``PipelineStage`` also sets before each forward), and torch
    2.11 and 2.13's ``PipelineStage``, which finalize an FSDP2 stage through its composable
    state, find one that runs ``finalize_backward``."""
    _prepare_accumulators(dp)
    dp.reduction.accumulation.switch(manual=True)
    stage = weakref.ref(module)

    def finalize() -> None:
        root = stage()
        if root is not None:
            root.finalize_backward()  # type: ignore[operator]

    compat.pipeline_stage_state(module, finalize)
