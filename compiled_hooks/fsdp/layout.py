"""Where one sharded parameter's rows live, and how tensor parallelism lays it out."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement

__all__ = ["Layout", "TensorParallel", "pad_rows"]


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """How tensor parallelism lays out a parameter that ``data_parallel`` shards further: the
    tensor-parallel mesh, its placements, and the parameter's global shape and stride. The
    gathered parameter is this rank's tensor-parallel local tensor, which the module reads as
    a DTensor of this layout."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where one parameter's rows live: ``rows`` per rank after padding (0: replicated) and
    this rank's real ``local_rows`` of the gathered ``shape`` (the tensor-parallel local
    tensor's under ``tensor_parallel``); ``name`` is its fully qualified name and ``block``
    names the module group it is gathered with."""

    name: str
    shape: torch.Size
    rows: int
    local_rows: int
    block: str
    tensor_parallel: TensorParallel | None = None


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` (``t`` itself when it has them)."""
    missing = rows - t.shape[0]
    if missing == 0:
        return t
    return F.pad(t, [0, 0] * (t.dim() - 1) + [0, missing])
