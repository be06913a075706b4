"""Schedule the ZeRO step's updates and broadcasts around the gradient collectives.

A *ZeRO broadcast* is a functional ``broadcast`` (or the ``all_gather`` that
``shard_weight_update`` makes of the owners' broadcasts) with a single ``wait_tensor`` whose
input depends on the wait of a gradient collective (``all_reduce`` / ``reduce_scatter``): the
new value of a parameter, computed by its owner from the reduced gradient
(:mod:`compiled_hooks.zero`). Its *update* is every node it depends on that comes after that
gradient wait.

The schedule follows the graph it is given, which the two ZeRO hooks make different:

- interleaved (``hook_with_zero_step_interleaved``: some broadcast comes before a gradient
  collective): the hook traces each bucket's update and broadcasts right after its gradient
  collective, which would make the rest of backward wait for that collective. Everything
  between a gradient collective and the next one that depends on the first one's result (its
  wait, the update, the broadcasts and their waits) moves down to just after the next
  gradient collectives are issued (a bucket's chunks, issued together), after the backward
  compute they need, so the first one runs meanwhile and the next gradients go on the wire
  ahead of the broadcasts (docs/passes.md says why not before). Where one of the two is
  compressed, they go just *before* it instead, so that ``bucket_compressed_collectives``
  cannot merge the two on a second run. The last bucket's update, with no gradient
  collective after it, goes right after its gradient's wait::

      before                             after
      ar1 = all_reduce(g1)               ar1 = all_reduce(g1)
      w1 = wait(ar1)                     g2 = backward(...)        # runs while ar1 is in flight
      u1 = update(p1, w1)                ar2 = all_reduce(g2)
      b1 = broadcast(u1); wb1 = wait(b1) w1 = wait(ar1)
      g2 = backward(...)                 u1 = update(p1, w1); b1 = broadcast(u1)
      ar2 = all_reduce(g2)               w2 = wait(ar2)
      w2 = wait(ar2)                     u2 = update(p2, w2); b2 = broadcast(u2)
      u2 = ...; b2 = ...; wb2 = wait(b2) wb1 = wait(b1); wb2 = wait(b2)   # at the write-back
      copy_(p1, wb1); copy_(p2, wb2)     copy_(p1, wb1); copy_(p2, wb2)

- after backward (``hook_with_zero_step``: every broadcast comes after every gradient
  collective): updates start after the last gradient collective is issued, each right after
  its gradient's wait, in gradient order, overlapping the collectives still outstanding.

In both, each broadcast's wait moves to just before the parameter's write-back, with the pure
computation that reads its result (a write or a collective that needs one ends the wait), so
all broadcasts are in flight together and an update runs while the broadcasts before it are.
Only compute, waits and the ZeRO broadcasts move: an update that depends on another
collective, a wait or a mutation, or that would move past a write, is left where it is.
"""

from __future__ import annotations

import bisect

from torch.fx import Graph, Node

from .core.bucket import compressed_collectives
from .core.interface import graph_pass
from .core.marks import calls, check_graph, is_collective, is_op, is_quantized
from .core.ops import ALL_GATHER, ALL_TO_ALL, BROADCAST, COLLECTIVES, WAIT
from .core.record import record
from .core.traversal import ancestors, mutates

__all__ = ["interleave_zero_broadcasts"]

PASS = "interleave_zero_broadcasts"
# all_to_all: all_to_all_weight_update's reduction
GRADIENT_COLLECTIVES = COLLECTIVES + (ALL_TO_ALL,)


def _zero_broadcasts(graph: Graph) -> list[Node]:
    """The broadcasts and all-gathers with a single wait, never an int8 hook's all-gather (of
    int8 rows), which follows an all-to-all in the same shape: the ZeRO broadcasts, where they
    depend on a gradient collective's wait (the module docstring)."""
    return [
        n
        for n in calls(graph, (BROADCAST, ALL_GATHER))
        if not is_quantized(n) and len(n.users) == 1 and is_op(next(iter(n.users)), (WAIT,))
    ]


