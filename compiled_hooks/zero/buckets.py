"""A ZeRO bucket on the wire: its gradients packed into one flat buffer of ``world_size`` equal
rows, a rank's own row read back, and every rank's row broadcast from that rank.

Two packings, one per storage strategy (:mod:`.storage`)::

    owner-major (whole parameters)       rank-major (shard_buckets)
    row 0: [a][c][pad]  members 0 owns    row 0: [a0][b0][c0]  rank 0's slice of each member
    row 1: [b][pad   ]  members 1 owns    row 1: [a1][b1][c1]  (each member padded to N slices)

Every function is traceable and makes the same graph on every rank: the rank is a tensor read
when the graph runs (:func:`~compiled_hooks.zero.group_rank.group_rank`), never a Python value.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fcol
import torch.nn.functional as F

from .layout import owner_rows

__all__ = ["broadcast_rows", "own_row", "owner_major", "rank_major"]


def own_row(
    flat: torch.Tensor, world_size: int, rank: torch.Tensor | Callable[[], torch.Tensor]
) -> torch.Tensor:
    """Row ``rank`` of ``flat``, ``world_size`` equal rows: the read ``passes`` recognize as
    "this rank's row" (``shard_weight_update``, ``all_to_all_weight_update``). ``rank``: a
    1-element tensor, or a function making one, called where the row is read."""
    rows = flat.view(world_size, flat.numel() // world_size)
    return rows.index_select(0, rank() if callable(rank) else rank).view(-1)


def rank_major(tensors: list[torch.Tensor], chunks: list[int], world_size: int) -> torch.Tensor:
    """``tensors`` flat, each padded to ``world_size`` slices of its ``chunks`` entry, laid out so
    that row r holds slice r of every tensor, in order."""
    parts = [
        F.pad(t.reshape(-1), (0, world_size * c - t.numel())).view(world_size, -1)
        for t, c in zip(tensors, chunks)
    ]
    return torch.cat(parts, dim=1).reshape(-1)


def owner_major(
    tensors: list[torch.Tensor], owners: list[int], world_size: int
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """``tensors`` flat, owner-major (``[world_size * L]``: row r holds the tensors rank r owns,
    in order, every row padded to the longest), and each one's (row, offset in the row)."""
    rows = owner_rows([t.numel() for t in tensors], owners, world_size)
    parts = []
    for r in range(world_size):
        row = [t.reshape(-1) for t, (owner, _) in zip(tensors, rows.place) if owner == r]
        pad = rows.length - sum(t.numel() for t in row)
        parts += row + ([tensors[0].new_zeros(pad)] if pad else [])
    return torch.cat(parts), rows.place


def broadcast_rows(own: torch.Tensor, group: dist.ProcessGroup, world_size: int) -> torch.Tensor:
    """Every rank's ``own`` row, each broadcast from its rank: ``[world_size, own.numel()]``."""
    rows = torch.cat([fcol.broadcast(own, src, group) for src in range(world_size)])
    return rows.view(world_size, -1)
