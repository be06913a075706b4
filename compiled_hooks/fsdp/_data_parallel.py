"""Compile-native FSDP: ``data_parallel(module, mesh)`` shards a module's parameters as DTensors
and gathers them on use with functional collectives, so ``torch.compile`` traces forward and
backward, collectives included, as one graph (the SimpleFSDP design).

- Parameters are ``nn.Parameter(DTensor)``: ``Shard(0)`` (``"fully_shard"``), ``Replicate()``
  (``"replicate"``) or ``(Replicate(), Shard(0))`` on a (replicate, shard) mesh
  (``"hybrid_shard"``). ``state_dict()``, ``torch.distributed.checkpoint`` and ``torch.optim``
  see the shards, as with FSDP2; outside the root's forward, ``module.weight`` is that DTensor.
- Inside the root's forward, reading a parameter gathers it (:mod:`.gather`): cast to
  ``param_dtype``, all-gather, and in backward the gradient goes through the comm hook, by
  default the reduce-scatter (all-reduce for ``"replicate"``) in ``reduce_dtype``, and comes
  back in the parameter's dtype as the DTensor gradient of the shard.
- A parameter held by several modules (tied embeddings) stays one parameter: it is gathered
  once per forward and its gradient, the sum over its uses, is reduced once.
- Blocks: the parameters of one block are gathered together (the passes bucket them), and the
  root holds the rest. Each block's floating-point inputs are cast to ``param_dtype``, like
  FSDP2's ``cast_forward_inputs``. By default (:func:`default_blocks`) the blocks are the
  layers of the outermost layer stacks; a model with parameters in several modules and no
  stack found gets a warning naming ``blocks=``.
- Activation checkpointing: a recompute (eager: a read while autograd runs a backward) gathers
  again with ``reshard_after_forward=True`` and reuses the forward's gathered parameter with
  ``False``; compiled, the partitioner does the same (see :mod:`.gather`).
- Tensor parallelism: a DTensor parameter of a sibling mesh dimension (``mesh["tp"]`` beside
  ``mesh["dp"]``) is sharded as FSDP2 shards it, on the joined mesh; it is gathered over the
  data-parallel group to its tensor-parallel local tensor and read as the tensor-parallel
  DTensor, so the module's own collectives stay DTensor's.
- ``gather_dtype=torch.int8`` gathers int8 blocks and fp32 scales instead of ``param_dtype``
  values (ZeRO++'s qwZ, :mod:`.gather`), in forward and in the reshard mode's re-gather; the
  shards stay at full precision and the optimizer steps them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves, tree_map

from .. import compat
from ..marks import blocks_compile_once
from . import accumulation, regions
from .arguments import MODES, PIPELINE_DIM, check_arguments
from .blocks import BlockPlan, blocks_of, cast_inputs, plan_block
from .gather import Gathers, Layout, gather, gather_traced
from .root import (
    DataParallelModule,
    DataParallelStage,
    DataParallelState,
    as_pipeline_stage,
    attach,
    data_parallel_state,
)
from .sharding import shard_parameter

__all__ = ["data_parallel", "is_data_parallel", "DataParallelState", "MODES"]

REGION = "<compiled region>"  # the names in the layouts of a frame compiled on its own
_CLASSES: dict[tuple[type, frozenset, str], type] = {}


class _Managed(Protocol):
    """A module ``data_parallel`` manages: the attributes it sets on each."""

    _parameters: dict[str, Any]
    _data_parallel_root: DataParallelState
    _data_parallel_layouts: dict[str, Layout]
    _data_parallel_region_layouts: dict[str, Layout]  # the same, named REGION (see _read_parameter)
    _data_parallel_shared: set[str]  # its attributes whose parameter other modules hold too
    _data_parallel_leaves: dict[str, torch.Tensor]  # what its compiled reads gather (.leaves)
    _data_parallel_block: BlockPlan  # a block's
    # its parameter attributes' (accumulator, marker), once sync was off (see .accumulation)
    _data_parallel_accumulators: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _managed(module: nn.Module) -> _Managed:
    """``module``, typed as what :func:`data_parallel` made of it."""
    return module  # type: ignore[return-value]  # the attributes are set at run time


def _read_parameter(module: _Managed, name: str) -> torch.Tensor:
    """What ``module.<name>`` reads: the gathered parameter inside the root's forward and in an
    activation checkpoint's recompute (eager: a read while autograd runs a backward), the
    sharded DTensor elsewhere. A compiled read gathers from the parameter's leaf
    (:mod:`.leaves`), not from the DTensor."""
    dp = module._data_parallel_root
    if dp.region_reads:
        index, params = dp.region_reads[-1]
        i = index.get((id(module), name))
        if i is not None:
            return params[i]
    layout = module._data_parallel_layouts[name]
    if dp.gathered:
        # one gather, one reduction of the sum, for a parameter of several modules; tested first,
        # so a compiled frame reads no other parameter's name (identical blocks trace alike)
        shared = name in module._data_parallel_shared
        gathered, key = dp.gathered[-1], layout.name if shared else ""
        if shared and key in gathered:
            return gathered[key]
        traced, accumulate, shard = None, accumulation.NOTHING, None
        if torch.compiler.is_compiling():
            shard = module._data_parallel_leaves.get(name)  # None where tensor-parallel
            if not dp.traced_root and not dp.reduction.per_parameter:
                # A frame compiled on its own inside an eager root forward gathers with a layout
                # that names no parameter and one block whatever the block, so identical blocks
                # trace alike and share its graph; a traced root's graph names every block.
                layout = module._data_parallel_region_layouts[name]
            gathers = dp.gathers
            traceable = gathers is not None and gathers.traceable
            if dp.traced_root and layout.tensor_parallel is None and traceable:
                traced = gathers
            (accumulate,) = _accumulates(dp, ((module, name),))
        if shard is None:
            shard = module._parameters[name].to_local()
        full = gather(shard, layout, dp.reduction, dp.reshard, None, traced, accumulate)
        if not dp.reshard:
            dp.keep(layout.name, full)
        full = _as_read(full, layout)
        if shared:
            gathered[key] = full
        return full
    param = module._parameters[name]
    if not torch.compiler.is_compiling() and compat.in_backward():
        kept = dp.kept.get(layout.name)
        return _as_read(gather(param.to_local(), layout, dp.reduction, dp.reshard, kept), layout)
    return param


def _accumulate(module: _Managed, name: str) -> accumulation.Accumulate:
    """What a traced forward fixes of the accumulation of ``module.<name>``'s gradient."""
    reduces = module._data_parallel_root.reduction.accumulation.reduces
    return accumulation.traced(module._data_parallel_accumulators.get(name), reduces)


