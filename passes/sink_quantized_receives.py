"""sink_quantized_receives: the receive side of an int8 collective waits until nothing left to
compute needs it.

``int8_compress_hook`` (:mod:`compiled_hooks.int8.hook`) writes each gradient's whole round
trip where the hook is called, in the middle of a compiled backward: quantize, all-to-all,
then at once its wait, the dequantize and sum, the shard's re-quantization and the all-gather.
The wait blocks the backward on the wire, and ``schedule_collectives`` cannot sink it: its first
use, the dequantize, follows it at once. This pass moves each int8 collective's wait and
everything that depends on it down, in graph order, to just before the first node that must stay
after them, so the rest of the backward runs while the rows are on the wire. It walks twice:
first the all-to-alls' receive sides, each with its all-gather; then each all-gather's receive
(its wait and the dequantize of the gathered rows), below the later receive sides, so that one
bucket's all-gather is on the wire while the next bucket's rows are summed and re-quantized::

    before                                     after
    g1 = mm(...)                               g1 = mm(...)
    a1 = all_to_all(pack(quantize(g1)))        a1 = all_to_all(pack(quantize(g1)))
    w1 = wait_tensor(a1)                       g2 = mm(...)                 # a1 on the wire
    s1 = quantize(sum(dequantize(w1)))         a2 = all_to_all(pack(quantize(g2)))
    b1 = all_gather(pack(s1))                  w1 = wait_tensor(a1)
    v1 = dequantize(wait_tensor(b1))           s1 = quantize(sum(dequantize(w1)))
    g2 = mm(...)                               b1 = all_gather(pack(s1))    # a2 on the wire
    a2 = all_to_all(pack(quantize(g2)))        w2 = wait_tensor(a2)
    w2 = wait_tensor(a2)                       s2 = quantize(sum(dequantize(w2)))  # b1 too
    s2 = quantize(sum(dequantize(w2)))         b2 = all_gather(pack(s2))
    ...                                        v1 = dequantize(wait_tensor(b1))
    copy_(grad1, v1)                           ...
    return ...                                 copy_(grad1, v1)

What moves: the waits of int8 collectives (``graph_contract.INT8``, outside a
``data_parallel`` block, whose own passes place its collectives) and the nodes that depend on
them, while each is pure, or a functional collective or its wait (the residuals the hook
updates are graph inputs, written back at the graph's end: ``graph_contract``). What they move
past: pure nodes, and our own parallelism's collectives and waits. Anything else stops them: a
write (such as a residual's write-back), another side effect, another parallelism's collective,
or a dependent that cannot move. Values are the same; every node keeps its inputs, and nodes
that move keep their order. Collective order changes, the same
on every rank (it is a function of the graph). Idempotent: a second run finds every receive
side already at its stop.
"""

from __future__ import annotations

from torch.fx import Graph, Node

from .core.interface import graph_pass
from .core.marks import block_of, calls, check_graph, is_collective, is_op, is_quantized
from .core.ops import ALL_GATHER, ALL_TO_ALL, WAIT
from .core.record import record
from .core.traversal import mutates

__all__ = ["sink_quantized_receives"]

PASS = "sink_quantized_receives"


def _starts(graph: Graph, kind: object) -> set[Node]:
    """The waits of the int8 collectives of ``kind`` outside any data_parallel block."""
    return {
        next(iter(n.users))
        for n in calls(graph, (kind,))
        if is_quantized(n)
        and block_of(n) is None
        and len(n.users) == 1
        and is_op(next(iter(n.users)), (WAIT,))
    }


def _unordered(node: Node) -> bool:
    """A call the receive side may move across, either way: a pure one, or this parallelism's
    collective or wait."""
    if is_op(node, (WAIT,)) or is_collective(node):
        return True
    return not mutates(node) and not node.is_impure()


def _may_pass(node: Node) -> bool:
    """A node the moving ones may go below: it neither writes what they read nor orders a side
    effect with theirs."""
    if node.op in ("placeholder", "get_attr"):
        return True
    return node.op == "call_function" and _unordered(node)


@graph_pass(after=("bucket_quantized_collectives",))
def sink_quantized_receives(graph: Graph) -> bool:
    """Move the receive side of every int8 collective down to its first stop (see the module
    docstring): the all-to-alls' first, their all-gathers with them, then the all-gathers'
    below the later receive sides. Two walks over the graph. Returns True when the graph
    changed."""
    check_graph(PASS, graph)
    changed = _sink(graph, _starts(graph, ALL_TO_ALL))
    return _sink(graph, _starts(graph, ALL_GATHER)) or changed


def _sink(graph: Graph, starts: set[Node]) -> bool:
    """Move ``starts`` and what depends on them down to their first stop, in one walk."""
    if not starts:
        return False
    held: dict[Node, None] = {}  # the nodes on their way down, in graph order
    passed = False  # whether a node stays above them since the walk began holding
    changed = False
    for node in list(graph.nodes):
        depends = node in starts or any(i in held for i in node.all_input_nodes)
        if depends and node.op == "call_function" and _unordered(node):
            held[node] = None
            continue
        if not held or (not depends and _may_pass(node)):
            passed |= bool(held)
            continue
        if passed:  # the stop: what is held goes right before it
            for h in held:
                node.prepend(h)
            record(PASS, f"moved an int8 receive side of {len(held)} nodes down", node)
            changed = True
        held, passed = {}, False
    return changed
