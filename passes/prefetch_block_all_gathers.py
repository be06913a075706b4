"""prefetch_block_all_gathers: each ``data_parallel`` block's all-gather goes out while the
block ``prefetch_depth`` before it computes, and no earlier, unless the graph keeps its result.

``schedule_collectives`` leaves these all-gathers where they are and moves each wait right
before its block's first use. Issued all at once, the gathered parameters of every block would
be alive together; issued right before their waits, none would overlap. This pass orders the marked
all-gathers (``node.meta["custom"]["data_parallel_block"]``) by the first use of their result,
and moves the ``j``-th, with the nodes that feed only it (the bucket's ``cat`` and casts), to
just before the wait of the ``(j - prefetch_depth)``-th; the first ``prefetch_depth`` stay
where they are if that is before the first wait, and go right before it otherwise. In forward
that is the next block's gather going out before the current block computes; in a backward
that gathers again it is the same in reverse block order. With depth 1::

    before                                   after
    a1 = all_gather(f1); a2 = all_gather(f2) a1 = all_gather(f1)
    a3 = all_gather(f3)                      a2 = all_gather(f2)
    w1 = wait_tensor(a1)                     w1 = wait_tensor(a1)
    ... block 1 ...                          ... block 1 ...            # a2 in flight
    w2 = wait_tensor(a2)                     a3 = all_gather(f3)
    ... block 2 ...                          w2 = wait_tensor(a2)
    w3 = wait_tensor(a3)                     ... block 2 ...            # a3 in flight
    ... block 3 ...                          w3 = wait_tensor(a3)
                                             ... block 3 ...

When block ``j`` computes, the blocks before it are done with their gathered parameters (the
graph frees them after their last use, with ``reshard_after_forward``) and ``j + 1 .. j +
prefetch_depth`` are in flight: at most ``prefetch_depth + 1`` blocks' gathered parameters are
alive at once, besides what the graph itself keeps. Every wait stays right before its first use.

An all-gather whose result the graph returns (a forward keeping its gathered parameters for
backward, without ``reshard_after_forward``: views of the result, or the pieces a bucket's
copy-out made of it) lives to the graph's end wherever it goes out, so
it is not held back: it goes out before the first wait, and the depth counts only the others.
On gloo, whose two worker threads run two collectives at once, a gather issued one block ahead
ends together with the one before it, and the link idles while the block computes.

The views of parameters an all-gather reads move up with it when they come after its slot (a
resharding forward also returns them, for the backward's re-gather, so they are not in its
input cone).

An all-gather whose inputs are not ready at its slot stays where it is (counted). The order of
collectives follows from the graph alone, the same on every rank; a second run finds every
all-gather in its slot.
"""

from __future__ import annotations

import dataclasses

from torch.fx import Graph, Node

from .core.interface import graph_pass
from .core.marks import block_of, calls, check_graph, is_op
from .core.ops import ALL_GATHER, BUCKET_UNPACK, WAIT
from .core.record import record
from .core.traversal import input_cone, is_alias, returned

__all__ = ["prefetch_block_all_gathers", "Options"]

PASS = "prefetch_block_all_gathers"


def _wait(ag: Node) -> Node:
    return next(iter(ag.users))


def _kept(ag: Node) -> bool:
    """The graph returns ``ag``'s result: a view of it, or a piece a bucket's copy-out made of
    it (``BUCKET_UNPACK``)."""
    pieces = [g for u in _wait(ag).users if is_op(u, (BUCKET_UNPACK,)) for g in u.users]
    return returned(ag) or any(returned(p) for p in pieces)


def _to_move(ag: Node, slot: Node, order: dict[Node, int]) -> list[Node] | None:
    """``ag``, its input cone and the views they read that come after ``slot`` (a parameter's
    view the graph also returns for backward is not in the cone), in graph order: what moves for
    ``ag`` to go out right before ``slot``; None when anything else they read comes after it."""
    moving = set(input_cone(ag)) | {ag}
    frontier = list(moving)
    while frontier:
        for i in frontier.pop().all_input_nodes:
            if i in moving or order[i] < order[slot]:
                continue
            if not is_alias(i):
                return None
            moving.add(i)
            frontier.append(i)
    return sorted(moving, key=order.__getitem__)


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of :func:`prefetch_block_all_gathers`."""

    prefetch_depth: int = 1
    """How many blocks ahead an all-gather goes out."""


@graph_pass(options=Options, after=("bucket_block_all_gathers", "schedule_collectives"))
def prefetch_block_all_gathers(graph: Graph, prefetch_depth: int = 1) -> bool:
    """Move each marked all-gather to its prefetch slot (see the module docstring); True when the
    graph changed."""
    check_graph(PASS, graph)
    if not isinstance(prefetch_depth, int) or prefetch_depth < 1:
        raise ValueError(f"{PASS}: prefetch_depth must be an int >= 1, got {prefetch_depth!r}")
    ags = [
        n
        for n in calls(graph, (ALL_GATHER,))
        if block_of(n) is not None and len(n.users) == 1 and is_op(_wait(n), (WAIT,))
    ]
    if not ags:
        return False
    order = {n: i for i, n in enumerate(graph.nodes)}
    ags.sort(key=lambda ag: order[_wait(ag)])
    first_wait = _wait(ags[0])
    limited = [ag for ag in ags if not _kept(ag)]
    depth = {ag: j for j, ag in enumerate(limited)}
    changed = False
    for ag in ags:
        j = depth.get(ag)
        if j is None or j < prefetch_depth:  # kept, or one of the first: before the first wait
            slot = first_wait if j is None else _wait(limited[0])
            if order[ag] < order[slot]:
                continue
        else:
            slot = _wait(limited[j - prefetch_depth])
            if slot.prev is ag:  # already in its slot
                continue
        moving = _to_move(ag, slot, order)
        if moving is None:
            record(PASS, "skipped: inputs not ready at the prefetch slot", ag)
            continue
        for n in moving:
            slot.prepend(n)
        order = {n: i for i, n in enumerate(graph.nodes)}
        record(
            PASS,
            "all_gather kept by the graph issued first"
            if j is None
            else f"all_gather issued {prefetch_depth} block(s) ahead",
            ag,
        )
        changed = True
    return changed
