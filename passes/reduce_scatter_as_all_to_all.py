"""gloo: every functional ``reduce_scatter_tensor`` becomes an ``all_to_all_single`` and a local
sum, because gloo's reduce-scatter is slow.

On gloo (torch 2.13) a reduce-scatter takes longer than an all-reduce of the same tensor, which
moves twice the bytes, and longer than an all-to-all of it (measured on the shaped link:
docs/benchmarks.md, "Collective costs on gloo"). An all-to-all sends every
rank the same bytes a ring reduce-scatter does, ``(N - 1) / N`` of the input; each rank then adds
up the ``N`` pieces it received, in rank order, accumulating in fp32 when the wire dtype is
narrower::

    r = reduce_scatter_tensor(x, "avg", N, G)   ->  a = all_to_all_single(x, [d] * N, [d] * N, G)
    w = wait_tensor(r)                               w = wait_tensor(a)           # d = x.size(0) / N
                                                     s = sum(view(w, [N, d, ...]), [0], dtype=f32)
                                                     w' = convert_element_type(div(s, N), x.dtype)

Row block ``j`` of every rank's input goes to rank ``j``, so rank ``j`` sums exactly the pieces
the reduce-scatter sums into its shard; only the order of the additions is the pass's (rank
order, in fp32), and every shard is computed on one rank only, so ranks cannot disagree. The
cost is a receive buffer of the input's size instead of the shard's, and a local sum. Groups
whose backend is not in ``reduce_scatter_backends`` (default gloo only) and reduce ops other than
sum and avg are left alone and counted. Runs last, after the scheduling passes: the wait stays
where they put it, and the sum goes right after it.
"""

from __future__ import annotations

from typing import Collection

import torch
from torch.fx import Graph

from ._graph import ALL_TO_ALL, REDUCE_SCATTER, WAIT, aten, check_graph, group_info, is_op, new_node, prims, record, val

PASS = "reduce_scatter_as_all_to_all"
BACKENDS = frozenset({"gloo"})


def reduce_scatter_as_all_to_all(graph: Graph, reduce_scatter_backends: Collection[str] = BACKENDS) -> bool:
    """Rewrite reduce-scatters on groups whose backend is in ``reduce_scatter_backends`` into an
    all_to_all and a local sum (see the module docstring); True if anything changed."""
    check_graph(PASS, graph)
    changed = False
    for rs in [n for n in graph.nodes if is_op(n, (REDUCE_SCATTER,))]:
        x, op, size, group = rs.args
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
        shape = list(val(x).shape)
        splits = [shape[0] // size] * size
        dtype = val(x).dtype
        acc = torch.float32 if dtype.is_floating_point and dtype.itemsize < 4 else dtype
        with graph.inserting_before(rs):
            a2a = new_node(graph, ALL_TO_ALL, (x, splits, splits, group))
        users = list(wait.users)
        wait.replace_input_with(rs, a2a)
        wait.meta["val"] = val(a2a)
        with graph.inserting_before(wait.next):
            pieces = new_node(graph, aten.view.default, (wait, [size, splits[0], *shape[1:]]))
            total = new_node(graph, aten.sum.dim_IntList, (pieces, [0]), {"dtype": acc})
            if op == "avg":
                total = new_node(graph, aten.div.Tensor, (total, size))
            if acc != dtype:
                total = new_node(graph, prims.convert_element_type.default, (total, dtype))
        for user in users:
            user.replace_input_with(wait, total)
        graph.erase_node(rs)
        record(PASS, "reduce_scatter -> all_to_all + sum", a2a)
        changed = True
    return changed
