"""schedule_collectives: issue every collective as early as its inputs allow, wait as late as
its uses allow.

Communication overlaps computation only between a collective and its wait. This pass widens
that window in the graph, for every functional collective (bucketed or not):

- each ``wait_tensor``, with the pure nodes computed from its result and from values the
  collective itself depended on (what decompresses, scales, reshapes, unpacks, dequantizes,
  sums or slices the result), moves to just before the first other node that needs them: a
  write-back, a collective, compute, the output; a node that also reads a graph input or
  another earlier value goes no further than the next node with side effects, which might
  write that value. A wait is therefore never earlier than the first real use of its result
  (in Inductor's schedule a wait placed early can hold back later collectives, not only its
  own users);
- each collective moves up to just after the last of its inputs, but never above the previous
  collective (the order of collectives stays the graph's, the same on every rank) nor above a
  node with side effects (a mutation might write what it reads). A ``data_parallel`` block's
  all-gather stays where it is: ``prefetch_block_all_gathers`` places those.

For two layers' gradients of a compiled DDP backward::

    before                                 after
    g1 = mm(...)                           g1 = mm(...)
    c1 = convert_element_type(g1, bf16)    c1 = convert_element_type(g1, bf16)
    r1 = all_reduce(c1, "avg", group)      r1 = all_reduce(c1, "avg", group)
    w1 = wait_tensor(r1)                   g2 = mm(...)                 # overlaps r1
    o1 = convert_element_type(w1, f32)     c2 = convert_element_type(g2, bf16)
    g2 = mm(...)                           r2 = all_reduce(c2, "avg", group)
    c2 = convert_element_type(g2, bf16)    w1 = wait_tensor(r1)
    r2 = all_reduce(c2, "avg", group)      o1 = convert_element_type(w1, f32)
    w2 = wait_tensor(r2)                   w2 = wait_tensor(r2)
    o2 = convert_element_type(w2, f32)     o2 = convert_element_type(w2, f32)
    copy_(grad1, o1); copy_(grad2, o2)     copy_(grad1, o1); copy_(grad2, o2)

Only collectives, waits and those pure nodes move, so values are unchanged; linear in the
graph's nodes, plus one walk of a collective's inputs where a node computed from its result
also reads another value. Inductor's scheduler reorders nodes again (its peak-memory ordering
puts each wait right after its collective); :func:`passes.install` therefore turns that
ordering off and turns on Inductor's own ``sink_waits`` scheduling pass, which keeps the waits
late.
"""

from __future__ import annotations

import heapq
from typing import cast

from torch.fx import Graph, Node

from ._graph import (
    ALL_GATHER,
    WAIT,
    ancestors,
    block_of,
    check_graph,
    is_collective,
    is_op,
    record,
)
from .interface import graph_pass

__all__ = ["schedule_collectives", "schedule_problems"]

PASS = "schedule_collectives"


def _is_wait(node: Node) -> bool:
    return is_op(node, (WAIT,)) and is_collective(node.args[0])


def _movable(graph: Graph) -> dict[Node, bool]:
    """The waits of collectives, and the pure nodes computed from their results and from values
    the collectives themselves depended on (what decompresses, unpacks, dequantizes, sums or
    slices a result); never a collective, a node with side effects or the output. Each maps to
    whether it reads such a value from outside (a graph input, a value before the collective).
    Defined by dependencies alone, not positions, so a scheduled graph yields the same set."""
    movable: dict[Node, set[Node]] = {}  # node -> the collectives it is computed from
    reads_outside: dict[Node, bool] = {}
    inputs_of: dict[Node, set[Node]] = {}  # collective -> everything it depends on
    known: dict = {}

    def ready(x: Node, collectives: set[Node]) -> bool:
        if x.op in ("placeholder", "get_attr") or not x.all_input_nodes:
            return True
        for c in collectives:
            if c not in inputs_of:
                inputs_of[c] = ancestors([c])
            if x in inputs_of[c]:
                return True
        return False

    for node in graph.nodes:
        if _is_wait(node):
            movable[node], reads_outside[node] = {node.args[0]}, False
            continue
        if node.op != "call_function" or is_collective(node) or _side_effects(node, known):
            continue
        inputs = node.all_input_nodes
        sources = set().union(*(movable[i] for i in inputs if i in movable))
        outside = [i for i in inputs if i not in movable]
        if sources and all(ready(i, sources) for i in outside):
            movable[node], reads_outside[node] = sources, bool(outside)
    return reads_outside