def _is_gradient_wait(n: Node) -> bool:
    return is_op(n, (WAIT,)) and is_op(n.args[0], GRADIENT_COLLECTIVES)


def _latest_gradient_wait(graph: Graph, position: dict[Node, int]) -> dict[Node, Node]:
    """For every node, the latest gradient-collective wait it depends on (if any)."""
    latest: dict[Node, Node] = {}
    for n in graph.nodes:
        if _is_gradient_wait(n):
            latest[n] = n
            continue
        found = [latest[i] for i in n.all_input_nodes if i in latest]
        if found:
            latest[n] = max(found, key=position.__getitem__)
    return latest


def _written_between(mutations: list[int], lo: int, hi: int) -> bool:
    """Whether a write (``mutations``: sorted positions) lies strictly between ``lo`` and ``hi``."""
    return bisect.bisect_right(mutations, lo) < bisect.bisect_left(mutations, hi)


def _movable(n: Node) -> bool:
    """A pure computation, or a constant (``get_attr``: e.g. an index tensor)."""
    return n.op == "get_attr" or (
        n.op == "call_function" and not is_op(n, (WAIT,)) and not mutates(n)
    )


def _issued_together(
    nodes: list[Node], position: dict[Node, int], gradient_collectives: list[Node]
) -> dict[Node, Node]:
    """Each gradient collective -> the last one issued together with it: the run of collectives
    with nothing between them but the next one's own inputs (a bucket's chunks)."""
    end = {c: c for c in gradient_collectives}
    for c, nxt in reversed(list(zip(gradient_collectives, gradient_collectives[1:]))):
        lo, hi = position[c], position[nxt]

        def between(i: Node, lo: int = lo, hi: int = hi) -> bool:
            return lo < position[i] < hi

        inputs = ancestors([nxt], between)
        if all(n in inputs for n in nodes[lo + 1 : hi]):
            end[c] = end[nxt]
    return end


def _held_updates(
    nodes: list[Node],
    position: dict[Node, int],
    latest: dict[Node, Node],
    gradient_collectives: list[Node],
    broadcasts: set[Node],
    broadcast_waits: set[Node],
    mutations: list[int],
    compressed: set[Node],
) -> dict[Node, tuple[list[Node], list[Node]]]:
    """Interleaved schedule: anchor -> the nodes (in graph order) that move to just before it
    and just after it. Between two gradient collectives, the nodes that depend on the first
    one's result (backward's own compute does not) move if all of them can: compute, gradient
    waits, ZeRO broadcasts and their waits, with no write on the way. They go just after the
    next gradient collectives issued together (the anchor is the last of them), the updates and
    their broadcasts first. Where the first collective or one of those is compressed, they go
    around the next one instead, the updates and broadcasts before it, the rest after it: with
    no broadcast between two compressed collectives, ``bucket_compressed_collectives`` would merge
    them on a second run of the pipeline."""
    held: dict[Node, tuple[list[Node], list[Node]]] = {}
    end = _issued_together(nodes, position, gradient_collectives)
    index = {c: k for k, c in enumerate(gradient_collectives)}
    for first, second in zip(gradient_collectives, gradient_collectives[1:]):
        lo, hi = position[first], position[second]
        region = [n for n in nodes[lo + 1 : hi] if n in latest and latest[n].args[0] is first]
        if not any(n in broadcasts for n in region):
            continue
        run = gradient_collectives[index[second] : index[end[second]] + 1]
        past = not compressed.intersection([first, *run])
        anchor = end[second] if past else second
        if _written_between(mutations, lo, position[anchor]):
            record(PASS, "skipped: a write between two gradient collectives", second)
            continue
        if not all(
            _movable(n) or n in broadcasts or n in broadcast_waits or _is_gradient_wait(n)
            for n in region
        ):
            record(
                PASS, "skipped: the update depends on a collective, a wait or a mutation", second
            )
            continue
        inside = set(region)
        need = ancestors([n for n in region if n in broadcasts], inside.__contains__)
        updates, rest = [n for n in region if n in need], [n for n in region if n not in need]
        held[anchor] = ([], updates + rest) if past else (updates, rest)
    return held


