"""bucket_block_all_gathers: one all-gather per ``data_parallel`` block, its copies in and out
one opaque call each.

``compiled_hooks.fsdp.data_parallel`` gathers every parameter on its own and marks each
all-gather with its block (``node.meta["custom"]["data_parallel_block"]``). This pass merges the
all-gathers of one block (same group, wire dtype and device) into one, in forward and in the
backward's re-gather. Every member's input ops (the slice of the flat shard, the cast to
``param_dtype``, the padding: the nodes that feed only that all-gather) move next to the
bucket's ``bucket_pack``; every member's result is its rank-major piece of the bucket's output,
a dense tensor that ``bucket_unpack`` copies out (:mod:`compiled_hooks.bucket_copies`: one ATen
call each way, which Inductor neither fuses nor compiles, so a model's blocks add no kernels)::

    before                                      after
    c1 = convert_element_type(p1, bf16)         c1 = convert_element_type(p1, bf16)
    a1 = all_gather_into_tensor(c1, N, g)       c2 = convert_element_type(p2, bf16)
    w1 = wait_tensor(a1)                        flat = bucket_pack([c1, c2], 1)
    s1 = slice(w1, 0, 0, R1)                    a = all_gather_into_tensor(flat, N, g)
    ... block compute using s1 ...              w = wait_tensor(a)
    c2 = convert_element_type(p2, bf16)         pieces = bucket_unpack(w, N, [n1, n2])
    a2 = all_gather_into_tensor(c2, N, g)       w1 = reshape(pieces[0], [N * r1, d1])
    w2 = wait_tensor(a2)                        w2 = reshape(pieces[1], [N * r2])
    s2 = slice(w2, 0, 0, R2)                    s1 = slice(w1, 0, 0, R1)
                                                ... block compute using s1, then s2 ...

The bucket goes out where its first member did (its members' inputs depend only on the
parameters, which are ready from the start) and is waited right before the first use of any
member's result. An input computed later that is a view or a cast of ready values (a shard's
view that backward also saves) moves up to the bucket; members with any other input not ready
there are left alone (and counted). The order of buckets is the graph's, the same on every
rank; the sizes come from the padded shards, which are equal on every rank. Idempotent: a block
holds one all-gather after it.
"""

from __future__ import annotations

import operator
from typing import Any

from torch.fx import Graph, Node

from .core.interface import graph_pass
from .core.marks import block_of, calls, check_graph, is_op
from .core.ops import ALL_GATHER, BUCKET_PACK, BUCKET_UNPACK, CAST_OPS, VIEW_OPS, WAIT, aten, val
from .core.record import record
from .core.traversal import input_cone
from .core.values import new_node

__all__ = ["bucket_block_all_gathers"]

PASS = "bucket_block_all_gathers"


def _key(ag: Node) -> tuple[Any, ...]:
    x, size, group = ag.args
    return (block_of(ag), group, size, val(x).dtype, val(x).device)


def _candidates(graph: Graph) -> dict[tuple, list[Node]]:
    groups: dict[tuple, list[Node]] = {}
    for node in calls(graph, (ALL_GATHER,)):
        if block_of(node) is None:
            continue
        if len(node.users) != 1 or not is_op(next(iter(node.users)), (WAIT,)):
            record(PASS, "skipped: not a single-wait all_gather", node)
            continue
        if not isinstance(node.args[2], str) or val(node) is None:
            record(PASS, "skipped: group passed as a graph input or no fake-tensor metadata", node)
            continue
        groups.setdefault(_key(node), []).append(node)
    return {k: v for k, v in groups.items() if len(v) > 1}


def _hoistable(external: list[Node], order: dict[Node, int], at: Node) -> list[Node] | None:
    """The members' inputs computed after ``at`` (None when one cannot move before it).

    Such an input moves up when it is a view or a cast of values ready at ``at`` (or of other
    such inputs): pure, so computing it earlier changes nothing but when its output exists. The
    partitioner leaves these where a shard's view or cast is also saved for backward, and so
    has a user besides the all-gather."""
    late = sorted({i for i in external if order[i] >= order[at]}, key=order.__getitem__)
    moved: set[Node] = set()
    for node in late:
        inputs_ready = all(order[i] < order[at] or i in moved for i in node.all_input_nodes)
        if not (is_op(node, VIEW_OPS + CAST_OPS) and inputs_ready):
            return None
        moved.add(node)
    return late


def _merge(graph: Graph, members: list[Node], order: dict[Node, int]) -> bool:
    cones = {ag: input_cone(ag) for ag in members}
    inside = {n for cone in cones.values() for n in cone}
    external = [
        i for ag in members for n in cones[ag] + [ag] for i in n.all_input_nodes if i not in inside
    ]
    waits = [next(iter(ag.users)) for ag in members]
    users = [u for w in waits for u in w.users]
    first_use = min(users, key=order.__getitem__)
    at = members[0]
    late = _hoistable(external, order, at)
    if late is None:
        record(
            PASS,
            "skipped bucket: a member's input is not ready where the first member goes out",
            at,
        )
        return False
    for n in sorted([*late, *inside], key=order.__getitem__):
        at.prepend(n)
    size, group = at.args[1], at.args[2]
    with graph.inserting_before(at):
        flat = new_node(graph, BUCKET_PACK, ([ag.args[0] for ag in members], 1), name="bucket_pack")
        coll = new_node(graph, ALL_GATHER, (flat, size, group), name="bucket_all_gather")
        coll.meta["custom"] = dict(at.meta.get("custom", {}))
    widths = [val(ag.args[0]).numel() for ag in members]
    with graph.inserting_before(first_use):
        wait = new_node(graph, WAIT, (coll,), name="bucket_wait")
        pieces = new_node(graph, BUCKET_UNPACK, (wait, size, widths), name="bucket_pieces")
        for i, (ag, old_wait) in enumerate(zip(members, waits)):
            piece = graph.call_function(operator.getitem, (pieces, i))
            piece.meta["val"] = val(pieces)[i]
            full = new_node(graph, aten.reshape.default, (piece, list(val(ag).shape)))
            old_wait.replace_all_uses_with(full)
    for ag, old_wait in zip(members, waits):
        graph.erase_node(old_wait)
        graph.erase_node(ag)
    record(PASS, f"bucketed {len(members)} all_gathers into one", coll)
    return True


@graph_pass()
def bucket_block_all_gathers(graph: Graph) -> bool:
    """Merge each ``data_parallel`` block's all-gathers (see the module docstring); True when the
    graph changed."""
    check_graph(PASS, graph)
    groups = _candidates(graph)
    changed = False
    for members in groups.values():
        order = {n: i for i, n in enumerate(graph.nodes)}
        changed |= _merge(graph, members, order)
    return changed