def _anchors(graph: Graph, movable: dict[Node, bool]) -> dict[Node, Node]:
    """Each movable node with users -> the first node outside ``movable`` that needs it
    (directly, or through movable nodes). A node that reads a value from outside the
    collective's results goes no further than the next node with side effects, which might
    write that value."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    known: dict = {}
    anchor: dict[Node, Node] = {}
    barrier: Node | None = None  # the first node with side effects after the current one
    for node in reversed(graph.nodes):
        if node in movable and node.users:
            needs = [anchor.get(u) if u in movable else u for u in node.users]
            if movable[node] and barrier is not None:
                needs.append(barrier)
            # a movable user that nothing reads keeps its place, and so do its inputs
            if all(n is not None for n in needs):
                anchor[node] = min(cast(list[Node], needs), key=order.__getitem__)
        if node not in movable and _side_effects(node, known):
            barrier = node
    return anchor


def _waits_last(group: list[Node]) -> list[Node]:
    """``group`` (in graph order) in an order that follows its dependencies and, of the nodes
    ready, takes a wait only when no other is: each result is used before the next wait."""
    index = {n: i for i, n in enumerate(group)}
    missing = {n: sum(i in index for i in n.all_input_nodes) for n in group}
    ready: list[tuple[bool, int]] = []
    for n in group:
        if not missing[n]:
            heapq.heappush(ready, (_is_wait(n), index[n]))
    out: list[Node] = []
    while ready:
        node = group[heapq.heappop(ready)[1]]
        out.append(node)
        for user in node.users:
            if user in index:
                missing[user] -= 1
                if not missing[user]:
                    heapq.heappush(ready, (_is_wait(user), index[user]))
    return out


def _sink_waits(graph: Graph) -> bool:
    nodes = list(graph.nodes)
    anchor = _anchors(graph, _movable(graph))
    held: dict[Node, list[Node]] = {}  # a fixed node -> the movable nodes to put right before it
    for node in nodes:
        if node in anchor:
            held.setdefault(anchor[node], []).append(node)
    # A movable input's anchor is never later than its user's: an input is in an earlier group,
    # or in the same one, which _waits_last orders.
    final: list[Node] = []
    for node in nodes:
        if node not in anchor:
            final.extend(_waits_last(held.get(node, [])))
            final.append(node)
    if final == nodes:
        return False
    for prev, n in zip(final, final[1:]):
        if prev.next is not n:
            prev.append(n)
    record(PASS, "waits moved to their first use")
    return True


def _side_effects(node: Node, known: dict) -> bool:
    """``node.is_impure()``, asked once per target (it depends only on the target here)."""
    if node.op != "call_function":
        return node.op not in ("placeholder", "get_attr") and node.is_impure()
    if node.target not in known:
        known[node.target] = node.is_impure()
    return known[node.target]


def _prefetched(node: Node) -> bool:
    """A data_parallel block's all-gather: prefetch_block_all_gathers places it, so that the
    gathered parameters alive at once stay bounded; it is not raised here."""
    return is_op(node, (ALL_GATHER,)) and block_of(node) is not None


def _raise_collectives(graph: Graph) -> bool:
    # Positions as (index in the graph before this step, number of collectives placed there):
    # a collective moved right after node X sorts between X and X's old successor.
    pos: dict[Node, tuple[int, int]] = {n: (i, 0) for i, n in enumerate(graph.nodes)}
    barrier = None  # the latest collective or node with side effects
    known: dict = {}
    moved = 0
    for node in list(graph.nodes):
        if _prefetched(node):
            barrier = node  # prefetch_block_all_gathers places it
        elif is_collective(node):
            anchor = max(
                node.all_input_nodes + ([barrier] if barrier is not None else []),
                key=pos.__getitem__,
                default=None,
            )
            if anchor is not None and anchor is not node.prev and pos[anchor] < pos[node]:
                anchor.append(node)
                pos[node] = (pos[anchor][0], pos[anchor][1] + 1)
                moved += 1
                record(PASS, "collective issued right after its inputs", node)
            barrier = node
        elif _side_effects(node, known):
            barrier = node
    return moved > 0


def schedule_problems(graph: Graph) -> list[str]:
    """What in ``graph`` breaks the schedule this pass makes: a wait (or a node computed from
    its result) with an unrelated node between it and the first node that needs it, or a
    collective that could be issued earlier. Empty for a graph this pass has scheduled (the
    randomized pass test checks every pipeline's output with it)."""
    problems = []
    anchor = _anchors(graph, _movable(graph))
    for node, first in anchor.items():
        if not _is_wait(node):
            continue
        between = node.next
        while between is not first:
            if anchor.get(between) is not first:
                problems.append(
                    f"{node.name} waits before {between.name}, which does not use its result"
                )
                break
            between = between.next
    barrier: Node | None = None
    known: dict = {}
    for node in graph.nodes:
        if _prefetched(node):
            barrier = node
        elif is_collective(node):
            if node.prev not in node.all_input_nodes and node.prev is not barrier:
                problems.append(f"{node.name} could be issued before {node.prev.name}")
            barrier = node
        elif _side_effects(node, known):
            barrier = node
    return problems


@graph_pass(
    after=(
        "fuse_collective_casts",
        "bucket_low_rank_factors",
        "bucket_block_all_gathers",
        "bucket_block_reduce_scatters",
        "bucket_quantized_collectives",
        "interleave_zero_broadcasts",
    )
)
def schedule_collectives(graph: Graph) -> bool:
    """Move waits late and collectives early (see the module docstring). True when the graph
    changed."""
    check_graph(PASS, graph)
    sunk = _sink_waits(graph)
    return _raise_collectives(graph) or sunk
