"""Weight gathers that send fewer bytes than ``param_dtype`` values, by the dtype a user names
(``data_parallel(gather_dtype=...)``). The feature that implements one registers it on import
(``torch.int8``: :mod:`.int8.collectives`), so ``fsdp`` finds it here and imports no feature.

A gather takes this rank's shard, padded to whole shards and flattened, and the shard group,
and gives every rank's values, dequantized to fp32, rank-major: the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["WeightGather", "register", "find", "dtypes"]

WeightGather = Callable[[torch.Tensor, Any], torch.Tensor]

_GATHERS: dict[torch.dtype, WeightGather] = {}


def register(dtype: torch.dtype, gather: WeightGather) -> None:
    _GATHERS[dtype] = gather


def find(dtype: torch.dtype) -> WeightGather:
    """The gather registered for ``dtype`` (``KeyError`` if none is)."""
    return _GATHERS[dtype]


def dtypes() -> list[torch.dtype]:
    return list(_GATHERS)
