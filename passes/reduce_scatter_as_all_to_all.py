"""gloo: every functional ``reduce_scatter_tensor`` becomes an ``all_to_all_single`` and a local
sum, because gloo's reduce-scatter is slow.

On gloo a reduce-scatter takes longer than an all-reduce of the same tensor, which moves twice
the bytes, and longer than an all-to-all of it (docs/benchmarks.md, "Collective costs on gloo",
has the figures). An all-to-all sends every rank the same bytes a ring reduce-scatter does,
``(N - 1) / N`` of the input; each rank then adds up the ``N`` pieces it received, in rank
order, accumulating in fp32 when the wire dtype is narrower::

    r = reduce_scatter_tensor(x, "avg", N, G)   ->  a = all_to_all_single(x, [d] * N, [d] * N, G)
    w = wait_tensor(r)                               w = wait_tensor(a)     # d = x.size(0) / N
                                                     w' = rank_sum(w, N, N)   # "sum": divisor 1

``rank_sum`` (:mod:`compiled_hooks.rank_sum`) adds the ``N`` received blocks in rank order, in
fp32 where the wire dtype is narrower, divides and casts back. Row block ``j`` of every rank's
input goes to rank ``j``, so rank ``j`` sums exactly the pieces the reduce-scatter sums into its
shard; only the order of the additions is the pass's, and every shard is computed on one rank
only, so ranks cannot disagree. The cost is a receive buffer of the input's size instead of the
shard's, and a local sum: an opaque call, which costs Inductor no kernel to compile. Groups
whose backend is not in ``reduce_scatter_backends`` (default gloo only) and reduce ops other than
sum and avg are left alone and counted. Runs last, after the scheduling passes: the wait stays
where they put it, and the sum goes right after it.

A sender's division by a power of two (a hook's pre-division, which ``fold_collective_scaling``
leaves where the wire dtype is fp16 or the division is alone on gloo) goes into the sum: the
undivided input is sent and ``rank_sum`` divides each received block first, what the senders'
division would have given, bit for bit (``rank_sum.exact_predivisor``), one pass over the bucket
and one kernel fewer::

    d = div(x, 2.0)                          a = all_to_all_single(x, [d] * N, [d] * N, G)
    r = reduce_scatter_tensor(d, "sum", N, G)  ->  w' = rank_sum(wait_tensor(a), N, 1, 2)

An input of more than ``all_to_all_chunk_bytes`` per destination goes out in several
all_to_alls of at most that many (as ``all_gather_as_all_to_all`` sends its pieces): rows
``lo:hi`` of every rank's row block, copied out together by one ``bucket_unpack``
(:mod:`compiled_hooks.bucket_copies`), and each piece summed right after its wait::

    p = bucket_unpack(view(x, [-1]), N, [c_0 * m, c_1 * m, ...])     # m: elements of one row
    a_k = all_to_all_single(view(p[k], [N * c_k, ...]), [c_k] * N, [c_k] * N, G)
    s_k = rank_sum(wait_tensor(a_k), N, N)                                   # for each k
    w' = view(bucket_pack([s_0, s_1, ...], 1), [d, ...])
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Collection
from typing import cast

from torch.fx import Graph, Node

from .core.groups import ALL_TO_ALL_BACKENDS, chunk_bounds, group_info, resolve_chunk_bytes
from .core.interface import graph_pass
from .core.marks import calls, check_graph, is_op
from .core.ops import (
    ALL_TO_ALL,
    BUCKET_PACK,
    BUCKET_UNPACK,
    DIV_OPS,
    RANK_SUM,
    REDUCE_SCATTER,
    WAIT,
    aten,
    exact_predivisor,
    val,
)
from .core.record import record
from .core.values import new_node

__all__ = ["reduce_scatter_as_all_to_all", "Options"]

PASS = "reduce_scatter_as_all_to_all"


def _sent(graph: Graph, x: Node, size: int, group, pieces: list[tuple[int, int]]) -> list[Node]:
    """The all_to_alls of ``x``'s row blocks, whole or by the rows ``pieces`` of each."""
    if len(pieces) == 1:
        split = [pieces[0][1]] * size
        return [new_node(graph, ALL_TO_ALL, (x, split, split, group))]
    rest = list(val(x).shape[1:])
    row = math.prod(rest)
    flat = new_node(graph, aten.view.default, (x, [-1]))
    unpacked = new_node(graph, BUCKET_UNPACK, (flat, size, [(hi - lo) * row for lo, hi in pieces]))
    sent = []
    for k, (lo, hi) in enumerate(pieces):
        piece = new_node(graph, operator.getitem, (unpacked, k))
        piece = new_node(graph, aten.view.default, (piece, [size * (hi - lo), *rest]))
        sent.append(new_node(graph, ALL_TO_ALL, (piece, [hi - lo] * size, [hi - lo] * size, group)))
    return sent


