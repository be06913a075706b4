"""Block-wise int8 quantization: the numerics of int8 quantized collectives, and the one int8
buffer a row in which they travel (:func:`pack`).

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
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "QMAX",
    "quantize",
    "quantize_blocks",
    "dequantize",
    "to_blocks",
    "from_blocks",
    "row_length",
    "to_rows",
    "to_row_blocks",
    "from_row_blocks",
    "check_block_size",
    "pack",
    "pack_by_cat",
    "pack_by_pads",
    "unpack",
    "dequantize_packed",
    "dequantize_packed_eager",
    "packed_blocks",
    "BLOCK_SIZE",
    "SCALE_BYTES",
]

QMAX = 127  # symmetric: -128 is never produced, so negation is exact
BLOCK_SIZE = 256  # the default elements per scale: 1.6% of a packed row is scales
SCALE_BYTES = 4  # an fp32 scale's bytes, ahead of the values in a packed row


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
    return quantize_blocks(to_blocks(x, block_size))


def quantize_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize` of values already in :func:`to_blocks`' layout (fp32)."""
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


def row_length(numel: int, rows: int) -> int:
    """The length of each of :func:`to_rows`' ``rows`` rows for ``numel`` values."""
    return -(-numel // rows)


def to_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` flat, zero-padded to ``rows`` equal rows: ``[rows, ceil(numel / rows)]``, row ``r``
    the part that travels to rank ``r``."""
    n = row_length(x.numel(), rows)
    return F.pad(x.reshape(-1), (0, n * rows - x.numel())).view(rows, n)


def to_row_blocks(x: torch.Tensor, rows: int, block_size: int) -> torch.Tensor:
    """``x`` in :func:`to_rows`' rows, in :func:`to_blocks`' layout: fp32 ``[rows, blocks,
    block_size]``."""
    return to_blocks(to_rows(x, rows), block_size)


def from_row_blocks(blocks: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """:func:`to_row_blocks` back, for values of ``shape``."""
    return from_blocks(blocks, row_length(math.prod(shape), blocks.shape[0]), shape)


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


def pack(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One int8 row per row of :func:`quantize`'s ``(q, scales)``:
    ``[rows, SCALE_BYTES * blocks + blocks * block_size]``, each scale's bytes (least
    significant first) then the values."""
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
    blocks = packed_blocks(width, block_size)
    head = SCALE_BYTES * blocks
    scales = _scales_of(packed[:, :head].reshape(rows, blocks, SCALE_BYTES))
    return packed[:, head:].reshape(rows, blocks, block_size), scales


def packed_blocks(width: int, block_size: int) -> int:
    """The blocks in a packed row of ``width`` bytes."""
    return width // (block_size + SCALE_BYTES)


# A scale's bytes by arithmetic on its bits, not by a view to a narrower dtype: Inductor lowers
# such a view only where the last stride is 1, which it does not promise for a dimension of
# size 1 (torch 2.11 refuses a [1, 1] scale); a same-size view (fp32 <-> int32) is a bitcast in
# any layout.
_BYTE_SHIFTS = tuple(8 * i for i in range(SCALE_BYTES))  # least significant byte first
_BYTE_WEIGHTS = tuple(1 << s for s in _BYTE_SHIFTS)  # what each byte is worth in the int32
_BYTE_MASK = 0xFF
_BYTE_VALUES = 1 << 8  # an unsigned byte's values; the int8 of the same bits is v - 256 above 127
_INT8_MAX = _BYTE_VALUES // 2 - 1


def _scale_bytes(scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``[..., blocks]`` -> int8 ``[..., blocks, SCALE_BYTES]``: each scale's bytes,
    least significant first."""
    bits = scales.view(torch.int32)
    parts = torch.stack([(bits >> s) & _BYTE_MASK for s in _BYTE_SHIFTS], dim=-1)
    return torch.where(parts > _INT8_MAX, parts - _BYTE_VALUES, parts).to(torch.int8)


def _scales_of(scale_bytes: torch.Tensor) -> torch.Tensor:
    """:func:`_scale_bytes` back: int8 ``[..., SCALE_BYTES]`` -> fp32 ``[...]``. The top byte
    keeps its sign, so the sum is the int32 bit pattern exactly, with no overflow."""
    b = scale_bytes.to(torch.int32)
    w = _BYTE_WEIGHTS
    low = (
        (b[..., 0] & _BYTE_MASK) + (b[..., 1] & _BYTE_MASK) * w[1] + (b[..., 2] & _BYTE_MASK) * w[2]
    )
    return (low + b[..., 3] * w[3]).view(torch.float32)


def dequantize_packed(packed: torch.Tensor, block_size: int) -> torch.Tensor:
    """fp32 ``[rows, blocks, block_size]`` of :func:`pack`'s rows: every value times its block's
    scale, padding included (:func:`from_blocks` cuts it)."""
    q, scales = unpack(packed, block_size)
    return q.float() * scales.unsqueeze(2)


def dequantize_packed_eager(packed: torch.Tensor, block_size: int) -> torch.Tensor:
    """:func:`dequantize_packed`, outside a trace: on a little-endian host a scale's bytes are
    its bits, so the scales are an fp32 view of a copy of the rows' heads (a view of ``packed``
    itself would need an offset and strides divisible by 4)."""
    if sys.byteorder != "little":
        return dequantize_packed(packed, block_size)
    rows, width = packed.shape
    blocks = packed_blocks(width, block_size)
    head = SCALE_BYTES * blocks
    scales = packed.new_empty((rows, head)).copy_(packed[:, :head]).view(torch.float32)
    values = packed[:, head:].reshape(rows, blocks, block_size).float()
    return values.mul_(scales.unsqueeze(2))
