"""Weight-update sharding for gloo: all_reduce + own-row read and N owner broadcasts become
all_to_all + a local sum and all_gather, each in chunks.

The ZeRO step (:mod:`compiled_hooks.zero`, both layouts) reduces a flat gradient bucket of
``N`` rows, reads only this rank's row, updates it, and rebuilds every row from its owner's
broadcast. On gloo this pass makes that exchange out of all_to_all (each rank is sent only its
row, and sums the N rows it receives) and all_gather, in pieces of at most
``all_to_all_chunk_bytes`` per destination (``core.groups.resolve_chunk_bytes``; why gloo needs
both, docs/passes.md). Two independent rewrites, each exact on its own:

1. *own row of an all_reduce* (sum or avg; matched as ``shard_weight_update`` matches it)::

       ar = all_reduce(x, 'sum', G)
       w = wait(ar); d = div(w, 2)
       v = view(d, [N, c])
       mine = index(v, [group_rank(G)])
           ->
       x2 = view(x, [N, c])
       a_k = all_to_all_single(clone(x2[:, k-th chunk]), [1]*N, [1]*N, G)   # each chunk k
       s_k = sum(wait(a_k), [0])
       mine = view(div(cat([s_0, s_1, ...]), 2), [1, c])

   Row j of the all_to_all's output is rank j's gradient for this rank's row; their sum is
   what the all_reduce gave this row (bit for bit on 2 ranks, where each element is one
   addition; on more ranks gloo's ring adds in another order, within rounding). A bucket
   packed by a ``cat`` of members (the ZeRO hooks') is never packed whole: each chunk is
   written from the members (:func:`_packed_rows`).
2. *owner broadcasts* of a flat ``y`` from every rank in rank order::

       full = cat([wait(broadcast(y, 0, G)), ..., wait(broadcast(y, N-1, G))])
    ->
       g_k = view(wait(all_gather_into_tensor(y[k-th chunk], N, G)), [N, chunk])
       full = view(cat([g_0, g_1, ...], 1), [N * c])

   and a member's write-back, ``view(full, [N, c])[r, a:b]``, reads the chunks that hold it
   instead, so the join of all rows is not made where nothing else reads it
   (:func:`_read_chunks`).

Only where the backend is in ``all_to_all_backends`` (default gloo: NCCL and the fake test
backend get ``shard_weight_update``'s reduce_scatter); others are left alone and counted. Runs
first, before anything buckets all_reduces; ``all_gather_as_all_to_all`` (last) then makes each
all_gather an all_to_all, since gloo's all_gather is not safe with several in flight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import cast

import torch
from torch.fx import Graph, Node

from .core.bucket import cat_prologue_problem
from .core.groups import ALL_TO_ALL_BACKENDS, chunk_bounds, resolve_chunk_bytes
from .core.interface import graph_pass
from .core.marks import check_graph, is_op
from .core.ops import ALL_GATHER, ALL_TO_ALL, VIEW_OPS, WAIT, arg, aten, val
from .core.record import record
from .core.values import flat_value, new_node, reapply
from .core.weight_update import weight_update_matches

__all__ = ["all_to_all_weight_update", "Options"]

PASS = "all_to_all_weight_update"


def _packed_rows(graph: Graph, chain, n: int, c: int, lo: int, hi: int) -> Node:
    """Columns ``lo:hi`` of every row of a bucket packed by a ``cat`` of 1-D members (``chain``
    starts at it), written straight from the members' slices with the hook's scales and casts
    applied to each (as ``fuse_cat_prologue`` does for a whole bucket): ``[n, hi - lo]``."""
    parts, bounds, at = [], [], 0
    for m in chain.start.args[0]:
        bounds.append((at, at + val(m).numel(), m))
        at += val(m).numel()
    for row in range(n):
        a, b = row * c + lo, row * c + hi
        for start, end, m in bounds:
            if end <= a or start >= b:
                continue
            part = m
            if start < a or end > b:
                part = new_node(
                    graph, aten.slice.Tensor, (m, 0, max(a, start) - start, min(b, end) - start)
                )
            parts.append(reapply(graph, part, chain.pre))
    flat = new_node(
        graph, aten.cat.default, (parts,), value=flat_value(val(parts[0]), n * (hi - lo))
    )
    return new_node(graph, aten.view.default, (flat, [n, hi - lo]))


def _rewrite_own_row(graph: Graph, index: Node, chain, n: int, chunk_bytes: int) -> int:
    x = chain.collective.args[0]
    c = val(x).numel() // n
    pieces = chunk_bounds(c, val(x).element_size(), chunk_bytes)
    packed = (
        is_op(chain.start, (aten.cat.default,))
        and cat_prologue_problem(chain.start, chain.pre) is None
    )
    with graph.inserting_before(chain.collective):
        rows = None if packed else new_node(graph, aten.view.default, (x, [n, c]))
        sent = []
        for lo, hi in pieces:
            if packed:
                piece = _packed_rows(graph, chain, n, c, lo, hi)
            elif len(pieces) > 1:
                piece = new_node(graph, aten.slice.Tensor, (rows, 1, lo, hi))
                piece = new_node(
                    graph, aten.clone.default, (piece,), {"memory_format": torch.contiguous_format}
                )
            else:
                piece = cast(Node, rows)  # not packed
            sent.append(new_node(graph, ALL_TO_ALL, (piece, [1] * n, [1] * n, chain.group_name)))
    with graph.inserting_before(chain.wait):
        sums = [
            new_node(graph, aten.sum.dim_IntList, (new_node(graph, WAIT, (a,)), [0])) for a in sent
        ]
        value = sums[0] if len(sums) == 1 else new_node(graph, aten.cat.default, (sums,))
        if chain.reduce_op == "avg":
            value = new_node(graph, aten.div.Tensor, (value, n))
    with graph.inserting_before(index):
        # the hook's scales and casts, on the row (elementwise)
        value = reapply(graph, value, chain.post)
        mine = new_node(graph, aten.view.default, (value, list(val(index).shape)))
    index.replace_all_uses_with(mine)
    dead = [index, *reversed(chain.post), chain.wait, chain.collective]
    dead += [*reversed(chain.pre), chain.start] if packed else []
    for node in dead:
        graph.erase_node(node)
    return len(pieces)


SELECT_OPS = (aten.select.int, aten.select_copy.int)
SLICE_OPS = (aten.slice.Tensor, aten.slice_copy.Tensor)


def _row_reads(full: Node, n: int) -> list[tuple[Node, int, int, int]]:
    """The reads ``view(full, [n, c])[r, a:b]`` (or a whole row ``[r]``) of the gathered rows,
    as ``(node, r, a, b)``."""
    reads = []
    c = val(full).numel() // n
    for rows in full.users:
        if not (is_op(rows, VIEW_OPS) and tuple(val(rows).shape) == (n, c)):
            continue
        for sel in rows.users:
            if not (is_op(sel, SELECT_OPS) and sel.args[1] == 0 and isinstance(sel.args[2], int)):
                continue
            r = sel.args[2] % n
            for piece in sel.users:
                if (
                    is_op(piece, SLICE_OPS)
                    and len(piece.args) == 4
                    and piece.args[1] == 0
                    and isinstance(piece.args[2], int)
                    and isinstance(piece.args[3], int)
                    and 0 <= piece.args[2] < min(piece.args[3], c)
                ):
                    reads.append((piece, r, piece.args[2], min(piece.args[3], c)))
            if not any(is_op(u, SLICE_OPS) for u in sel.users):
                reads.append((sel, r, 0, c))
    return reads


def _read_chunks(
    graph: Graph, full: Node, parts: list[Node], pieces: list[tuple[int, int]], n: int
) -> None:
    """Point each read of a member's columns ``a:b`` in row ``r`` of the joined rows ``full``
    at the gathered chunk(s) holding them, so the join (on CPU a copy of every row: Inductor
    makes every ``cat`` a kernel of its own there) is not made where nothing else reads it: a
    member within one chunk becomes a view of it, one across chunks a ``cat`` of its parts."""
    for piece, r, a, b in _row_reads(full, n):
        with graph.inserting_before(piece):
            spans = []
            for part, (lo, hi) in zip(parts, pieces):
                if lo < b and a < hi:
                    row = new_node(graph, aten.select.int, (part, 0, r))
                    spans.append(
                        new_node(
                            graph, aten.slice.Tensor, (row, 0, max(a, lo) - lo, min(b, hi) - lo)
                        )
                    )
            value = spans[0] if len(spans) == 1 else new_node(graph, aten.cat.default, (spans,))
        piece.replace_all_uses_with(value)
        graph.erase_node(piece)
        record(PASS, "row read from the gathered chunks", value)
    # the selections, the rows' view and the join, where nothing reads them any more
    join = arg(full)
    for node in (
        [sel for rows in list(full.users) for sel in list(rows.users)]
        + list(full.users)
        + [full, join]
    ):
        if not node.users and is_op(node, SELECT_OPS + VIEW_OPS + (aten.cat.default,)):
            graph.erase_node(node)


def _rewrite_owner_broadcasts(
    graph: Graph, cat: Node, broadcasts: list[Node], chunk_bytes: int
) -> int:
    y, _, group = broadcasts[0].args
    n, value = len(broadcasts), val(y)
    pieces = (
        chunk_bounds(value.numel(), value.element_size(), chunk_bytes)
        if value.dim() == 1
        else [(0, 0)]
    )
    with graph.inserting_before(broadcasts[0]):
        gathers = [
            new_node(
                graph,
                ALL_GATHER,
                (
                    y if len(pieces) == 1 else new_node(graph, aten.slice.Tensor, (y, 0, lo, hi)),
                    n,
                    group,
                ),
            )
            for lo, hi in pieces
        ]
    with graph.inserting_before(cat):
        parts = [new_node(graph, WAIT, (g,)) for g in gathers]
        if len(parts) == 1:
            full = parts[0]
        else:
            parts = [
                new_node(graph, aten.view.default, (p, [n, hi - lo]))
                for p, (lo, hi) in zip(parts, pieces)
            ]
            full = new_node(
                graph,
                aten.view.default,
                (new_node(graph, aten.cat.default, (parts, 1)), [n * value.numel()]),
            )
    cat.replace_all_uses_with(full)
    graph.erase_node(cat)
    for b in broadcasts:
        graph.erase_node(next(iter(b.users)))
        graph.erase_node(b)
    if len(parts) > 1:
        _read_chunks(graph, full, parts, pieces, n)
    return len(pieces)


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of :func:`all_to_all_weight_update`."""

    all_to_all_backends: Collection[str] = ALL_TO_ALL_BACKENDS
    """Backends whose weight exchange is rewritten."""
    all_to_all_chunk_bytes: int | None = None
    """Most bytes per destination of one all_to_all (``core.groups.resolve_chunk_bytes``)."""


@graph_pass(options=Options, after=("shard_weight_update",))
def all_to_all_weight_update(
    graph: Graph,
    all_to_all_backends: Collection[str] = ALL_TO_ALL_BACKENDS,
    all_to_all_chunk_bytes: int | None = None,
) -> bool:
    """Rewrite own-row all_reduces to chunked all_to_all + sum and owner broadcasts to chunked
    all_gathers (see the module docstring) on groups whose backend is in
    ``all_to_all_backends``; True if anything changed."""
    check_graph(PASS, graph)
    chunk_bytes = resolve_chunk_bytes(PASS, all_to_all_chunk_bytes)
    changed = False
    for node, chain, broadcasts, n in weight_update_matches(graph, PASS, all_to_all_backends, {}):
        if chain is not None:
            chunks = _rewrite_own_row(graph, node, chain, n, chunk_bytes)
            record(PASS, "all_reduce read in own row -> all_to_all", node)
        else:
            chunks = _rewrite_owner_broadcasts(graph, node, broadcasts, chunk_bytes)
            record(PASS, "owner broadcasts -> all_gather", node)
        record(PASS, f"{chunks} chunk(s)", node)
        changed = True
    return changed