def _predivision(x: Node) -> tuple[Node, int]:
    """``(y, c)`` where ``x`` is ``div(y, c)``, read by the reduce-scatter alone, ``c`` a power of
    two above one and ``y`` of ``x``'s dtype; else ``(x, 1)``."""
    if not is_op(x, DIV_OPS) or x.kwargs or len(x.users) != 1:
        return x, 1
    y, c = x.args
    y_value = val(y)
    same_dtype = y_value is not None and y_value.dtype == val(x).dtype
    if not same_dtype or not exact_predivisor(c) or c == 1:
        return x, 1
    return cast(Node, y), int(cast(float, c))


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of :func:`reduce_scatter_as_all_to_all`."""

    reduce_scatter_backends: Collection[str] = ALL_TO_ALL_BACKENDS
    """Backends whose reduce-scatters are rewritten."""
    all_to_all_chunk_bytes: int | None = None
    """Most bytes per destination of one all_to_all (``core.groups.resolve_chunk_bytes``)."""


@graph_pass(
    options=Options,
    after=(
        "schedule_collectives",
        "bucket_block_reduce_scatters",
        "bucket_compressed_collectives",
        "fold_collective_scaling",
        "shard_weight_update",
    ),
)
def reduce_scatter_as_all_to_all(
    graph: Graph,
    reduce_scatter_backends: Collection[str] = ALL_TO_ALL_BACKENDS,
    all_to_all_chunk_bytes: int | None = None,
) -> bool:
    """Rewrite reduce-scatters on groups whose backend is in ``reduce_scatter_backends`` into
    all_to_alls of at most ``all_to_all_chunk_bytes`` per destination and a local sum (see the
    module docstring); True if anything changed."""
    check_graph(PASS, graph)
    chunk_bytes = resolve_chunk_bytes(PASS, all_to_all_chunk_bytes)
    changed = False
    for rs in calls(graph, (REDUCE_SCATTER,)):
        x, op, size, group = cast(tuple[Node, str, int, str], rs.args)
        info = group_info(group)
        if info is None or info.backend not in reduce_scatter_backends:
            record(PASS, f"skipped: backend {info.backend if info else 'unknown'}", rs)
            continue
        if op not in ("sum", "avg"):
            record(PASS, f"skipped: reduce op {op}", rs)
            continue
        if len(rs.users) != 1 or not is_op(next(iter(rs.users)), (WAIT,)):
            record(PASS, "skipped: not a single-wait reduce_scatter", rs)
            continue
        (wait,) = rs.users
        division = x
        x, predivisor = _predivision(x)
        value = val(x)
        shape = list(value.shape)
        d = shape[0] // size
        pieces = chunk_bounds(d, math.prod(shape[1:]) * value.element_size(), chunk_bytes)
        if not value.is_contiguous():
            pieces = [(0, d)]
        with graph.inserting_before(rs):
            sent = _sent(graph, x, size, group, pieces)
        users = list(wait.users)
        scales = (size if op == "avg" else 1,) + ((predivisor,) if predivisor != 1 else ())
        with graph.inserting_before(wait):
            sums = [
                new_node(graph, RANK_SUM, (new_node(graph, WAIT, (a,)), size, *scales))
                for a in sent
            ]
            total = sums[0]
            if len(sums) > 1:
                joined = new_node(graph, BUCKET_PACK, (sums, 1))
                total = new_node(graph, aten.view.default, (joined, [d, *shape[1:]]))
        for user in users:
            user.replace_input_with(wait, total)
        graph.erase_node(wait)
        graph.erase_node(rs)
        if division is not x:
            graph.erase_node(division)
            record(PASS, f"division by {predivisor} folded into the sum", sent[0])
        record(PASS, "reduce_scatter -> all_to_all + sum", sent[0])
        if len(sent) > 1:
            record(PASS, f"reduce_scatter -> {len(sent)} all_to_alls", sent[0])
        changed = True
    return changed
