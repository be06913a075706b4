"""What the passes know of process groups: a collective's group size and backend, where the
ranks run, and how the gloo rewrites cut an all_to_all into pieces."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import torch.distributed as dist

from compiled_hooks import compat

# Backends where reduce op avg is worth folding into: NCCL averages inside the collective.
# gloo implements avg too (torch 2.13), but as a sum followed by a division pass over the
# result in the wire dtype, issued after the wire time, which costs more than the multiplication
# it saves (docs/benchmarks.md). There the factors become one multiplication before the cast,
# inside the cast's kernel. "fake" is the test backend (no communication; it stands for NCCL in
# traced graphs).
AVG_BACKENDS = frozenset({"nccl", "fake"})
# Backends whose collectives the *_as_all_to_all rewrites make all_to_alls of, by default
ALL_TO_ALL_BACKENDS = frozenset({"gloo"})
# The most bytes per destination one all_to_all the gloo rewrites send (all_to_all_weight_update,
# all_gather_as_all_to_all, reduce_scatter_as_all_to_all) where the ranks span hosts: on a
# bandwidth-bound link gloo moves one large all_to_all well below the link's rate, and the same
# bytes in pieces of this size, all in flight, close to it. Where every rank runs on one host the
# exchange goes through loopback, where one all_to_all moves at memory speed and each piece costs
# more than it saves: there it goes out whole (docs/benchmarks.md, "Collective costs on gloo").
ALL_TO_ALL_CHUNK_BYTES = 512 << 10


@dataclasses.dataclass(frozen=True)
class GroupInfo:
    size: int
    backend: str


def group_info(group_name: Any) -> GroupInfo | None:
    """Size and backend of the group a collective names; None if it cannot be resolved
    (a group passed as a graph input, or one this process does not know)."""
    if not isinstance(group_name, str):
        return None
    try:
        pg = compat.resolve_process_group(group_name)
        return GroupInfo(pg.size(), str(dist.get_backend(pg)).lower())
    except Exception:  # noqa: BLE001 - an unknown group is simply not ours to rewrite
        return None


def ranks_on_one_host() -> bool:
    """Whether torchrun's environment says that every rank of the job runs on this host
    (``LOCAL_WORLD_SIZE == WORLD_SIZE``); False where either is unset. The same on every rank of
    a job that torchrun (or a launcher setting its variables) started."""
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    return local is not None and local == world


def resolve_chunk_bytes(pass_name: str, chunk_bytes: int | None) -> int:
    """The most bytes per destination one all_to_all of ``pass_name`` sends: ``chunk_bytes``
    where given (a positive int, else ``ValueError``); by default ``ALL_TO_ALL_CHUNK_BYTES``,
    or no limit where :func:`ranks_on_one_host`."""
    if chunk_bytes is None:
        return sys.maxsize if ranks_on_one_host() else ALL_TO_ALL_CHUNK_BYTES
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(
            f"{pass_name}: all_to_all_chunk_bytes must be a positive int or None, "
            f"got {chunk_bytes!r}"
        )
    return chunk_bytes


def chunk_bounds(count: int, item_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges that split ``count`` items of ``item_bytes`` each into equal pieces
    of at most ``chunk_bytes`` (at least one item each; the last piece may be shorter)."""
    if count <= 0:
        return [(0, count)]
    pieces = -(-count // max(1, chunk_bytes // max(1, item_bytes)))
    size = -(-count // pieces)
    return [(lo, min(lo + size, count)) for lo in range(0, count, size)]
