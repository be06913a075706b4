"""gloo: every functional ``all_gather_into_tensor`` becomes an ``all_to_all_single`` that sends
each rank the same piece, because the all_gather is not safe there with two in flight.

On gloo the functional all_gather (``allgather_coalesced``) corrupts the heap with two or more
in flight, and its ``_out`` variant is lowered in place, so its input may be overwritten before
the wait (the record is in docs/passes.md). The chunked all_gathers of
``all_to_all_weight_update``, and ``shard_weight_update``'s when it is forced on gloo, are
several in flight by design; so this pass runs last (after the scheduling passes, which treat
all_to_all as a gradient collective) and rewrites each::

    ag = all_gather_into_tensor(x, N, G)     ->    c = view(bucket_pack([x] * N, 1), [N * d, ...])
    w = wait_tensor(ag)                            ag = all_to_all_single(c, [d] * N, [d] * N, G)
                                                   w = wait_tensor(ag)    # d = x.size(0)

Row block j of the input goes to rank j and block j of the output comes from rank j, so the
output is the all_gather's, bit for bit, with the same bytes on the wire; the cost is one local
copy of ``N * x`` per collective, an opaque ``bucket_pack`` call
(:mod:`compiled_hooks.bucket_copies`), which costs Inductor no kernel to compile for each size.
Where ``x`` is itself a flat ``bucket_pack`` read only by the all_gather (a block's bucket), its
pieces are packed ``N`` times in one call, and the bucket is not copied twice::

    x = bucket_pack(pieces, 1)                ->    c = view(bucket_pack(pieces * N, 1), [N * d])
An input of more than ``all_to_all_chunk_bytes`` goes out in several all_to_alls of at most
that many bytes per destination, all issued where the all_gather was and all waited for where
its wait was (gloo moves one large all_to_all well below a bandwidth-bound link's rate, pieces
close to it; by default ``ALL_TO_ALL_CHUNK_BYTES`` where the ranks span hosts, one all_to_all
where they share one: ``core.groups.resolve_chunk_bytes``); the pieces' rank-major outputs are
joined back into the all_gather's::

    ag = all_gather_into_tensor(x, N, G)
    w = wait_tensor(ag)
        ->
    a_k = all_to_all_single(view(bucket_pack([x[lo_k:hi_k]] * N, 1), [N * c_k, ...]),
                            [c_k] * N, [c_k] * N, G)                            # each piece k
    w = view(bucket_pack([wait_tensor(a_k) for each k], N), [N * d, ...])  # rank r's rows together

Groups whose backend is not in ``all_gather_backends`` (default gloo only: NCCL's all_gather is
its own implementation) are left alone and counted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from typing import cast

from torch.fx import Graph, Node

from .core.groups import ALL_TO_ALL_BACKENDS, chunk_bounds, group_info, resolve_chunk_bytes
from .core.interface import graph_pass
from .core.marks import calls, check_graph, is_op
from .core.ops import ALL_GATHER, ALL_TO_ALL, BUCKET_PACK, WAIT, aten, val
from .core.record import record
from .core.values import new_node

__all__ = ["all_gather_as_all_to_all", "Options"]

PASS = "all_gather_as_all_to_all"


def _copies(graph: Graph, x: Node, size: int) -> Node:
    """``size`` copies of ``x`` stacked along its first dimension; where ``x`` is a flat
    ``bucket_pack`` with no other user, of its pieces (the caller erases ``x`` then)."""
    shape = list(val(x).shape)
    pieces: list[Node] = [x]
    if is_op(x, (BUCKET_PACK,)) and x.args[1] == 1 and len(x.users) == 1:
        pieces = cast(list[Node], x.args[0])
    packed = new_node(graph, BUCKET_PACK, (pieces * size, 1))
    return new_node(graph, aten.view.default, (packed, [size * shape[0], *shape[1:]]))


def _in_pieces(graph: Graph, ag: Node, pieces: list[tuple[int, int]]) -> Node:
    """The chunked rewrite of ``ag`` (whose only user is its wait); returns the joined value."""
    x, size, group = ag.args[0], cast(int, ag.args[1]), ag.args[2]
    (wait,) = ag.users
    with graph.inserting_before(ag):
        sent = []
        for lo, hi in pieces:
            copies = _copies(graph, new_node(graph, aten.slice.Tensor, (x, 0, lo, hi)), size)
            sent.append(
                new_node(graph, ALL_TO_ALL, (copies, [hi - lo] * size, [hi - lo] * size, group))
            )
    with graph.inserting_before(wait):
        received = [new_node(graph, WAIT, (a,)) for a in sent]
        joined = new_node(graph, BUCKET_PACK, (received, size))
        out = new_node(graph, aten.view.default, (joined, list(val(wait).shape)))
    wait.replace_all_uses_with(out)
    graph.erase_node(wait)
    return sent[0]


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of :func:`all_gather_as_all_to_all`."""

    all_gather_backends: Collection[str] = ALL_TO_ALL_BACKENDS
    """Backends whose all-gathers are rewritten."""
    all_to_all_chunk_bytes: int | None = None
    """Most bytes per destination of one all_to_all (``core.groups.resolve_chunk_bytes``)."""


@graph_pass(
    options=Options,
    after=(
        "schedule_collectives",
        "prefetch_block_all_gathers",
        "bucket_block_all_gathers",
        "shard_weight_update",
        "all_to_all_weight_update",
        "bucket_quantized_collectives",
    ),
)
def all_gather_as_all_to_all(
    graph: Graph,
    all_gather_backends: Collection[str] = ALL_TO_ALL_BACKENDS,
    all_to_all_chunk_bytes: int | None = None,
) -> bool:
    """Rewrite all_gathers on groups whose backend is in ``all_gather_backends`` to all_to_alls
    of ``N`` copies of the input, in pieces of at most ``all_to_all_chunk_bytes`` per
    destination (see the module docstring); True if anything changed."""
    check_graph(PASS, graph)
    chunk_bytes = resolve_chunk_bytes(PASS, all_to_all_chunk_bytes)
    changed = False
    for ag in calls(graph, (ALL_GATHER,)):
        x, size, group = cast(tuple[Node, int, str], ag.args)
        info = group_info(group)
        if info is None or info.backend not in all_gather_backends:
            record(PASS, f"skipped: backend {info.backend if info else 'unknown'}", ag)
            continue
        value = val(x)
        pieces = chunk_bounds(
            value.shape[0],
            math.prod(value.shape[1:]) * value.element_size(),
            chunk_bytes,
        )
        single_wait = len(ag.users) == 1 and is_op(next(iter(ag.users)), (WAIT,))
        if len(pieces) > 1 and single_wait:
            a2a = _in_pieces(graph, ag, pieces)
            record(PASS, f"all_gather -> {len(pieces)} all_to_alls", a2a)
        else:
            splits = [value.shape[0]] * size
            with graph.inserting_before(ag):
                a2a = new_node(graph, ALL_TO_ALL, (_copies(graph, x, size), splits, splits, group))
            ag.replace_all_uses_with(a2a)
        graph.erase_node(ag)
        if not x.users:
            graph.erase_node(x)
        record(PASS, "all_gather -> all_to_all", a2a)
        changed = True
    return changed
