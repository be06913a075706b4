"""reinplace_broadcasts: a broadcast of a freshly packed bucket runs in place on it.

Inductor lowers a functional ``broadcast(x)`` as ``broadcast_(clone(x))``: its own reinplacing
pass turns ``all_reduce`` into ``all_reduce_`` when the input is dead afterwards, but not
``broadcast``. The ZeRO hooks broadcast each owner's new parameter values packed with a
``cat``, so without this pass every step copies each bucket once more into a fresh buffer
before sending it. When ``x`` is a ``cat`` read
by nothing but the broadcast, mutating it is invisible, and the pass says so to Inductor::

    before                                   after
    x = cat([u1, u2])                        x = cat([u1, u2])
    b = broadcast(x, 0, group)               b = broadcast_(x, 0, group)
    w = wait_tensor(b)                       w = wait_tensor(b)

Anything else (an input read elsewhere, a graph input or a view, which may alias memory the
program reads later) is left alone. Values are the same: ``broadcast_`` writes the source's
values into ``x`` and returns it, as ``broadcast`` returns them in a new tensor. Collective
order and arguments do not change. Idempotent: a ``broadcast_`` is not a ``broadcast``. Run
last: other passes match the functional op.
"""

from __future__ import annotations

from torch.fx import Graph

from .core.interface import graph_pass
from .core.marks import check_graph, is_op
from .core.ops import BROADCAST, BROADCAST_, aten, val
from .core.record import record

__all__ = ["reinplace_broadcasts"]

PASS = "reinplace_broadcasts"


@graph_pass(after=("interleave_zero_broadcasts", "shard_weight_update", "all_to_all_weight_update"))
def reinplace_broadcasts(graph: Graph) -> bool:
    """Turn ``broadcast(cat(...))`` into ``broadcast_`` on the cat where nothing else reads it
    (see the module docstring). Returns True when the graph changed."""
    check_graph(PASS, graph)
    changed = False
    for node in graph.find_nodes(op="call_function", target=BROADCAST):
        x = node.args[0]
        if not is_op(x, (aten.cat.default,)):
            continue
        if len(x.users) != 1:
            record(PASS, "skipped: the broadcast's input has another user", node)
            continue
        node.target = BROADCAST_
        node.meta["val"] = val(x)  # the op returns its input
        record(PASS, "broadcast in place on its packed input", node)
        changed = True
    return changed
