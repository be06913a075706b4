"""The traced code of one compile-native FSDP parameter use: gather it in forward, reduce its
gradient through the comm hook in backward.

For a parameter of ``R`` rows sharded over ``N`` ranks, each rank holds ``ceil(R / N)`` rows or
fewer (``torch.chunk``'s split, as FSDP2 and DTensor's ``Shard(0)``); the last ranks' shards are
padded to that row count so every collective has the same size on every rank::

    forward:   full = all_gather(pad(shard.to(param_dtype)))[:R]
    backward:  out = empty(rows); hook(state, pad(grad), out)   # reduce-scatter, rank-major
               replica_hook(replica_state, out)                  # hybrid_shard only
               shard_grad = out[:local_rows].to(shard.dtype)

and for ``"replicate"``: ``full = shard.to(param_dtype)`` forward, ``hook(state, grad)``
(an all-reduce) backward. With int8 gathers (``Reduction.gather_dtype``, ZeRO++'s qwZ) the
forward sends the padded shard quantized instead, block-wise from its own (master) precision,
and every rank dequantizes the same gathered bytes::

    forward:   full = gather(pad(shard), group).to(param_dtype)[:R]
               # gather = compiled_hooks.weight_gathers.find(torch.int8): quantize in blocks
               # of 256, all-gather the packed blocks and scales, dequantize

The gradient goes to the shard as if the gather were exact (a straight-through estimator).

A whole-model trace (:class:`Gathers`) gathers a block's parameters, or one root parameter,
through one call of the op ``compiled_hooks::data_parallel_gather`` instead, when the hooks keep
no tensor state (:func:`traceable`): Dynamo records the call as one node, and AOTAutograd traces
the op's ``CompositeImplicitAutograd`` kernel: a block's parameters as one all-gather and one
hook call (:mod:`.block_gather`) where that gives the same values, else the function above per
parameter.

Under ``torch.compile`` the gather has a recompute policy. With ``reshard=True`` every op of its
forward is recomputed, so the partitioner saves the shard, not the gathered parameter, and the
backward graph gathers again (int8 again, with int8 gathers). With ``reshard=False`` every op
is saved, so a user's checkpoint around the module recomputes the module but not the gather.
The policy is a selective activation checkpoint around the gather; inside
:func:`~compiled_hooks.marks.compile_blocks_once` (``passes.install()``) it is the mark
``meta["custom"][RESHARD]`` instead, which the passes' joint-graph pass turns into the same
tags, so Dynamo and AOTAutograd trace no checkpoint region per gather.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import pathlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed._functional_collectives as fcol
import torch.fx.traceback
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from .. import compat, weight_gathers
from ..hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook, reduce_scatter_hook
from ..marks import BLOCK, RESHARD, blocks_compile_once
from ..state import DefaultState, LowPrecisionState
from . import block_gather
from .accumulation import NOTHING, Accumulate
from .layout import Layout, TensorParallel, pad_rows
from .reduction import Reduction

__all__ = [
    "Layout",
    "TensorParallel",
    "Reduction",
    "Gathers",
    "stateless",
    "traceable",
    "gather",
    "gather_traced",
    "GATHER_OP",
]


class _GatherReduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        shard: torch.Tensor,
        layout: Layout,
        reduction: Reduction,
        gathered: torch.Tensor | None,
        leaf: torch.Tensor | None = None,
        pending: torch.Tensor | None = None,
        marker: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ctx.layout, ctx.reduction, ctx.dtype = layout, reduction, shard.dtype
        # traced, the forward fixes whether the backward accumulates (see .accumulation)
        ctx.traced = compat.traced(shard)
        ctx.accumulates, ctx.pending = leaf is not None, pending is not None
        if pending is not None:
            ctx.save_for_backward(pending)
        if gathered is not None:  # what an earlier gather of the same shard gave
            return gathered.detach()
        dtype = reduction.param_dtype or shard.dtype
        if reduction.gather_dtype is not None:  # data_parallel refuses it for replicate
            gather = weight_gathers.find(reduction.gather_dtype)
            # dequantizing reads the gathered bytes, so eager waits here
            full = gather(pad_rows(shard, layout.rows), reduction.shard_group)
            return full.to(dtype).view(-1, *layout.shape[1:])[: layout.shape[0]]
        x = shard if dtype == shard.dtype else shard.to(dtype)
        if reduction.shard_group is None:
            return x.view_as(x) if x is shard else x
        full = compat.all_gather_single(pad_rows(x, layout.rows), 0, reduction.shard_group)
        if not compat.traced(full):
            # Eager: wait now (a slice of an AsyncCollectiveTensor does not), so that one
            # all-gather at a time is in flight: several corrupt the heap on gloo (see
            # passes.all_gather_as_all_to_all). Traced (by Dynamo, or by AOTAutograd through
            # GATHER_OP), the graph's own wait is the one.
            full = fcol.wait_tensor(full)
        return full[: layout.shape[0]]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        layout, r = ctx.layout, ctx.reduction
        in_dtype, out_dtype = r.hook_dtypes(grad.dtype)
        g = grad.to(in_dtype)
        if ctx.accumulates:  # traced with sync off: autograd accumulates into the leaf
            return None, None, None, None, g, None, None
        pending = None
        if ctx.traced:
            pending = ctx.saved_tensors[0] if ctx.pending else None
        elif r.accumulation.reduces:
            pending = r.accumulation.take(layout.name)
        else:
            r.accumulation.add(layout.name, g)
            return None, None, None, None, None, None, None
        if pending is not None:
            g = g + pending
        # the marker's gradient tells its hook that the pending sum is consumed
        marker = pending.new_zeros(()) if ctx.pending and pending is not None else None
        key = {"param": layout.name} if r.per_parameter else {}
        if r.shard_group is None:
            g = g.clone() if g is grad else g
            r.hook(r.state, g, **key)
            return g.to(ctx.dtype), None, None, None, None, None, marker
        grad_shape, out_shape = r.hook_shapes(layout)
        g = pad_rows(g, grad_shape[0]).contiguous()
        out = g.new_empty(out_shape, dtype=out_dtype)
        r.hook(r.state, g, out, **key)
        if r.replica_hook is not None:
            r.replica_hook(r.replica_state, out, **key)
        return out[: layout.local_rows].to(ctx.dtype), None, None, None, None, None, marker


def _recompute_all(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


def _save_all(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE


def _policy(fn: Callable[..., CheckpointPolicy]) -> functools.partial:
    """The checkpoint ``context_fn`` of the gather's policy ``fn``. Its ``cache_hash`` (the
    policy's bytecode) lets AOTAutograd cache a graph that holds it: without one, AOTAutograd
    bypasses its cache for every graph with a selective checkpoint."""
    context_fn = functools.partial(create_selective_checkpoint_contexts, fn)
    context_fn.cache_hash = hashlib.sha256(fn.__code__.co_code).hexdigest()  # type: ignore[attr-defined]
    return context_fn


_RESHARD = _policy(_recompute_all)
_KEEP = _policy(_save_all)


class _DropCheckpointNotice(logging.Filter):
    """torch warns once per process that a checkpoint ``context_fn`` region must not hold
    in-place ops; the gather's region holds none."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


