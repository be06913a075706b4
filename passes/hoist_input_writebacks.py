"""hoist_input_writebacks: a graph input's new value is written where it is computed.

AOTAutograd gives a graph that updates an input in place (a state tensor of a hook, an
optimizer's state, BatchNorm's running statistics) a ``copy_`` epilogue: the new value is
computed where the program computed it, held in a buffer of its own, and copied into the input
at the end of the graph. Where a collective stands between the two, Inductor keeps the value
in that buffer and writes the input from a later kernel, which reads the buffer back
(``tests/passes/test_hoist_input_writebacks.py`` reads it in the generated code). The pass
moves each write-back to just after its value, so the kernel that computes the value stores
into the input::

    before                                   after
    x = add(grad, e)                         x = add(grad, e)
    r = sub(x, round(x))                     r = sub(x, round(x))
    a = all_reduce(x, "sum", group)          copy_(e, r)
    w = wait_tensor(a)                       a = all_reduce(x, "sum", group)
    ...                                      w = wait_tensor(a)
    copy_(e, r)                              ...

A write-back ``copy_(e, r)`` (``e`` a graph input, the copy's result unused) moves when every
other reader of ``e``, and of every view of ``e``, comes before ``r``: from ``r`` on nothing
expects the old value. A reader whose aliasing the pass cannot tell (a call that is not an
ATen overload) or the graph's output keeps the write-back where it is. AOTAutograd never gives
two graph inputs that alias where one is mutated (it merges them into one synthetic base), so
``e``'s views are the only aliases. Values are the same: ``e`` holds its new value from its
last read on, as at the end. Collectives, their order and their arguments do not change.
Idempotent. Run last: the passes before it reorder nodes, and a write-back must stay after its
value.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

from .core.interface import graph_pass
from .core.marks import check_graph
from .core.ops import aten
from .core.record import record
from .core.traversal import aliases

__all__ = ["hoist_input_writebacks"]

PASS = "hoist_input_writebacks"
COPY = aten.copy_.default


def _read_after(target: Node, writeback: Node, value: Node) -> bool:
    """Whether a reader of ``target`` or of a view of it, other than ``writeback``, comes after
    ``value``, or is a call whose aliasing is unknown (then True: the write-back stays)."""
    return any(
        user is not writeback
        and (
            user.op != "call_function"
            or user > value  # FX orders a graph's nodes by their place in it
            or not (
                user.target is operator.getitem or isinstance(user.target, torch._ops.OpOverload)
            )
        )
        for alias in aliases(target)
        for user in alias.users
    )


@graph_pass(
    after=(
        "sink_quantized_receives",
        "schedule_collectives",
        "prefetch_block_all_gathers",
        "reinplace_broadcasts",
        "all_gather_as_all_to_all",
        "reduce_scatter_as_all_to_all",
    )
)
def hoist_input_writebacks(graph: Graph) -> bool:
    """Move each graph input's ``copy_`` write-back to just after the value it writes, where
    nothing later reads the input (see the module docstring). Returns True when the graph
    changed."""
    check_graph(PASS, graph)
    changed = False
    for node in graph.find_nodes(op="call_function", target=COPY):
        target, value = node.args[0], node.args[1]
        if not (isinstance(target, Node) and target.op == "placeholder") or node.users:
            continue
        if not isinstance(value, Node) or value.op != "call_function" or value.next is node:
            continue
        if _read_after(target, node, value):
            record(PASS, "skipped: the input is read after its new value", node)
            continue
        value.append(node)
        record(PASS, "write-back moved to its value", node)
        changed = True
    return changed
