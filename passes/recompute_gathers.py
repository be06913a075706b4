"""recompute_gathers: ``data_parallel``'s gathers, traced under no checkpoint, get the recompute
tags their policy asks for, so the partitioner recomputes (gathers again in backward) a
resharded parameter and saves a kept one.

A joint-graph pass (Inductor's ``joint_custom_pre_pass``, before the partitioner). Inside
``compiled_hooks.graph_contract.compile_blocks_once``, which ``passes.install()`` turns on, a
traced gather is not wrapped in a selective activation checkpoint: its nodes carry
``meta["custom"][RESHARD]``, the gather's ``reshard`` (``compiled_hooks.fsdp.gather``). The pass
tags every forward node so marked as the checkpoint's policy would (``True``: MUST_RECOMPUTE,
``False``: MUST_SAVE); backward nodes (those that read a tangent) keep no tag::

    before                                     after
    w = wait(all_gather(f))  # RESHARD: True   w = wait(all_gather(f))  # MUST_RECOMPUTE, id n
    y = mm(x, w)                               y = mm(x, w)
    ...                                        ...
    g = reduce_scatter(...)  # RESHARD: True   g = reduce_scatter(...)  # (backward: no tag)

The tags replace any a user's checkpoint around the gather gave. Their ``ac_graph_id`` is one
past every id in the graph: the partitioner saves a recomputed node whose user is recomputed in
a later checkpoint region, and a gathered parameter that a user's checkpointed block reads must
not be saved. Idempotent (the tags are set, not added).
"""

from __future__ import annotations

from torch.fx import Graph, Node
from torch.utils.checkpoint import CheckpointPolicy

from compiled_hooks.graph_contract import RESHARD

from .core.traversal import dependents

__all__ = ["recompute_gathers"]


def _policy(node: Node) -> bool | None:
    custom = node.meta.get("custom")
    return custom.get(RESHARD) if isinstance(custom, dict) else None


def recompute_gathers(graph: Graph) -> bool:
    """Tag the forward nodes of the marked gathers (see the module docstring). True when a node
    was marked."""
    marked = {n: reshard for n in graph.nodes if (reshard := _policy(n)) is not None}
    if not marked:
        return False
    tangents = [
        n for n in graph.find_nodes(op="placeholder") if str(n.target).startswith("tangents")
    ]
    backward = dependents(tangents)  # the nodes that read a tangent, directly or not
    others = (n for n in graph.nodes if n not in marked)
    graph_id = 1 + max((n.meta.get("ac_graph_id", 0) for n in others), default=0)
    for node, reshard in marked.items():
        if node in backward:
            continue
        node.meta["recompute"] = (
            CheckpointPolicy.MUST_RECOMPUTE if reshard else CheckpointPolicy.MUST_SAVE
        )
        node.meta["ac_graph_id"] = graph_id
    return True
