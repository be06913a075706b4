"""bucket_block_reduce_scatters: one reduce-scatter per ``data_parallel`` block, the hook's scale
and casts written into the rank-major bucket.

``compiled_hooks.fsdp.data_parallel`` reduces every parameter's gradient through the comm hook
on its own, and marks each reduce-scatter with its block
(``node.meta["custom"]["data_parallel_block"]``). This pass merges the reduce-scatter chains of
one block (same group, reduce op, wire dtype and device), compressed or not, the way
``fuse_collective_casts`` merges compressed ones (shared :func:`passes._bucket.merge_chains`)::

    before                                        after
    d1 = div(g1, 2); c1 = convert(d1, bf16)        d1 = div(g1, 2); c1 = convert(d1, bf16)
    r1 = reduce_scatter_tensor(c1, "sum", N, g)    d2 = div(g2, 2); c2 = convert(d2, bf16)
    w1 = wait_tensor(r1)                           rows = cat([reshape(c1, [N, -1]),
    o1 = convert(w1, f32)                                      reshape(c2, [N, -1])], 1)
                                                   flat = reshape(rows, [-1])
    d2 = div(g2, 2); c2 = convert(d2, bf16)        r = reduce_scatter_tensor(flat, "sum", N, g)
    r2 = reduce_scatter_tensor(c2, "sum", N, g)    ... rest of backward overlaps ...
    w2 = wait_tensor(r2)                           w = wait_tensor(r)
    o2 = convert(w2, f32)                          pieces = split_with_sizes(w, [n1, n2])
                                                   o1 = convert(pieces[0], f32); o2 =
                                                   convert(pieces[1], f32)

Rank ``r`` receives its shard of every member. What only carries a member's result to
the graph's outputs (the copy into the gradient, the cast back, the slice to the local rows) moves
to the end of the graph first; the bucket then goes out right after the block's last gradient and
is waited right before the first use of a result; any division
``fold_collective_scaling`` left stays inside the member's copy-in (the pipeline folds it into
the collective first where the backend averages). Members with a non-constant factor or a
shared intermediate are left alone, and so is a bucket whose member's result is used before its
last input is ready; all counted. Idempotent: a block holds one reduce-scatter after it.
"""

from __future__ import annotations

from typing import Any

from torch.fx import Graph, Node

from ._bucket import merge_chains
from ._graph import (
    REDUCE_SCATTER,
    WAIT,
    Chain,
    block_of,
    chains,
    check_graph,
    is_chain_op,
    is_op,
    record,
    val,
)
from .interface import graph_pass

__all__ = ["bucket_block_reduce_scatters"]

PASS = "bucket_block_reduce_scatters"


def _key(chain: Chain) -> tuple[Any, ...]:
    c = chain.collective
    return (block_of(c), c.args[1:], chain.wire_dtype, val(c).device)


def _downstream(bucket: list[Chain]) -> set[Node] | None:
    """Everything downstream of the ``bucket``'s results short of the graph's output (the copy
    into the gradient's buffer, the cast back, the slice to the local rows); None if a node there
    has side effects."""
    downstream, frontier = set(), [chain.end for chain in bucket]
    while frontier:
        for user in frontier.pop().users:
            if user.op == "output" or user in downstream:
                continue
            if user.op != "call_function" or user.is_impure():
                return None
            downstream.add(user)
            frontier.append(user)
    return downstream


def _sink_to_outputs(graph: Graph, downstream: set[Node]) -> bool:
    """Move ``downstream`` (closed under users, pure) to just before the graph's output, in graph
    order, so that every bucket's wait can go after its block's last gradient; whether a node
    moved (not when nothing but waits and their post ops, which ``schedule_collectives`` puts
    right before their first use, stands among them at the end of the graph)."""
    nodes = list(graph.nodes)
    moving = [n for n in nodes if n in downstream]
    if not moving or all(
        n in downstream or is_op(n, (WAIT,)) or is_chain_op(n)
        for n in nodes[nodes.index(moving[0]) :]
        if n.op != "output"
    ):
        return False
    output = graph.output_node()
    for node in moving:
        output.prepend(node)
    return True


@graph_pass(after=("fold_collective_scaling",))
def bucket_block_reduce_scatters(graph: Graph) -> bool:
    """Merge each ``data_parallel`` block's reduce-scatters (see the module docstring); True when
    the graph changed."""
    check_graph(PASS, graph)
    groups: dict[tuple, list[Chain]] = {}
    for chain in chains(graph, PASS):
        if chain.collective.target is not REDUCE_SCATTER or block_of(chain.collective) is None:
            continue
        if chain.problem or not isinstance(chain.group_name, str):
            record(
                PASS,
                f"skipped: {chain.problem or 'group passed as a graph input'}",
                chain.collective,
            )
            continue
        groups.setdefault(_key(chain), []).append(chain)
    sinking: set[Node] = set()  # every block's, a block of one member's too, moved together
    for bucket in groups.values():
        downstream = _downstream(bucket)
        if downstream is None:
            record(PASS, "skipped: a use of a result has side effects", bucket[0].collective)
        else:
            sinking |= downstream
    changed = _sink_to_outputs(graph, sinking)
    order = {n: i for i, n in enumerate(graph.nodes)}
    moved: set[Node] = set()
    for bucket in groups.values():
        if len(bucket) > 1:
            changed |= merge_chains(PASS, graph, bucket, order, moved) is not None
    return changed
