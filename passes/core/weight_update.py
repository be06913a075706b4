"""Matching a ZeRO step's weight exchange: what ``shard_weight_update`` and
``all_to_all_weight_update`` rewrite (the two patterns are drawn in
:mod:`passes.shard_weight_update`).

* *own slice*: this rank's slice (``index(view(all_reduce(...)), [group_rank(G)])``) of an
  all_reduce that nothing else reads, after the hook's scales, casts and reshapes;
* *owner broadcasts*: ``cat`` of one tensor broadcast from every rank of a group, in rank order.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import cast

from torch.fx import Graph, Node

from compiled_hooks.graph_contract import GROUP_RANK

from .chains import is_scale, match_chain
from .groups import group_info
from .marks import calls, is_op
from .ops import ALL_REDUCE, BROADCAST, CAST_OPS, VIEW_OPS, WAIT, arg, aten, val
from .record import record

__all__ = ["own_slice", "owner_broadcasts", "weight_update_matches"]


def own_slice(index: Node):
    """(chain, N) when ``index`` reads this rank's slice of an all_reduce (rewrite 1)."""
    if not is_op(index, (aten.index.Tensor,)) or len(index.args) != 2:
        return None
    view, indices = cast(Node, index.args[0]), index.args[1]
    if not (
        isinstance(indices, (list, tuple))
        and len(indices) == 1
        and is_op(indices[0], (GROUP_RANK,))
    ):
        return None
    if not is_op(view, VIEW_OPS) or len(view.users) != 1:
        return None
    node = arg(view)
    while not is_op(node, (WAIT,)):  # walk back over the hook's elementwise ops and reshapes
        if not (is_scale(node) or is_op(node, CAST_OPS + VIEW_OPS)) or len(node.users) != 1:
            return None
        node = arg(node)
    chain = match_chain(arg(node))
    # the chain runs wait -> scales/casts/reshapes -> this view; nothing else reads the all_reduce
    if (
        chain is None
        or chain.problem
        or not is_op(chain.collective, (ALL_REDUCE,))
        or chain.end is not view
    ):
        return None
    info = group_info(chain.group_name)
    shape = list(val(view).shape)
    flat = val(chain.collective.args[0])
    if (
        info is None
        or cast(Node, indices[0]).args[0] != chain.group_name
        or chain.reduce_op not in ("sum", "avg")
        or len(shape) != 2
        or shape[0] != info.size
        or flat.dim() != 1
        or flat.numel() != shape[0] * shape[1]
    ):
        return None
    return chain, info


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
    if (
        info is None
        or info.size != len(waits)
        or any(b.args[0] is not y or b.args[2] != group for b in broadcasts)
    ):
        return None
    return broadcasts, info


def weight_update_matches(
    graph: Graph, pass_name: str, backends: Collection[str], why_not: dict[str, str]
):
    """The two patterns above in ``graph``, on groups whose backend is in ``backends``:
    ``(node, own-slice chain or None, owner broadcasts or None, group size)`` per match, in
    graph order; a match on another backend is counted with ``why_not``'s reason. A rewrite
    made while iterating may erase only nodes before ``node``."""
    for node in calls(graph, (aten.index.Tensor, aten.cat.default)):
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
