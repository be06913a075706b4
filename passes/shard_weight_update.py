"""Cross-replica weight-update sharding: all_reduce + own-slice read and N owner broadcasts
become reduce_scatter + all_gather (half the bytes on the wire).

The ZeRO step with ``shard_buckets=True`` (:mod:`compiled_hooks.zero`) reduces a padded flat
gradient of ``N * c`` elements, reads only this rank's slice of it, updates that slice, and
rebuilds the parameter from every owner's broadcast. Two independent rewrites, each exact on
its own:

1. *own slice of an all_reduce*: ``index(view(end, [N, c]), [group_rank(G)])`` where ``end``
   is an all_reduce over ``G`` (``N`` ranks, sum or avg, on a flat ``N * c`` buffer) followed
   only by the hook's elementwise scale and cast ops and reshapes, and nothing else reads the
   all_reduce::

       ar = all_reduce(x, 'sum', G); w = wait(ar); d = div(w, 2)       rs = reduce_scatter(x, 'sum', N, G)
       v = view(d, [N, c]); mine = index(v, [group_rank(G)])     ->    w = wait(rs); d = div(w, 2)
                                                                       mine = view(d, [1, c])

   ``group_rank`` (``torch.ops.compiled_hooks.group_rank``) is what proves the index is this
   rank: an arbitrary index input would not, and is left alone.
2. *owner broadcasts*: ``cat([wait(broadcast(y, 0, G)), ..., wait(broadcast(y, N-1, G))])``
   of one tensor ``y`` from every rank of ``G`` in rank order is ``all_gather(y)``::

       b0 = broadcast(y, 0, G); b1 = broadcast(y, 1, G)               ag = all_gather_into_tensor(y, N, G)
       full = cat([wait(b0), wait(b1)])                          ->    full = wait(ag)

The reduce_scatter sums each element over the same ranks as the all_reduce did (bit for bit
on 2 ranks; a backend may order a larger sum differently, within rounding); the all_gather
moves the same bytes. Opt-in: add it to a :class:`passes.Pipeline`; it rewrites only groups
whose backend is in ``shard_backends`` (default NCCL and the fake test backend, see
``SHARD_BACKENDS``) and counts why it left another alone.
"""

from __future__ import annotations

from typing import Collection

from torch.fx import Graph, Node

from ._graph import (
    ALL_GATHER, ALL_REDUCE, BROADCAST, CAST_OPS, GROUP_RANK, REDUCE_SCATTER, VIEW_OPS, WAIT, aten, check_graph,
    group_info, is_op, is_scale, match_chain, new_node, reapply, record, val,
)

PASS = "shard_weight_update"
# Backends on which the rewrite pays: NCCL's reduce_scatter and all_gather each move half the
# bytes of an all_reduce. "fake" is the test backend. On gloo a reduce_scatter costs at least
# as much as the all_reduce (docs/benchmarks.md), so gloo graphs are left alone unless asked for
# (all_to_all_weight_update makes the same exchange there out of chunked all_to_all).
SHARD_BACKENDS = frozenset({"nccl", "fake"})
_WHY_NOT = {"gloo": "its reduce_scatter costs more than its all_reduce; all_to_all_weight_update covers gloo, "
                    "or pass shard_backends to force"}


def own_slice(index: Node):
    """(chain, N) when ``index`` reads this rank's slice of an all_reduce (rewrite 1)."""
    if not is_op(index, (aten.index.Tensor,)) or len(index.args) != 2:
        return None
    view, indices = index.args
    if not (isinstance(indices, (list, tuple)) and len(indices) == 1 and is_op(indices[0], (GROUP_RANK,))):
        return None
    if not is_op(view, VIEW_OPS) or len(view.users) != 1:
        return None
    node = view.args[0]
    while not is_op(node, (WAIT,)):  # walk back over the hook's elementwise ops and reshapes
        if not (is_scale(node) or is_op(node, CAST_OPS + VIEW_OPS)) or len(node.users) != 1:
            return None
        node = node.args[0]
    chain = match_chain(node.args[0])
    # the chain runs wait -> scales/casts/reshapes -> this view; nothing else reads the all_reduce
    if chain is None or chain.problem or not is_op(chain.collective, (ALL_REDUCE,)) or chain.end is not view:
        return None
    info = group_info(chain.group_name)
    shape = list(val(view).shape)
    flat = val(chain.collective.args[0])
    if (info is None or indices[0].args[0] != chain.group_name or chain.reduce_op not in ("sum", "avg")
            or len(shape) != 2 or shape[0] != info.size or flat.dim() != 1 or flat.numel() != shape[0] * shape[1]):
        return None
    return chain, info


