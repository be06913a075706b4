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

       ar = all_reduce(x, 'sum', G); w = wait(ar); d = div(w, 2)
       v = view(d, [N, c]); mine = index(v, [group_rank(G)])
           ->
       rs = reduce_scatter(x, 'sum', N, G)
       w = wait(rs); d = div(w, 2)
       mine = view(d, [1, c])

   ``group_rank`` (``torch.ops.compiled_hooks.group_rank``) is what proves the index is this
   rank: an arbitrary index input would not, and is left alone.
2. *owner broadcasts*: ``cat([wait(broadcast(y, 0, G)), ..., wait(broadcast(y, N-1, G))])``
   of one tensor ``y`` from every rank of ``G`` in rank order is ``all_gather(y)``::

       b0 = broadcast(y, 0, G); b1 = broadcast(y, 1, G)   ->   ag = all_gather_into_tensor(y, N, G)
       full = cat([wait(b0), wait(b1)])                        full = wait(ag)

The reduce_scatter sums each element over the same ranks as the all_reduce did (bit for bit
on 2 ranks; a backend may order a larger sum differently, within rounding); the all_gather
moves the same bytes. Opt-in: add it to a :class:`passes.Pipeline`; it rewrites only groups
whose backend is in ``shard_backends`` (default NCCL and the fake test backend, see
``SHARD_BACKENDS``) and counts why it left another alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from torch.fx import Graph, Node

from .core.interface import graph_pass
from .core.marks import check_graph
from .core.ops import ALL_GATHER, REDUCE_SCATTER, WAIT, aten, val
from .core.record import record
from .core.values import new_node, reapply
from .core.weight_update import weight_update_matches

__all__ = ["shard_weight_update", "Options", "SHARD_BACKENDS"]

PASS = "shard_weight_update"
# Backends on which the rewrite pays: NCCL's reduce_scatter and all_gather each move half the
# bytes of an all_reduce. "fake" is the test backend. On gloo a reduce_scatter costs at least
# as much as the all_reduce (docs/benchmarks.md), so gloo graphs are left alone unless asked for
# (all_to_all_weight_update makes the same exchange there out of chunked all_to_all).
SHARD_BACKENDS = frozenset({"nccl", "fake"})
_WHY_NOT = {
    "gloo": "its reduce_scatter costs more than its all_reduce; all_to_all_weight_update covers "
    "gloo, or pass shard_backends to force"
}


def _rewrite_own_slice(graph: Graph, index: Node, chain, n: int) -> None:
    with graph.inserting_before(chain.collective):
        rs = new_node(
            graph, REDUCE_SCATTER, (chain.collective.args[0], chain.reduce_op, n, chain.group_name)
        )
    with graph.inserting_before(chain.wait):
        value = new_node(graph, WAIT, (rs,))
    with graph.inserting_before(index):
        # the scales and casts, on the slice (elementwise: they commute)
        value = reapply(graph, value, chain.post)
        mine = new_node(graph, aten.view.default, (value, list(val(index).shape)))
    index.replace_all_uses_with(mine)
    for dead in [index, *reversed(chain.post), chain.wait, chain.collective]:
        graph.erase_node(dead)


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


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of :func:`shard_weight_update`."""

    shard_backends: Collection[str] = SHARD_BACKENDS
    """Backends whose weight exchange is rewritten."""


@graph_pass(options=Options)
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
