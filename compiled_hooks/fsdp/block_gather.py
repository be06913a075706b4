"""The traced gather of one block's parameters as one collective each way, as FSDP1's hooks see
a flat parameter: one all-gather of the block's packed shards in forward, one comm-hook call on
its packed, rank-major gradient in backward (shards padded to ``rows`` rows each, ``N`` ranks)::

    forward:   flat = bucket_pack([pad(s.to(param_dtype)) for s in shards], 1)
               params = bucket_unpack(all_gather(flat), N, widths, shapes)  # param i: shape_i
    backward:  g = bucket_pack([pad(grad_i.to(in_dtype)) for each i], N)  # rank r's rows together
               out = empty(sum(widths)); hook(state, g, out)           # reduce-scatter
               replica_hook(replica_state, out)                        # hybrid_shard only
               shard_grads = bucket_unpack(out, 1, widths, local_shapes)  # (local_rows_i, ...)

The same values as a gather and a hook call per parameter (:mod:`.gather`) where every hook is
elementwise over its gradient: the :func:`.gather.stateless` hooks (:func:`fits`). What the
graph gains is size: AOTAutograd traces one collective per block and direction instead of one
per parameter, and the bucketing passes find each block bucketed already.

A parameter whose output the forward's consumers do not use gets a gradient of zeros in the
packed reduction and None as its shard's gradient, as a gather of its own gives it."""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import compat
from ..bucket_copies import bucket_pack, bucket_unpack
from .accumulation import Accumulate
from .layout import Layout, pad_rows
from .reduction import Reduction

__all__ = ["fits", "gather_block"]


def _widths(layouts: tuple[Layout, ...]) -> list[int]:
    """Each parameter's elements per rank in the packed bucket."""
    return [layout.rows * math.prod(layout.shape[1:]) for layout in layouts]


def fits(
    shards: list[torch.Tensor],
    layouts: list[Layout],
    reduction: Reduction,
    accumulate: list[Accumulate],
) -> bool:
    """Whether :func:`gather_block` gives what a gather per parameter gives: several sharded
    parameters gathered in one dtype, sent in it (no int8 gathers), with nothing accumulated or
    pending (:mod:`.accumulation`); the caller has checked the hooks :func:`.gather.stateless`.
    Not where ``to_local()``'s backward makes a None gradient zeros (torch 2.11): a parameter of
    the block that the forward does not use would get a gradient of zeros, not None."""
    dtypes = {reduction.param_dtype or shard.dtype for shard in shards}
    return (
        compat.to_local_keeps_none_gradients()
        and len(shards) > 1
        and len(dtypes) == 1
        and reduction.shard_group is not None
        and reduction.gather_dtype is None
        and all(layout.tensor_parallel is None for layout in layouts)
        and all(t is None for entry in accumulate for t in entry)
    )


def _shapes(layouts: tuple[Layout, ...], local: bool) -> list[int]:
    """``bucket_unpack``'s ``shapes`` for the gathered parameters (``local``: the shards)."""
    out: list[int] = []
    for layout in layouts:
        rows = layout.local_rows if local else layout.shape[0]
        out += [len(layout.shape), rows, *layout.shape[1:]]
    return out


class _BlockGatherReduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, layouts: tuple[Layout, ...], reduction: Reduction, *shards: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        # traced only (through the gather op's kernel), so the graph's wait is the one
        ctx.layouts, ctx.reduction, ctx.widths = layouts, reduction, _widths(layouts)
        ctx.dtypes = [shard.dtype for shard in shards]
        ctx.set_materialize_grads(False)
        dtype = reduction.param_dtype or shards[0].dtype
        pieces = [pad_rows(s.to(dtype), layout.rows) for s, layout in zip(shards, layouts)]
        full = compat.all_gather_single(bucket_pack(pieces, 1), 0, reduction.shard_group)
        size = reduction.shard_size()
        return tuple(bucket_unpack(full, size, ctx.widths, _shapes(layouts, local=False)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        layouts, r = ctx.layouts, ctx.reduction
        like = next(g for g in grads if g is not None)  # autograd calls with one at least
        in_dtype, out_dtype = r.hook_dtypes(like.dtype)
        pieces = []
        for grad, layout in zip(grads, layouts):
            rows = r.hook_shapes(layout)[0][0]
            if grad is None:
                pieces.append(like.new_zeros((rows, *layout.shape[1:]), dtype=in_dtype))
            else:
                pieces.append(pad_rows(grad.to(in_dtype), rows))
        packed = bucket_pack(pieces, r.shard_size())
        out = packed.new_empty(packed.numel() // r.shard_size(), dtype=out_dtype)
        r.hook(r.state, packed, out)
        if r.replica_hook is not None:
            r.replica_hook(r.replica_state, out)
        # unpacked into new tensors: views of ``out``, which the hook wrote, cost AOTAutograd's
        # functionalization a replay of every view each time one is read
        shard_grads = [
            None if grad is None else piece.to(shard_dtype)
            for grad, piece, shard_dtype in zip(
                grads, bucket_unpack(out, 1, ctx.widths, _shapes(layouts, local=True)), ctx.dtypes
            )
        ]
        return None, None, *shard_grads


def gather_block(
    shards: list[torch.Tensor], layouts: list[Layout], reduction: Reduction
) -> list[torch.Tensor]:
    """The full parameters of ``shards`` (one block's, where :func:`fits`), gathered in one
    all-gather; their gradients reduced in one hook call (see the module docstring)."""
    return list(_BlockGatherReduce.apply(tuple(layouts), reduction, *shards))
