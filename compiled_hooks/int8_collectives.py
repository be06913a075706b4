"""Sum across ranks with int8 on the wire: the collectives under the int8 hooks (ZeRO++'s qgZ
shape), written with functional collectives so ``torch.compile`` traces them whole.

Reduce-scatter: each rank quantizes its tensor, one row per destination rank
(:func:`compiled_hooks.quantize.quantize`: int8 blocks and fp32 scales), exchanges the rows
with one all-to-all, and dequantizes and sums what it received in fp32, in rank order::

    x_r            f32[N * s]       on rank r (N ranks, s elements a shard)
    q_r, scales_r  = quantize(x_r as [N, s])
    recv           = all_to_all(pack(q_r, scales_r))   row j: rank j's row for this rank
    shard          = sum_j dequantize(unpack(recv[j]))  f32[s], in j = 0 .. N-1 order

Each row travels as one int8 buffer (:func:`pack`): its scales' bytes, then its payload. One
collective per exchange instead of two (the payload's and the scales'); and every collective
of these functions carries int8, which is how the passes tell them from the others.

All-reduce: the reduce-scatter, then this rank's shard quantized again and all-gathered, and
every shard dequantized. Every rank dequantizes the same gathered bytes, its own shard
included, so every rank ends with the same values, bit for bit.

Error per element (``B(t)`` = the absmax of ``t``'s block over 254, see :mod:`.quantize`):
the reduce-scatter's shard is within ``sum_j B(x_j)`` of the exact sum; the all-reduce adds
``B(shard)``. Non-finite values stay non-finite. The sum is taken in fp32 whatever the input's
dtype; the result is fp32.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed._functional_collectives as fcol
import torch.nn.functional as F

from . import compat
from .quantize import dequantize, quantize

__all__ = [
    "pack",
    "pack_by_cat",
    "pack_by_pads",
    "unpack",
    "int8_reduce_scatter",
    "int8_all_reduce",
    "reduce_scatter_quantized",
    "all_gather_quantized",
]


def pack(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One int8 row per row of :func:`~compiled_hooks.quantize.quantize`'s ``(q, scales)``:
    ``[rows, 4 * blocks + blocks * block_size]``, each scale's 4 bytes (least significant
    first) then the values."""
    # On CPU Inductor copies a cat of int8 tensors with aten.cat: a copy of what its vectorized
    # kernels wrote, cheaper than its scalar loop over the pads and add. Elsewhere it computes
    # the pads and add inside the quantize's kernel.
    return (pack_by_cat if q.device.type == "cpu" else pack_by_pads)(q, scales)


def pack_by_cat(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """:func:`pack`'s row, the scales' bytes and the values joined by a cat."""
    rows = q.shape[0]
    return torch.cat([_scale_bytes(scales).reshape(rows, -1), q.reshape(rows, -1)], 1)


def pack_by_pads(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """:func:`pack`'s row, the scales' bytes and the values zero-padded to the whole row and
    added (their supports are disjoint)."""
    rows = q.shape[0]
    head, body = _scale_bytes(scales).reshape(rows, -1), q.reshape(rows, -1)
    return F.pad(head, (0, body.shape[1])) + F.pad(body, (head.shape[1], 0))


def unpack(packed: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack`'s ``(q, scales)`` back: int8 ``[rows, blocks, block_size]`` and fp32
    ``[rows, blocks]``."""
    rows, width = packed.shape
    blocks = width // (block_size + 4)
    scales = _scales_of(packed[:, : 4 * blocks].reshape(rows, blocks, 4))
    return packed[:, 4 * blocks :].reshape(rows, blocks, block_size), scales


# A scale's bytes by arithmetic on its bits, not by a view to a narrower dtype: Inductor lowers
# such a view only where the last stride is 1, which it does not promise for a dimension of
# size 1 (torch 2.11 refuses a [1, 1] scale); a same-size view (fp32 <-> int32) is a bitcast in
# any layout.
_BYTE_SHIFTS = (0, 8, 16, 24)


def _scale_bytes(scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``[..., blocks]`` -> int8 ``[..., blocks, 4]``: each scale's bytes, least
    significant first."""
    bits = scales.view(torch.int32)
    parts = torch.stack([(bits >> s) & 0xFF for s in _BYTE_SHIFTS], dim=-1)
    return torch.where(parts > 127, parts - 256, parts).to(torch.int8)


def _scales_of(scale_bytes: torch.Tensor) -> torch.Tensor:
    """:func:`_scale_bytes` back: int8 ``[..., 4]`` -> fp32 ``[...]``. The top byte keeps its
    sign, so the sum is the int32 bit pattern exactly, with no overflow."""
    b = scale_bytes.to(torch.int32)
    low = (b[..., 0] & 0xFF) + (b[..., 1] & 0xFF) * 256 + (b[..., 2] & 0xFF) * 65536
    return (low + b[..., 3] * 16777216).view(torch.float32)


def reduce_scatter_quantized(
    q: torch.Tensor, scales: torch.Tensor, n: int, group: Any
) -> torch.Tensor:
    """The fp32 sum over the ranks of their row for this rank, from each rank's quantized rows
    (:func:`~compiled_hooks.quantize.quantize` of ``[world_size, n]``): one all-to-all of the
    packed rows, then dequantize and sum in rank order."""
    received = fcol.all_to_all_single(pack(q, scales), None, None, group)
    q, scales = unpack(received, q.shape[2])
    # summed in the block layout, then cut to the row: the sum's loop indexes every input
    # linearly (a loop over the row would find each element's scale by a division)
    return (q.float() * scales.unsqueeze(2)).sum(0).view(-1)[:n]


def all_gather_quantized(q: torch.Tensor, scales: torch.Tensor, n: int, group: Any) -> torch.Tensor:
    """Every rank's quantized shard (one row of ``n`` elements), gathered and dequantized: fp32
    ``[world_size * n]``, rank-major, the same on every rank bit for bit."""
    gathered = compat.all_gather_single(pack(q, scales), 0, group)
    return dequantize(*unpack(gathered, q.shape[2]), n).reshape(-1)


def int8_reduce_scatter(
    x: torch.Tensor, world_size: int, group: Any, block_size: int
) -> torch.Tensor:
    """This rank's shard (fp32, ``x.numel() // world_size`` elements) of the sum over the ranks
    of ``x``, rank-major: rank ``r`` gets elements ``[r * s, (r + 1) * s)``. ``x.numel()`` must
    be a multiple of ``world_size`` (the caller checks)."""
    rows = x.reshape(world_size, -1)
    q, scales = quantize(rows, block_size)
    return reduce_scatter_quantized(q, scales, rows.shape[1], group)


def int8_all_reduce(
    x: torch.Tensor, world_size: int, group: Any, block_size: int, post: float = 1.0
) -> torch.Tensor:
    """The sum over the ranks of ``x``, divided by ``post``, in fp32 with ``x``'s shape; the same
    on every rank, bit for bit. ``x`` of any size: it is padded to whole shards."""
    n = x.numel()
    shard = math.ceil(n / world_size)
    flat = F.pad(x.reshape(-1), (0, shard * world_size - n))
    mine = int8_reduce_scatter(flat, world_size, group, block_size)
    if post != 1.0:
        mine = mine / post
    q, scales = quantize(mine.unsqueeze(0), block_size)
    return all_gather_quantized(q, scales, shard, group)[:n].view(x.shape)
