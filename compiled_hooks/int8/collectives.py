"""Sum across ranks with int8 on the wire: the collectives under the int8 hooks (ZeRO++'s qgZ
shape), written with functional collectives so ``torch.compile`` traces them whole.

Reduce-scatter: each rank quantizes its tensor, one row per destination rank
(:func:`compiled_hooks.int8.codec.quantize`: int8 blocks and fp32 scales), exchanges the rows
with one all-to-all, and dequantizes and sums what it received in fp32, in rank order::

    x_r            f32[N * s]       on rank r (N ranks, s elements a shard)
    q_r, scales_r  = quantize(x_r as [N, s])
    recv           = all_to_all(pack(q_r, scales_r))   row j: rank j's row for this rank
    shard          = sum_j dequantize(unpack(recv[j]))  f32[s], in j = 0 .. N-1 order

Each row travels as one int8 buffer (:func:`~compiled_hooks.int8.codec.pack`): its scales'
bytes, then its payload. One collective per exchange instead of two (the payload's and the
scales'). Every collective of these functions carries int8 and is traced under the mark
``marks.INT8``, which is how the passes tell them from the others.

All-reduce: the reduce-scatter, then this rank's shard quantized again and all-gathered, and
every shard dequantized. Every rank dequantizes the same gathered bytes, its own shard
included, so every rank ends with the same values, bit for bit.

Error per element (``B(t)`` = the absmax of ``t``'s block over 254, see :mod:`.codec`):
the reduce-scatter's shard is within ``sum_j B(x_j)`` of the exact sum; the all-reduce adds
``B(shard)``. Non-finite values stay non-finite. The sum is taken in fp32 whatever the input's
dtype; the result is fp32.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed._functional_collectives as fcol

from .. import compat, weight_gathers
from ..marks import INT8
from . import ops
from .codec import BLOCK_SIZE, dequantize_packed, from_blocks, pack, quantize

__all__ = [
    "ATEN_DEQUANTIZE_MIN_BYTES",
    "dequantize_received",
    "sum_received",
    "gathered_values",
    "reduce_scatter_quantized",
    "all_gather_quantized",
]


ATEN_DEQUANTIZE_MIN_BYTES = 2**18
"""Received int8 rows of at least this many bytes are dequantized by ATen on CPU."""


def reduce_scatter_quantized(
    q: torch.Tensor, scales: torch.Tensor, n: int, group: Any
) -> torch.Tensor:
    """The fp32 sum over the ranks of their row for this rank, from each rank's quantized rows
    (:func:`~compiled_hooks.int8.codec.quantize` of ``[world_size, n]``): one all-to-all of the
    packed rows, then dequantize and sum in rank order."""
    packed = pack(q, scales)
    with _marked():
        received = fcol.all_to_all_single(packed, None, None, group)
    return sum_received(received, q.shape[2], n)


def all_gather_quantized(q: torch.Tensor, scales: torch.Tensor, n: int, group: Any) -> torch.Tensor:
    """Every rank's quantized shard (one row of ``n`` elements), gathered and dequantized: fp32
    ``[world_size * n]``, rank-major, the same on every rank bit for bit."""
    packed = pack(q, scales)
    with _marked():
        gathered = compat.all_gather_single(packed, 0, group)
    return gathered_values(gathered, q.shape[2], n)


def all_gather_weights(padded: torch.Tensor, group: Any) -> torch.Tensor:
    """``data_parallel``'s int8 weight gather (ZeRO++'s qwZ, registered for ``torch.int8`` in
    :mod:`compiled_hooks.weight_gathers`): ``padded``, this rank's shard as one row, quantized in
    blocks of :data:`.codec.BLOCK_SIZE`, gathered and dequantized (:func:`all_gather_quantized`)."""
    q, scales = quantize(padded.reshape(1, -1), BLOCK_SIZE)
    return all_gather_quantized(q, scales, padded.numel(), group)


weight_gathers.register(torch.int8, all_gather_weights)


def _marked() -> contextlib.AbstractContextManager[None]:
    """Mark the collective traced inside as one of packed int8 rows (``marks.INT8``):
    what the passes find it by."""
    return torch.fx.traceback.annotate({INT8: True})


def sum_received(received: torch.Tensor, block_size: int, n: int) -> torch.Tensor:
    """fp32 ``[n]``: the sum, in rank order, of the packed rows an all-to-all received (each
    rank's row of ``n`` elements for this rank)."""
    # summed in the block layout, then cut to the row: the sum's loop indexes every input
    # linearly (a loop over the row would find each element's scale by a division)
    return dequantize_received(received, block_size).sum(0).view(-1)[:n]


def gathered_values(gathered: torch.Tensor, block_size: int, n: int) -> torch.Tensor:
    """fp32 ``[rows * n]``: the packed rows an all-gather received (a shard of ``n`` elements
    each), dequantized, rank-major."""
    values = dequantize_received(gathered, block_size)
    return from_blocks(values, n, [values.shape[0] * n])


def dequantize_received(packed: torch.Tensor, block_size: int) -> torch.Tensor:
    """:func:`~compiled_hooks.int8.codec.dequantize_packed` of a collective's received rows (any
    strides). On CPU, from :data:`ATEN_DEQUANTIZE_MIN_BYTES` up, by the op that computes it
    with ATen: Inductor's CPU loop loads int8 through a temporary buffer (a fill and a copy per
    vector), which ATen's conversion does not, and the op's output is a buffer, so its views
    in a gradient's shape are reinterpretations, not copies. Below that the op's fixed cost
    per call (a Python dispatch and a few ATen calls) is more than the loads it saves."""
    if packed.device.type == "cpu" and packed.numel() >= ATEN_DEQUANTIZE_MIN_BYTES:
        return ops.dequantize_packed(packed, block_size)
    return dequantize_packed(packed, block_size)