def _rewrite_own_slice(graph: Graph, index: Node, chain, n: int) -> None:
    with graph.inserting_before(chain.collective):
        rs = new_node(graph, REDUCE_SCATTER, (chain.collective.args[0], chain.reduce_op, n, chain.group_name))
    with graph.inserting_before(chain.wait):
        value = new_node(graph, WAIT, (rs,))
    with graph.inserting_before(index):
        value = reapply(graph, value, chain.post)  # the scales and casts, on the slice (elementwise: they commute)
        mine = new_node(graph, aten.view.default, (value, list(val(index).shape)))
    index.replace_all_uses_with(mine)
    for dead in [index, *reversed(chain.post), chain.wait, chain.collective]:
        graph.erase_node(dead)


def owner_broadcasts(cat: Node):
    """The N broadcasts when ``cat`` concatenates one tensor from every rank (rewrite 2)."""
    if not is_op(cat, (aten.cat.default,)) or not isinstance(cat.args[0], (list, tuple)):
        return None
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    waits = list(cat.args[0])
    if not waits or dim not in (0, -val(waits[0]).dim()):
        return None
    broadcasts = []
    for src, w in enumerate(waits):
        if not is_op(w, (WAIT,)) or len(w.users) != 1:
            return None
        b = w.args[0]
        if not is_op(b, (BROADCAST,)) or len(b.users) != 1 or b.args[1] != src:
            return None
        broadcasts.append(b)
    y, group = broadcasts[0].args[0], broadcasts[0].args[2]
    info = group_info(group)
    if info is None or info.size != len(waits) or any(b.args[0] is not y or b.args[2] != group for b in broadcasts):
        return None
    return broadcasts, info


def _rewrite_owner_broadcasts(graph: Graph, cat: Node, broadcasts: list[Node]) -> None:
    y, _, group = broadcasts[0].args
    with graph.inserting_before(broadcasts[0]):
        ag = new_node(graph, ALL_GATHER, (y, len(broadcasts), group))
    with graph.inserting_before(cat):
        full = new_node(graph, WAIT, (ag,))
    cat.replace_all_uses_with(full)
    graph.erase_node(cat)
    for b in broadcasts:
        graph.erase_node(next(iter(b.users)))
        graph.erase_node(b)


def weight_update_matches(graph: Graph, pass_name: str, backends: Collection[str], why_not: dict[str, str]):
    """The two patterns above in ``graph``, on groups whose backend is in ``backends``:
    ``(node, own-slice chain or None, owner broadcasts or None, group size)`` per match, in
    graph order; a match on another backend is counted with ``why_not``'s reason. A rewrite
    made while iterating may erase only nodes before ``node``."""
    for node in list(graph.nodes):
        own = own_slice(node)
        found = own or owner_broadcasts(node)
        if found is None:
            continue
        info = found[1]
        if info.backend not in backends:
            reason = why_not.get(info.backend, f"not in {pass_name}'s backends")
            record(pass_name, f"skipped: backend {info.backend} ({reason})", node)
            continue
        yield node, (own[0] if own else None), (None if own else found[0]), info.size


def shard_weight_update(graph: Graph, shard_backends: Collection[str] = SHARD_BACKENDS) -> bool:
    """Rewrite own-slice all_reduces to reduce_scatter and owner broadcasts to all_gather (see
    the module docstring) on groups whose backend is in ``shard_backends``; True if anything
    changed. A match on another backend is left alone and counted with the reason."""
    check_graph(PASS, graph)
    changed = False
    for node, chain, broadcasts, n in weight_update_matches(graph, PASS, shard_backends, _WHY_NOT):
        if chain is not None:
            _rewrite_own_slice(graph, node, chain, n)
            record(PASS, "all_reduce read in own slice -> reduce_scatter", node)
        else:
            _rewrite_owner_broadcasts(graph, node, broadcasts)
            record(PASS, "owner broadcasts -> all_gather", node)
        changed = True
    return changed
