"""A rank's flat slice of a tensor, as ``torch.distributed.checkpoint`` (DCP) chunks.

With ``shard_buckets`` every rank keeps elements ``lo .. hi`` of each parameter's state, counted
in the parameter's flat (row-major) order. DCP stores rectangular chunks of a tensor of known
global shape and reshards them on load, so :class:`FlatShard` describes the slice as the few
rectangular boxes it is made of, each one a contiguous view of the rank's slice::

    shape (4, 5), elements 7 .. 18:   row 1: cols 2..4   -> box (1, 2) + (1, 3)
                                      rows 2..2: all     -> box (2, 0) + (1, 5)
                                      row 3: cols 0..2   -> box (3, 0) + (1, 3)

A checkpoint saved this way holds the parameter's state at the parameter's shape: any world
size, ``shard_buckets`` or not, or a plain torch optimizer, loads it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

__all__ = ["FlatShard", "flat_boxes"]

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # (offsets, sizes, first flat element)


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """Elements ``lo .. hi`` (row-major) of a tensor of ``shape`` as rectangular boxes, each
    contiguous in memory, in order."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,), lo)] if shape else [((), (), lo)]
    inner = math.prod(shape[1:])
    boxes: list[Box] = []

    def within_row(row: int, a: int, b: int) -> None:
        for offsets, sizes, first in flat_boxes(shape[1:], a - row * inner, b - row * inner):
            boxes.append(((row, *offsets), (1, *sizes), row * inner + first))

    if lo % inner:  # a partial first row
        end = min(hi, (lo // inner + 1) * inner)
        within_row(lo // inner, lo, end)
        lo = end
    if hi // inner > lo // inner and lo % inner == 0:  # whole rows
        rows = hi // inner - lo // inner
        boxes.append(((lo // inner,) + (0,) * (len(shape) - 1), (rows, *shape[1:]), lo))
        lo += rows * inner
    if lo < hi:  # a partial last row
        within_row(lo // inner, lo, hi)
    return boxes


class FlatShard(torch.Tensor):
    """Elements ``lo .. lo + local.numel()`` of a tensor of ``shape``, held by this rank as the
    1-D ``local`` (a view of its state, written in place when DCP loads).

    A tensor of the global shape that holds no data of its own (DCP finds state-dict entries by
    ``isinstance(value, torch.Tensor)``), implementing DCP's checkpointable protocol as
    ``DTensor`` does: ``__create_write_items__``, ``__create_chunk_list__``,
    ``__get_tensor_shard__``. No operator runs on it: read ``local``."""

    local: torch.Tensor
    lo: int
    boxes: list[Box]

    @staticmethod
    def __new__(cls, local: torch.Tensor, shape: tuple[int, ...], lo: int) -> FlatShard:
        shard = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=local.dtype, device=local.device
        )
        shard.local, shard.lo = local, lo
        shard.boxes = flat_boxes(tuple(shape), lo, lo + local.numel())
        return shard

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's stub names other parameters
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        raise TypeError(
            f"FlatShard is one rank's slice of a tensor, for checkpoints; {func} does not run on "
            "it (its elements are in .local)"
        )

    def _view(self, sizes: tuple[int, ...], first: int) -> torch.Tensor:
        at = first - self.lo
        return self.local[at : at + math.prod(sizes)].view(sizes)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(
                        offsets=torch.Size(offsets), sizes=torch.Size(sizes)
                    ),
                    properties=properties,
                    size=self.size(),
                ),
            )
            for offsets, sizes, _ in self.boxes
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            for offsets, sizes, _ in self.boxes
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, sizes, first in self.boxes:
            if torch.Size(offsets) == index.offset:
                return self._view(sizes, first)
        raise ValueError(f"FlatShard: no chunk at {index.offset} for {index.fqn!r}")

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        hi = self.lo + self.local.numel()
        return f"FlatShard(shape={tuple(self.shape)}, elements {self.lo}..{hi})"
