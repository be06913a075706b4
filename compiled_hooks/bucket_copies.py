"""The copies into and out of a ``data_parallel`` block's bucket as custom ops (namespace
``compiled_hooks``), registered on import: what FSDP2's ``all_gather_copy_in``,
``chunk_cat`` and ``split_with_sizes_copy`` do for its buckets, one ATen call each.

``bucket_pack(pieces, rows) -> flat``: each piece viewed as ``rows`` rows, the pieces' rows
side by side, flattened (``rows == 1``: the pieces flattened end to end; ``rows == N``: rank
``r``'s part of every piece together, as a reduce-scatter sends them)::

    pieces  a = [a0 a1], b = [b0 b1 b2 b3], rows = 2     ->     flat = [a0 b0 b1 a1 b2 b3]

``bucket_unpack(flat, rows, widths, shapes=None) -> pieces``: the inverse for an all-gather's
output, each piece a new dense 1-D tensor of ``rows * width`` values::

    flat = [a0 b0 b1 a1 b2 b3], rows = 2, widths = [1, 2]   ->   [a0 a1], [b0 b1 b2 b3]

With ``shapes`` (each piece's shape, written out one after another, every one led by its
length), piece ``i`` is its first values in the shape ``shapes`` gives it, rows of padding left
out: ``shapes = [1, 2, 2, 2, 2]`` above gives ``[a0 a1]`` and ``[[b0 b1] [b2 b3]]``. The graph then
holds the parameters themselves, with no view or slice node for each.

``passes.bucket_block_all_gathers`` and ``passes.bucket_block_reduce_scatters``
write them. As opaque calls they cost Inductor nothing to lower, schedule or compile per block,
where the same copies as its own kernels cost one C++ (or Triton) compile for each distinct
fusion around them.
"""

from __future__ import annotations

import math

import torch

__all__ = ["bucket_pack", "bucket_unpack", "BUCKET_PACK", "BUCKET_UNPACK"]


def _check_rows(pieces: list[torch.Tensor], rows: int) -> None:
    if not pieces:
        raise ValueError("bucket_pack: no pieces")
    dtypes = {p.dtype for p in pieces}
    if len(dtypes) > 1:
        raise ValueError(f"bucket_pack: pieces of several dtypes {sorted(map(str, dtypes))}")
    uneven = [tuple(p.shape) for p in pieces if p.numel() % rows]
    if uneven:
        raise ValueError(f"bucket_pack: pieces of shapes {uneven} do not split into {rows} rows")


@torch.library.custom_op("compiled_hooks::bucket_pack", mutates_args=())
def bucket_pack(pieces: list[torch.Tensor], rows: int) -> torch.Tensor:
    """The pieces' ``rows`` rows side by side, flattened (see the module docstring)."""
    _check_rows(pieces, rows)
    return torch.cat([p.reshape(rows, -1) for p in pieces], dim=1).view(-1)


@bucket_pack.register_fake
def _(pieces: list[torch.Tensor], rows: int) -> torch.Tensor:
    _check_rows(pieces, rows)
    return pieces[0].new_empty(sum(p.numel() for p in pieces))


def _sizes(
    flat: torch.Tensor, rows: int, widths: list[int], shapes: list[int] | None
) -> list[list[int]]:
    """Each piece's shape (see the module docstring), checked against ``flat``'s size."""
    if flat.dim() != 1 or flat.numel() != rows * sum(widths):
        raise ValueError(
            f"bucket_unpack: {tuple(flat.shape)} is not {rows} rows of widths {list(widths)}"
        )
    if shapes is None:
        return [[rows * w] for w in widths]
    sizes, at = [], 0
    while at < len(shapes) and shapes[at] >= 0:
        sizes.append(list(shapes[at + 1 : at + 1 + shapes[at]]))
        at += 1 + shapes[at]
    if (
        at != len(shapes)
        or len(sizes) != len(widths)
        or any(math.prod(size) > rows * w for size, w in zip(sizes, widths))
    ):
        raise ValueError(
            f"bucket_unpack: shapes {list(shapes)} are not {len(widths)} shapes of at most"
            f" {[rows * w for w in widths]} values"
        )
    return sizes


@torch.library.custom_op("compiled_hooks::bucket_unpack", mutates_args=())
def bucket_unpack(
    flat: torch.Tensor, rows: int, widths: list[int], shapes: list[int] | None = None
) -> list[torch.Tensor]:
    """Each piece's columns of ``flat`` viewed as ``rows`` rows, dense, flattened or in the
    shape ``shapes`` gives it (see the module docstring)."""
    sizes = _sizes(flat, rows, widths, shapes)
    outs = [flat.new_empty(rows * w) for w in widths]
    torch.split_with_sizes_copy(
        flat.view(rows, -1), widths, dim=1, out=[o.view(rows, w) for o, w in zip(outs, widths)]
    )
    # a shorter piece is a view of its dense copy: its padding rows are never read
    return [o[: math.prod(size)].view(size) for o, size in zip(outs, sizes)]


@bucket_unpack.register_fake
def _(
    flat: torch.Tensor, rows: int, widths: list[int], shapes: list[int] | None = None
) -> list[torch.Tensor]:
    return [flat.new_empty(size) for size in _sizes(flat, rows, widths, shapes)]


BUCKET_PACK = torch.ops.compiled_hooks.bucket_pack.default
BUCKET_UNPACK = torch.ops.compiled_hooks.bucket_unpack.default
