"""bucket_block_reduce_scatters: one reduce-scatter per ``data_parallel`` block, its copy-in one
opaque call.

``compiled_hooks.fsdp.data_parallel`` reduces every parameter's gradient through the comm hook
on its own, and marks each reduce-scatter with its block
(``node.meta["custom"]["data_parallel_block"]``). This pass merges the reduce-scatter chains of
one block (same group, reduce op, wire dtype and device), compressed or not, the way
``bucket_compressed_collectives`` merges compressed ones (shared
:func:`passes.core.bucket.merge_chains`), with the rank-major copy-in as one ``bucket_pack``
call (:mod:`compiled_hooks.bucket_copies`), which Inductor neither fuses nor compiles: the
hook's scale and casts stay kernels of their own, the same for every block of one shape::

    before                                        after
    d1 = div(g1, 2); c1 = convert(d1, bf16)        d1 = div(g1, 2); c1 = convert(d1, bf16)
    r1 = reduce_scatter_tensor(c1, "sum", N, g)    d2 = div(g2, 2); c2 = convert(d2, bf16)
    w1 = wait_tensor(r1)                           flat = bucket_pack([c1, c2], N)
    o1 = convert(w1, f32)                          r = reduce_scatter_tensor(flat, "sum", N, g)
                                                   ... rest of backward overlaps ...
    d2 = div(g2, 2); c2 = convert(d2, bf16)        w = wait_tensor(r)
    r2 = reduce_scatter_tensor(c2, "sum", N, g)    pieces = split_with_sizes(w, [n1, n2])
    w2 = wait_tensor(r2)                           o1 = convert(pieces[0], f32); o2 =
    o2 = convert(w2, f32)                          convert(pieces[1], f32)

Rank ``r`` receives its shard of every member. What only carries a member's result to
the graph's outputs (the copy into the gradient, the cast back, the slice to the local rows) moves
to the end of the graph first; the bucket then goes out right after the block's last gradient and
is waited right before the first use of a result; any division
``fold_collective_scaling`` left stays before the member's copy-in (the pipeline folds it into
the collective first where the backend averages). Members with a non-constant factor or a
shared intermediate are left alone, and so is a bucket whose member's result is used before its
last input is ready; all counted. Idempotent: a block holds one reduce-scatter after it.

With ``hybrid_shard`` each result is all-reduced over the replicas (the replica hook's chain,
marked with the same block) before it reaches the output. Those all-reduce chains move to the
end with the rest, and a block's become one all-reduce of its own, after its reduce-scatter's
wait::

    before                                        after (end of the graph)
    r1 = reduce_scatter_tensor(d1, ..., shard)    w = wait_tensor(r)  # the block's bucket
    w1 = wait_tensor(r1)                          a = all_reduce(bucket_pack([div(w[:n1], 2),
    a1 = all_reduce(div(w1, 2), "sum", replica)          div(w[n1:], 2)], 1), ...)
    b1 = copy(out1, wait_tensor(a1))              b1, b2 = pieces of wait_tensor(a)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch.fx import Graph, Node

from .core.bucket import merge_chains
from .core.chains import Chain, chains, is_chain_op, match_chain
from .core.interface import graph_pass
from .core.marks import block_of, check_graph, is_op
from .core.ops import ALL_REDUCE, REDUCE_SCATTER, WAIT, val
from .core.record import record

__all__ = ["bucket_block_reduce_scatters"]

PASS = "bucket_block_reduce_scatters"


def _key(chain: Chain) -> tuple[Any, ...]:
    c = chain.collective
    return (block_of(c), c.args[1:], chain.wire_dtype, val(c).device)


def _downstream(
    bucket: list[Chain], replicas: dict[Node, Chain]
) -> tuple[set[Node], list[Chain]] | None:
    """Everything downstream of the ``bucket``'s results short of the graph's output (the copy
    into the gradient's buffer, the cast back, the slice to the local rows), and the replica
    all-reduce chains (of ``replicas``, keyed by their wait) on the way; None if another node
    there has side effects."""
    downstream: set[Node] = set()
    passed: list[Chain] = []
    frontier = [chain.end for chain in bucket]
    while frontier:
        for user in frontier.pop().users:
            if user.op == "output" or user in downstream:
                continue
            if user.op != "call_function" or (user.is_impure() and user not in replicas):
                return None
            if user in replicas:
                passed.append(replicas[user])
            downstream.add(user)
            frontier.append(user)
    return downstream, passed


def _sink_to_outputs(graph: Graph, downstream: set[Node], late: set[Node]) -> bool:
    """Move ``downstream`` (closed under users, pure but for replica waits) to just before the
    graph's output, in graph order but with ``late`` (what reads a replica all-reduce's result)
    after the rest, so that every bucket's wait can go after its block's last gradient and every
    replica bucket's after its last input; whether a node moved (not when nothing but waits and
    their post ops, which ``schedule_collectives`` puts right before their first use, stands
    among them at the end of the graph)."""
    nodes = list(graph.nodes)
    first = next((i for i, n in enumerate(nodes) if n in downstream), None)
    if first is None or all(
        n in downstream or is_op(n, (WAIT,)) or is_chain_op(n)
        for n in nodes[first:]
        if n.op != "output"
    ):
        return False
    moving = [n for n in nodes if n in downstream and n not in late]
    moving += [n for n in nodes if n in late]
    output = graph.output_node()
    for node in moving:
        output.prepend(node)
    return True


def _replica_chains(found: list[Chain]) -> dict[Node, Chain]:
    """The block-marked all-reduce chains of ``found`` (each could follow a reduce-scatter),
    keyed by their wait."""
    return {
        chain.wait: chain
        for chain in found
        if chain.collective.target is ALL_REDUCE
        and block_of(chain.collective) is not None
        and chain.problem is None
        and isinstance(chain.group_name, str)
    }


def _merge(graph: Graph, buckets: Iterable[list[Chain]]) -> bool:
    order = {n: i for i, n in enumerate(graph.nodes)}
    moved: set[Node] = set()
    changed = False
    for bucket in buckets:
        if len(bucket) > 1:
            changed |= merge_chains(PASS, graph, bucket, order, moved, packed=True) is not None
    return changed


@graph_pass(after=("fold_collective_scaling",))
def bucket_block_reduce_scatters(graph: Graph) -> bool:
    """Merge each ``data_parallel`` block's reduce-scatters (see the module docstring); True when
    the graph changed."""
    check_graph(PASS, graph)
    # a replica all-reduce is merged only as a marked reduce-scatter's follower
    marked = graph.find_nodes(op="call_function", target=REDUCE_SCATTER, sort=False)
    if all(block_of(n) is None for n in marked):
        return False
    found = chains(graph, PASS)
    groups: dict[tuple, list[Chain]] = {}
    for chain in found:
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
    replicas = _replica_chains(found)
    position = {chain.collective: i for i, chain in enumerate(found)}
    sinking: set[Node] = set()  # every block's, a block of one member's too, moved together
    late: set[Node] = set()
    replica_groups: dict[tuple, list[Chain]] = {}
    for bucket in groups.values():
        reached = _downstream(bucket, replicas)
        if reached is None:
            record(PASS, "skipped: a use of a result has side effects", bucket[0].collective)
            continue
        sinking |= reached[0]
        for replica in sorted(reached[1], key=lambda c: position[c.collective]):
            replica_groups.setdefault(_key(replica), []).append(replica)
            tail = _downstream([replica], replicas)
            assert tail is not None  # a part of the bucket's, which has no side effects
            late |= tail[0]
    changed = _sink_to_outputs(graph, sinking, late)
    changed |= _merge(graph, groups.values())
    # a merge rewires the reduce-scatters' results, where a replica chain may start
    rematched = ([match_chain(c.collective) for c in g] for g in replica_groups.values())
    return _merge(graph, ([c for c in g if c is not None] for g in rematched)) or changed