def _accumulates(dp: DataParallelState, reads: tuple) -> list[accumulation.Accumulate]:
    """:func:`_accumulate` of every ``(module, name)`` of ``reads``. Accumulators are made for
    every parameter at once, so none made means nothing to look up (one guard, not one per
    parameter)."""
    if not dp.reduction.accumulation.leaves:
        return [accumulation.NOTHING] * len(reads)
    return [_accumulate(m, n) for m, n in reads]


def _as_read(full: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The gathered ``full`` as the module reads it: under tensor parallelism, the DTensor
    whose local tensor it is (whose backward gives the gradient in the tensor-parallel
    placements, a partial one reduced over the tensor-parallel group by DTensor)."""
    tp = layout.tensor_parallel
    if tp is None:
        return full
    return DTensor.from_local(full, tp.mesh, tp.placements, shape=tp.shape, stride=tp.stride)


def _root_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The root's forward: parameter reads gather while it runs (see :func:`_read_parameter`)."""
    dp = _managed(self)._data_parallel_root
    dp.started = True
    dp.gathered.append({})
    dp.region_sizes.append({})
    outer, dp.traced_root = dp.traced_root, torch.compiler.is_compiling()
    try:
        # the original class's forward (the class swapped in derives from it)
        output = super(type(self), self).forward(*args, **kwargs)  # type: ignore[misc]
    finally:
        dp.gathered.pop()
        dp.region_sizes.pop()
        dp.traced_root = outer
    dtype = dp.mp_policy.output_dtype
    if dtype is None:
        return output
    return tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
        output,
    )


