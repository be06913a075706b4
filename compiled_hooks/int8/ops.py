"""The int8 path's custom op (namespace ``compiled_hooks``), registered on import.

``dequantize_packed(packed, block_size) -> values``: fp32 ``[rows, blocks, block_size]`` of the
int8 rows a quantized collective received (:func:`.codec.dequantize_packed`), computed by ATen.
The int8 collectives call it on CPU for rows from 256 KiB up, where Inductor's loops load int8
through a temporary buffer. It takes ``packed`` in any strides, so the passes may bucket a
packed collective's result.
"""

from __future__ import annotations

import torch

from .codec import dequantize_packed_eager, packed_blocks

__all__ = ["dequantize_packed", "DEQUANTIZE_PACKED"]


# flexible_layout: it takes ``packed`` in whatever strides it comes (a bucket's columns), where
# Inductor would otherwise copy it into the strides it had when traced
@torch.library.custom_op(
    "compiled_hooks::dequantize_packed", mutates_args=(), tags=(torch.Tag.flexible_layout,)
)
def dequantize_packed(packed: torch.Tensor, block_size: int) -> torch.Tensor:
    """fp32 ``[rows, blocks, block_size]``: the values of the packed int8 rows ``packed``, each
    times its block's scale; ``packed`` in any strides."""
    return dequantize_packed_eager(packed, block_size)


@dequantize_packed.register_fake
def _(packed: torch.Tensor, block_size: int) -> torch.Tensor:
    rows, width = packed.shape
    return packed.new_empty(
        (rows, packed_blocks(width, block_size), block_size), dtype=torch.float32
    )


DEQUANTIZE_PACKED = torch.ops.compiled_hooks.dequantize_packed.default
