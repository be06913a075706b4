"""Block-wise int8 quantization: the numerics of int8 quantized collectives.

Each row of a 2-D tensor is cut into blocks of ``block_size`` elements (the last one padded
with zeros) and every block is stored as int8 values and one fp32 scale, its absolute maximum
over 127::

    x      f32[rows, n]
    q      i8[rows, blocks, block_size]   round(x / scale), in [-127, 127]
    scales f32[rows, blocks]              absmax(block) / 127
    x'     = q * scale                    |x - x'| <= absmax(block) / 254 per element

The bound holds up to fp32's rounding of ``x / scale`` and ``q * scale`` (a few units in the
last place of the block's absmax), and for blocks whose absmax is above 127 times fp32's
smallest subnormal (about 2e-43); the scale of a smaller block rounds to 0, and it
dequantizes to zeros.

Rows are what travel to different ranks (a reduce-scatter sends row ``r`` to rank ``r``), so no
block spans two destinations. Scales are fp32: a bf16 scale would add its own rounding (up to
2**-9 of the block's range) to every element of the block, and costs only 2 bytes less per
block. The arithmetic runs in fp32 whatever ``x``'s dtype.

A block holding inf or nan gets a non-finite scale, and every element of it dequantizes to inf
or nan: non-finite gradients stay non-finite through a quantized collective, as the grad
scaler needs, and never come back as finite garbage. An all-zero block has scale 0 and
dequantizes to zeros. All functions are pure and traceable (no data-dependent control flow).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["QMAX", "quantize", "dequantize", "to_blocks", "from_blocks", "check_block_size"]

QMAX = 127  # symmetric: -128 is never produced, so negation is exact


def check_block_size(owner: str, block_size: object) -> int:
    """``block_size`` as an int >= 1, or a ``TypeError`` / ``ValueError`` naming ``owner``."""
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"{owner}: block_size must be an int, got {block_size!r}")
    if block_size < 1:
        raise ValueError(f"{owner}: block_size must be >= 1, got {block_size}")
    return block_size


def quantize(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (2-D, floating point) -> ``(q, scales)``: int8 ``[rows, blocks, block_size]`` and
    fp32 ``[rows, blocks]``, ``blocks = ceil(n / block_size)`` (see the module docstring)."""
    blocks = to_blocks(x, block_size)
    scales = blocks.abs().amax(dim=2) / QMAX
    # scale 0 (an all-zero block) divides by 1; a nan scale is carried by the scale itself
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / divisor.unsqueeze(2)).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scales


def to_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x`` (2-D) in fp32 as ``[rows, blocks, block_size]``, each row zero-padded to whole
    blocks: the layout of :func:`quantize`'s ``q``, where each element's scale is at its block's
    index."""
    rows, n = x.shape
    return F.pad(x.float(), (0, -n % block_size)).view(rows, -1, block_size)


def from_blocks(blocks: torch.Tensor, n: int, shape: Sequence[int]) -> torch.Tensor:
    """:func:`to_blocks` back: the first ``prod(shape)`` of the rows' first ``n`` elements,
    flat, in ``shape``."""
    if blocks.numel() == math.prod(shape):  # nothing padded: one view
        return blocks.view(shape)
    rows = blocks.shape[0]
    return blocks.reshape(rows, -1)[:, :n].reshape(-1)[: math.prod(shape)].view(shape)


def dequantize(q: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """fp32 ``[rows, n]`` from :func:`quantize`'s ``(q, scales)`` (the padding dropped)."""
    rows = q.shape[0]
    return (q.float() * scales.unsqueeze(2)).view(rows, -1)[:, :n]