def _block_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A block's forward: in a traced root forward with regions on (:mod:`.regions`), its
    parameters gathered outside (in one gather op call where the hooks allow:
    :func:`.gather.gather_traced`) and its own forward run as a region on them; else its own."""
    block = _managed(self)
    dp, plan = block._data_parallel_root, block._data_parallel_block
    if not dp.gathered and not compat.in_backward():  # a recompute runs in backward
        raise RuntimeError(
            f"data_parallel: block {type(self).__name__} ran outside its root's forward, where "
            "its parameters are shards; call the root (under pipeline parallelism, apply "
            "data_parallel to each stage module and pass it to PipelineStage)"
        )
    traced = blocks_compile_once() and torch.compiler.is_compiling() and dp.traced_root
    if not traced or plan.tensor_parallel:
        return super(type(self), self).forward(*args, **kwargs)  # type: ignore[misc]
    gathers = dp.gathers
    if plan.reads and not plan.shared and gathers is not None and gathers.traceable:
        accumulate = _accumulates(dp, plan.reads)
        params = tuple(
            gather_traced(plan.shards, plan.names, plan.block, gathers, dp.reshard, accumulate)
        )
    else:
        params = tuple(_read_parameter(m, n) for m, n in plan.reads)
    seen = dp.region_sizes[-1].setdefault(plan.key, [])
    # pushed here, outside the region: a region that mutates what outlives it (a side effect)
    # has Dynamo return every intermediate of its subgraph, at each call
    dp.region_reads.append((plan.read_index, params))
    try:
        if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
            # the parameters' sizes are their layouts', which the block's key holds
            sizes: list[tuple[Any, ...]] = [(p.dtype, p.requires_grad) for p in params]
            sizes += [(a.dtype, a.requires_grad, *a.shape) for a in args]
            return _FLAT_REGION(self, plan.key, regions.variant(seen, sizes), *params, *args)
        leaves = tree_leaves((params, args, kwargs))
        sizes = [tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor)]
        return _REGION(self, plan.key, regions.variant(seen, sizes), params, args, kwargs)
    finally:
        dp.region_reads.pop()


def _region_body(
    self: nn.Module, key: int, variant: int, params: tuple, args: tuple, kwargs: dict
) -> Any:
    """The region: the block's own forward, its parameter reads answered by ``params`` (which
    the caller pushed on ``region_reads``: see :func:`_block_forward`)."""
    return super(type(self), self).forward(*args, **kwargs)  # type: ignore[misc]


def _flat_region_body(self: nn.Module, key: int, variant: int, *tensors: torch.Tensor) -> Any:
    """:func:`_region_body` for a block called on tensors only, as flat arguments."""
    count = len(_managed(self)._data_parallel_block.reads)
    return _region_body(self, key, variant, tensors[:count], tensors[count:], {})


_REGION = regions.compile_region(_region_body)
_FLAT_REGION = regions.compile_region(_flat_region_body, regions.flat_region_key)


def _requires_grad_(self: nn.Module, requires_grad: bool = True) -> nn.Module:
    """``nn.Module.requires_grad_``, and the leaves follow (:mod:`.leaves`)."""
    super(type(self), self).requires_grad_(requires_grad)  # type: ignore[misc]
    _managed(self)._data_parallel_root.leaves.follow()
    return self


def _setattr(self: nn.Module, name: str, value: Any) -> None:
    """``nn.Module.__setattr__``; a parameter assigned in place of a sharded one (by
    ``load_state_dict(assign=True)``, say) is a DTensor (``TypeError`` before it is assigned
    otherwise) and gets its leaf (:mod:`.leaves`)."""
    sharded = isinstance(value, nn.Parameter) and name in vars(self).get(
        "_data_parallel_layouts", ()
    )
    if sharded and not isinstance(value, DTensor):
        raise TypeError(
            f"data_parallel: {type(self).__name__}.{name} is sharded, and a {type(value).__name__} "
            "is no DTensor shard: assign a DTensor of the placements data_parallel made (as "
            "load_state_dict(assign=True) of its state_dict does)"
        )
    super(type(self), self).__setattr__(name, value)
    if sharded:
        _managed(self)._data_parallel_root.link_leaves()


def _parameter_property(name: str) -> property:
    return property(lambda self: _read_parameter(self, name))


def _swap_class(module: nn.Module, names: Iterable[str], role: str = "") -> None:
    """Give ``module`` a subclass whose parameter attributes read through
    :func:`_read_parameter`: for the ``"root"`` (a :class:`.root.DataParallelModule`) and a
    ``"stage"`` root (a :class:`.root.DataParallelStage`) with :func:`_root_forward` as its
    forward, for a ``"block"`` with :func:`_block_forward` (one subclass per original class,
    parameter names and role)."""
    key = (type(module), frozenset(names), role)
    if key not in _CLASSES:
        attrs: dict[str, Any] = {n: _parameter_property(n) for n in key[1]}
        attrs["requires_grad_"], attrs["__setattr__"] = _requires_grad_, _setattr
        if role:
            attrs["forward"] = _block_forward if role == "block" else _root_forward
        roots = {"root": DataParallelModule, "stage": DataParallelStage}
        bases = (roots[role], type(module)) if role in roots else (type(module),)
        _CLASSES[key] = type(f"DataParallel{type(module).__name__}", bases, attrs)
    module.__class__ = _CLASSES[key]


def data_parallel(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    mode: str = "fully_shard",
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool | None = None,
    blocks: Iterable[nn.Module] | None = None,
    gather_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Shard ``module`` over ``mesh`` in place and return it; see the module docstring.

    ``blocks``: the modules whose parameters are gathered together and whose inputs are cast
    (default: :func:`default_blocks`, the layers of the outermost layer stacks).
    ``gather_dtype``: ``torch.int8`` to gather int8 blocks of 256 values with an fp32 scale
    each (about 0.27x of fp32's bytes, 0.53x of bf16's) and dequantize to ``param_dtype`` on
    use; each value within ``absmax / 254`` of its block, the gradient passed to the shard as is.
    None (default): gather in ``param_dtype``. No communication happens here: every rank must
    hold the same initial parameters, as FSDP2 assumes.

    Pipeline parallelism: where ``mesh`` is a sibling of a ``"pp"`` dimension of its root mesh,
    the module is a pipeline stage (:class:`.root.DataParallelStage`, which torch's
    ``PipelineStage`` drives as an FSDP2 stage: its backwards accumulate, and the schedule's
    gradient reduction reduces once per step), and ``reshard_after_forward`` defaults to False,
    as torchtitan's under PP (True otherwise).
    """
    check_arguments(module, mesh, mode, mp_policy, reshard_after_forward, gather_dtype)
    compat.key_dtensors_by_rank()  # ranks sharing a cache dir load their own graphs
    stage = PIPELINE_DIM in (compat.root_mesh(mesh).mesh_dim_names or ())
    if reshard_after_forward is None:
        reshard_after_forward = not stage
    mp_policy = mp_policy or MixedPrecisionPolicy()
    block_map = blocks_of(module, blocks)
    dp = DataParallelState(mode, mesh, mp_policy, reshard_after_forward, gather_dtype)
    blocks_ = set(block_map.values())
    sharded: dict[int, tuple[nn.Parameter, Layout]] = {}
    uses: dict[int, int] = {}
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None:
                uses[id(p)] = uses.get(id(p), 0) + 1
    for path, m in module.named_modules(remove_duplicate=False):
        names = [n for n, p in m._parameters.items() if p is not None]
        if not names or hasattr(m, "_data_parallel_layouts"):
            continue
        layouts, shared = {}, set()
        for n in names:
            p = m._parameters[n]
            if id(p) not in sharded:
                owners = [b for b in block_map if path == b or path.startswith(b + ".")]
                block = max(owners, key=len, default="")
                sharded[id(p)] = shard_parameter(p, mesh, mode, f"{path}.{n}" if path else n, block)
            new, layout = sharded[id(p)]
            m._parameters[n] = new
            layouts[n] = layout
            if uses[id(p)] > 1:
                shared.add(n)
        managed = _managed(m)
        managed._data_parallel_layouts, managed._data_parallel_shared = layouts, shared
        managed._data_parallel_accumulators, managed._data_parallel_leaves = {}, {}
        for n in names:
            dp.accumulator_slots.append((managed._data_parallel_accumulators, m, n, layouts[n]))
            dp.leaf_slots.append((managed._data_parallel_leaves, n, m._parameters, n, layouts[n]))
        managed._data_parallel_region_layouts = {
            n: dataclasses.replace(layout, name=REGION, block=REGION)
            for n, layout in layouts.items()
        }
        role = ("stage" if stage else "root") if m is module else "block" if m in blocks_ else ""
        _swap_class(m, names, role)
    for m in blocks_:
        if not hasattr(m, "_data_parallel_layouts"):  # a block without parameters of its own
            _swap_class(m, [], "block")
        subs = [_managed(sub) for sub in m.modules()]
        reads = tuple((sub, n) for sub in subs for n, p in sub._parameters.items() if p is not None)
        read_layouts = tuple(sub._data_parallel_layouts[n] for sub, n in reads)
        held = any(n in sub._data_parallel_shared for sub, n in reads)
        plan = _managed(m)._data_parallel_block = plan_block(m, reads, read_layouts, held)
        for i, ((sub, n), layout) in enumerate(zip(reads, read_layouts)):
            dp.leaf_slots.append((plan.shards, i, sub._parameters, n, layout))
    for m in module.modules():
        attach(m, dp)
    root = _managed(module)
    dp.gathers = Gathers(dp.reduction, [layout for _, layout in sharded.values()])
    if not hasattr(module, "_data_parallel_layouts"):  # a root without parameters of its own
        root._data_parallel_layouts, root._data_parallel_shared = {}, set()
        root._data_parallel_accumulators, root._data_parallel_leaves = {}, {}
        root._data_parallel_region_layouts = {}
        _swap_class(module, [], "stage" if stage else "root")
    dp.link_leaves()
    if stage:
        as_pipeline_stage(module, dp)
    if mp_policy.param_dtype is not None and mp_policy.cast_forward_inputs:
        for m in [module, *block_map.values()]:
            m.register_forward_pre_hook(cast_inputs(mp_policy.param_dtype), with_kwargs=True)
    return module


def is_data_parallel(module: nn.Module) -> bool:
    return data_parallel_state(module) is not None
