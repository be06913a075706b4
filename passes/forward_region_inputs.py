"""forward_region_inputs: a region's backward reads the region's inputs from the outer graph,
not from what its forward passed through, so the partitioner decides alone what to keep.

A joint-graph pass (Inductor's ``joint_custom_pre_pass``, on the outer joint graph after
AOTAutograd has partitioned each ``invoke_subgraph`` region). A partitioned region's forward
returns what its backward needs, inputs and views of inputs included: ``data_parallel``'s
gathered parameters, when its blocks run as regions (:mod:`compiled_hooks.fsdp.regions`). The
backward then reads them from the forward's outputs, which the outer partitioner must save,
whatever the gather's checkpoint policy says; with ``reshard_after_forward`` every gathered
parameter would live from forward to backward. The pass points each such read at the region's
input instead, rebuilding the views in the outer graph with the input's checkpoint tags, so a
resharding gather is recomputed (gathered again) in backward and a kept one saved::

    before                                        after
    w = wait(all_gather(f))   # MUST_RECOMPUTE    w = wait(all_gather(f))   # MUST_RECOMPUTE
    o = invoke_subgraph(fw, w, x)                 o = invoke_subgraph(fw, w, x)
    # fw returns (y, t(w), ...)                   wt = t(w)                 # MUST_RECOMPUTE
    g = invoke_subgraph(bw, o[1], ..., dy)        g = invoke_subgraph(bw, wt, ..., dy)

A forward output is rebuilt only when it is a chain of ATen view ops from one of the forward's
inputs; anything else stays a saved output. A chain that ends where it started (the same sizes,
strides and offset as the input, as ``t(t(w))``) is the input itself and rebuilds to no node.
Values are the same: a view of the same input. Idempotent (a rebuilt read is no longer a
forward output).
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

__all__ = ["forward_region_inputs"]

HOP = torch.ops.higher_order.invoke_subgraph
TAGS = ("recompute", "ac_graph_id")  # what the partitioner reads of a checkpointed node


def _same_view(a: object, b: object) -> bool:
    """``a`` and ``b`` are fake tensors that view their storage alike, provably."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    return a.dtype == b.dtype and all(
        statically_known_true(sym_eq(x, y))
        for x, y in [
            (a.shape, b.shape),
            (a.stride(), b.stride()),
            (a.storage_offset(), b.storage_offset()),
        ]
    )


def _view_chain(out: Node) -> tuple[int, list[Node]] | None:
    """``(input index, views from that input to out)`` when ``out`` is a chain of ATen view
    ops from a placeholder of its graph, no views where the chain ends where it started; None
    otherwise."""
    chain: list[Node] = []
    node = out
    while node.op == "call_function":
        target = node.target
        if not (isinstance(target, torch._ops.OpOverload) and target.is_view):
            return None
        if not node.args or not isinstance(node.args[0], Node):
            return None
        if any(isinstance(a, Node) for a in [*node.args[1:], *node.kwargs.values()]):
            return None
        chain.append(node)
        node = node.args[0]
    if node.op != "placeholder":
        return None
    if _same_view(out.meta.get("val"), node.meta.get("val")):
        chain = []
    return node.graph.find_nodes(op="placeholder").index(node), chain[::-1]


def _subgraph(graph: Graph, hop: Node) -> GraphModule | None:
    owner, attr = graph.owning_module, hop.args[0]
    if owner is None or not isinstance(attr, Node) or attr.op != "get_attr":
        return None
    sub = getattr(owner, str(attr.target), None)
    return sub if isinstance(sub, GraphModule) else None


def forward_region_inputs(graph: Graph) -> bool:
    """Point backward regions' reads of forward pass-throughs at the inputs (see the module
    docstring). True when the graph changed."""
    changed = False
    for bw in list(graph.find_nodes(op="call_function", target=HOP)):
        for read in dict.fromkeys(a for a in bw.args[2:] if isinstance(a, Node)):
            if read.target is not operator.getitem:
                continue
            fw, index = read.args
            if not (isinstance(fw, Node) and fw.target is HOP and isinstance(index, int)):
                continue
            sub = _subgraph(graph, fw)
            if sub is None:
                continue
            outputs = sub.graph.find_nodes(op="output")[0].args[0]
            found = _view_chain(outputs[index])
            if found is None:
                continue
            position, chain = found
            value = fw.args[2 + position]
            if not isinstance(value, Node):
                continue
            with graph.inserting_before(bw):
                for view in chain:
                    target = view.target
                    assert callable(target), "an ATen view op (_view_chain)"
                    value = graph.call_function(target, (value, *view.args[1:]), view.kwargs)
                    value.meta["val"] = view.meta.get("val")
                    base = fw.args[2 + position]
                    assert isinstance(base, Node)
                    value.meta.update({t: base.meta[t] for t in TAGS if t in base.meta})
            bw.replace_input_with(read, value)
            if not read.users:
                graph.erase_node(read)
            changed = True
    return changed