logging.getLogger("torch._higher_order_ops.wrap").addFilter(_DropCheckpointNotice())


_STATELESS_HOOKS = (allreduce_hook, reduce_scatter_hook, fp16_compress_hook, bf16_compress_hook)


def stateless(reduction: Reduction) -> bool:
    """Whether every hook is a default one on its own state, which holds no tensor and nothing
    per parameter: one call may reduce several parameters' gradients, flattened together."""
    hooks = [(reduction.hook, reduction.state), (reduction.replica_hook, reduction.replica_state)]
    return not reduction.per_parameter and all(
        hook is None
        or (hook in _STATELESS_HOOKS and type(state) in (DefaultState, LowPrecisionState))
        for hook, state in hooks
    )


def traceable(reduction: Reduction) -> bool:
    """Whether a traced root may gather through :data:`GATHER_OP`: the parameters are sharded and
    the hooks :func:`stateless`. AOTAutograd traces the op's kernel below Dynamo, where a tensor
    a hook keeps would be a constant of the graph."""
    return reduction.shard_group is not None and stateless(reduction)


class Gathers:
    """The parameters of one ``data_parallel`` root as its traced forward names them in
    :data:`GATHER_OP` calls: by ``index``, given in creation order (so one program gives the
    same index in every process, and its graphs hit the compile caches), and by layout name.
    ``key`` (the op's ``code`` argument) names this package's code and the groups the op's
    collectives run in, so the compile caches, which key a graph by its calls and its inputs'
    shapes, never give a rank a graph traced in other groups (:meth:`rekey` after the hooks
    change, which also sets ``traceable``: whether the op may gather with them)."""

    def __init__(self, reduction: Reduction, layouts: list[Layout]):
        self.reduction = reduction
        self.layouts = {layout.name: layout for layout in layouts}
        self.index = next(_INDICES)
        _GATHERS[self.index] = self
        self.rekey()

    def rekey(self) -> None:
        r = self.reduction
        self.traceable = traceable(r)
        states = [
            s.process_group for s in (r.state, r.replica_state) if isinstance(s, DefaultState)
        ]
        groups = [g.group_name for g in (r.shard_group, *states) if g is not None]
        self.key = ":".join([_CODE, *groups])