@graph_pass(
    after=("bucket_compressed_collectives", "all_to_all_weight_update", "shard_weight_update")
)
def interleave_zero_broadcasts(graph: Graph) -> bool:
    """Schedule ZeRO updates and broadcasts (the module docstring); True if the order changed."""
    check_graph(PASS, graph)
    broadcasts = _zero_broadcasts(graph)
    if not broadcasts:
        return False
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    latest = _latest_gradient_wait(graph, position)
    broadcasts = [b for b in broadcasts if b in latest]
    gradient_collectives = [n for n in nodes if is_op(n, GRADIENT_COLLECTIVES)]
    if not broadcasts or not gradient_collectives:
        return False
    last_issue = gradient_collectives[-1]
    waits = {next(iter(b.users)) for b in broadcasts}
    mutations = [position[n] for n in nodes if mutates(n)]
    # interleaved (some broadcast before the last gradient collective; moving updates down to the
    # next gradient collective keeps it so): each update down to the next collective
    interleaved = position[broadcasts[0]] < position[last_issue]
    if interleaved:
        held = _held_updates(
            nodes,
            position,
            latest,
            gradient_collectives,
            set(broadcasts),
            waits,
            mutations,
            compressed_collectives(graph, PASS),
        )
        if held:
            moved = {n for before, after in held.values() for n in before + after}
            reordered: list[Node] = []
            for n in nodes:
                if n not in moved:
                    before, after = held.get(n, ([], []))
                    reordered += [*before, n, *after]
            nodes = reordered
            position = {n: i for i, n in enumerate(nodes)}
            latest = _latest_gradient_wait(graph, position)
            mutations = [position[n] for n in nodes if mutates(n)]
            for b in moved.intersection(broadcasts):
                record(PASS, "update held back to the next gradient collective", b)

    anchored: dict[Node, list[Node]] = {}
    for b in broadcasts:
        anchor = latest[b]
        if not interleaved and position[last_issue] > position[anchor]:
            anchor = last_issue
        anchored.setdefault(anchor, []).append(b)

    order: list[Node] = []
    placed: set[Node] = set()
    for n in nodes:
        if n in placed:
            continue
        order.append(n)
        placed.add(n)
        for b in anchored.get(n, ()):
            update = sorted(ancestors([b], lambda i: i not in placed), key=position.__getitem__)
            if not all(_movable(u) for u in update if u is not b) or any(
                is_collective(u) for u in update if u is not b
            ):
                record(PASS, "skipped: the update depends on a collective, a wait or a mutation", b)
                continue
            # it might read what that writes
            if _written_between(mutations, position[n], position[b]):
                record(PASS, "skipped: a mutation between the gradient and the update", b)
                continue
            order.extend(update)
            placed.update(update)
            record(PASS, "update placed after its gradient", b)

    # each broadcast's wait, with the pure computation that reads it (the rows' join, the
    # parameters' slices), just before the first node that is not pure computation and needs one
    # of them (the write-back), or before any write
    final: list[Node] = []
    deferred: list[Node] = []
    waiting: set[Node] = set()  # the same nodes, for lookups
    for n in order:
        reads_waiting = any(i in waiting for i in n.all_input_nodes)
        if n in waits or (reads_waiting and _movable(n) and not is_collective(n)):
            deferred.append(n)
            waiting.add(n)
            continue
        if deferred and (reads_waiting or mutates(n) or n.op == "output"):
            final += deferred
            deferred, waiting = [], set()
        final.append(n)
    if final == list(graph.nodes):
        return False
    for prev, n in zip(final, final[1:]):
        if prev.next is not n:
            prev.append(n)
    record(PASS, "interleaved schedule" if interleaved else "after-backward schedule")
    return True