_GATHERS: weakref.WeakValueDictionary[int, Gathers] = weakref.WeakValueDictionary()
_INDICES = itertools.count()


def _source_digest() -> str:
    """A digest of this package's code: an argument of every :data:`GATHER_OP` call, so the
    compile caches, which key a graph by its calls, never serve a graph traced by other code."""
    digest = hashlib.sha256()
    for path in sorted(pathlib.Path(__file__).resolve().parent.parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


_CODE = _source_digest()
_LIBRARY = torch.library.Library("compiled_hooks", "FRAGMENT")
_LIBRARY.define(
    "data_parallel_gather(Tensor[] shards, Tensor?[] leaves, Tensor?[] pending, "
    "Tensor?[] markers, int root, str[] names, str code) -> Tensor[]"
)


def _gather_kernel(
    shards: list[torch.Tensor],
    leaves: list[torch.Tensor | None],
    pending: list[torch.Tensor | None],
    markers: list[torch.Tensor | None],
    root: int,
    names: list[str],
    code: str,
) -> list[torch.Tensor]:
    gathers = _GATHERS.get(root)
    if gathers is None:
        raise RuntimeError(f"data_parallel_gather: the data_parallel root {root} is gone")
    layouts, reduction = [gathers.layouts[n] for n in names], gathers.reduction
    accumulate = [Accumulate(*a) for a in zip(leaves, pending, markers)]
    if block_gather.fits(shards, layouts, reduction, accumulate):
        return block_gather.gather_block(shards, layouts, reduction)
    return [
        _GatherReduce.apply(s, layout, reduction, None, *a)
        for s, layout, a in zip(shards, layouts, accumulate)
    ]


_LIBRARY.impl("data_parallel_gather", _gather_kernel, "CompositeImplicitAutograd")
GATHER_OP = torch.ops.compiled_hooks.data_parallel_gather.default


def _with_policy(fn: Callable[..., Any], args: tuple, block: str, reshard: bool) -> Any:
    """``fn(*args)``, traced, under the gather's recompute policy (see the module docstring),
    its nodes marked with ``block``."""
    if blocks_compile_once():
        with torch.fx.traceback.annotate({BLOCK: block, RESHARD: reshard}):
            return fn(*args)
    with torch.fx.traceback.annotate({BLOCK: block}):
        context_fn = _RESHARD if reshard else _KEEP
        return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn)


def gather_traced(
    shards: list[torch.Tensor],
    names: list[str],
    block: str,
    traced: Gathers,
    reshard: bool,
    accumulate: list[Accumulate],
) -> list[torch.Tensor]:
    """The full parameters of ``shards`` (the layouts ``names``), of ``block``, gathered in one
    :data:`GATHER_OP` call under one recompute policy (a whole-model trace with
    :func:`traceable` hooks: see :func:`gather`)."""
    leaves, pending, markers = (list(column) for column in zip(*accumulate))
    args = (shards, leaves, pending, markers, traced.index, names, traced.key)
    return _with_policy(GATHER_OP, args, block, reshard)


def gather(
    shard: torch.Tensor,
    layout: Layout,
    reduction: Reduction,
    reshard: bool,
    gathered: torch.Tensor | None = None,
    traced: Gathers | None = None,
    accumulate: Accumulate = NOTHING,
) -> torch.Tensor:
    """The full parameter from this rank's ``shard`` (see the module docstring). ``reshard``
    applies under ``torch.compile`` only: eager autograd keeps what the consumers save. The traced
    nodes, forward and backward, carry the block's name under :data:`BLOCK`.

    ``gathered`` (eager): the full parameter an earlier gather of ``shard`` gave, returned
    without a collective; the gradient is reduced all the same, so a recompute that autograd
    differentiates (reentrant checkpointing) reduces it once.

    ``traced`` (a whole-model trace, with :func:`traceable` hooks): the root whose
    :data:`GATHER_OP` gathers ``layout``. ``accumulate`` (traced only): what the forward fixes
    of the backward's accumulation (:mod:`.accumulation`)."""
    if gathered is not None:
        return _GatherReduce.apply(shard, layout, reduction, gathered)
    compiling = reduction.shard_group is not None and torch.compiler.is_compiling()
    if compiling and traced is not None:
        return gather_traced([shard], [layout.name], layout.block, traced, reshard, [accumulate])[0]
    args = (shard, layout, reduction, None, *accumulate)
    if compiling:
        return _with_policy(_GatherReduce.apply, args, layout.block, reshard)
    with torch.fx.traceback.annotate({BLOCK: layout.block}):
        return _GatherReduce.apply(*args)
