"""Schedule the ZeRO step's updates and broadcasts around the gradient collectives.

A *ZeRO broadcast* is a functional ``broadcast`` (or the ``all_gather`` that
``shard_weight_update`` makes of the owners' broadcasts) with a single ``wait_tensor`` whose
input depends on the wait of a gradient collective (``all_reduce`` / ``reduce_scatter``): the
new value of a parameter, computed by its owner from the reduced gradient
(:mod:`compiled_hooks.zero`). Its *update* is every node it depends on that comes after that
gradient wait.

The schedule follows the graph it is given, which the two ZeRO hooks make different:

- interleaved (``hook_with_zero_step_interleaved``: some broadcast comes before a gradient
  collective): each update is moved right after its gradient collective's wait and its
  broadcast issued at once, so it runs while later gradient collectives are in flight::

      before                             after
      ar1 = all_reduce(g1)               ar1 = all_reduce(g1)
      ar2 = all_reduce(g2)               ar2 = all_reduce(g2)
      w1 = wait(ar1)                     w1 = wait(ar1)
      w2 = wait(ar2)                     u1 = update(p1, w1); b1 = broadcast(u1)
      u1 = update(p1, w1)                w2 = wait(ar2)
      b1 = broadcast(u1); wb1 = wait(b1) u2 = update(p2, w2); b2 = broadcast(u2)
      u2 = ...; b2 = ...; wb2 = wait(b2) wb1 = wait(b1); wb2 = wait(b2)   # before first use
      copy_(p1, wb1); copy_(p2, wb2)     copy_(p1, wb1); copy_(p2, wb2)

- after backward (``hook_with_zero_step``: every broadcast comes after every gradient
  collective): updates start after the last gradient collective is issued, each right after
  its gradient's wait, in gradient order, overlapping the collectives still outstanding.

In both, each broadcast's wait is moved to just before its first user (the write-back of the
parameter), so all broadcasts are in flight together. Only compute nodes move: an update that
depends on another collective, a wait or a mutation, or that comes after a write (which it
might read) since its gradient's wait, is left where it is; no collective changes its position
relative to another one except that a broadcast is issued earlier, at the same point of the
graph on every rank (the graph is rank-independent).
"""

from __future__ import annotations

from torch.fx import Graph, Node

from ._graph import ALL_GATHER, BROADCAST, COLLECTIVES, WAIT, check_graph, is_collective, is_op, record

PASS = "interleave_zero_broadcasts"


def _zero_broadcasts(graph: Graph) -> list[Node]:
    return [n for n in graph.nodes
            if is_op(n, (BROADCAST, ALL_GATHER)) and len(n.users) == 1 and is_op(next(iter(n.users)), (WAIT,))]


def _latest_gradient_wait(graph: Graph, position: dict[Node, int]) -> dict[Node, Node]:
    """For every node, the latest gradient-collective wait it depends on (if any)."""
    latest: dict[Node, Node] = {}
    for n in graph.nodes:
        if is_op(n, (WAIT,)) and is_op(n.args[0], COLLECTIVES):
            latest[n] = n
            continue
        found = [latest[i] for i in n.all_input_nodes if i in latest]
        if found:
            latest[n] = max(found, key=position.__getitem__)
    return latest


def _unplaced_ancestors(node: Node, placed: set[Node]) -> list[Node]:
    seen, stack = {node}, [node]
    while stack:
        for i in stack.pop().all_input_nodes:
            if i not in placed and i not in seen:
                seen.add(i)
                stack.append(i)
    return list(seen)


def _mutates(n: Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return n.op == "call_function" and schema is not None and schema.is_mutable


def _movable(n: Node) -> bool:
    """A pure computation, or a constant (``get_attr``: e.g. an index tensor)."""
    return n.op == "get_attr" or (n.op == "call_function" and not is_op(n, (WAIT,)) and not _mutates(n))


def interleave_zero_broadcasts(graph: Graph) -> bool:
    """Schedule ZeRO updates and broadcasts (see the module docstring); True if the order changed."""
    check_graph(PASS, graph)
    broadcasts = _zero_broadcasts(graph)
    if not broadcasts:
        return False
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    latest = _latest_gradient_wait(graph, position)
    broadcasts = [b for b in broadcasts if b in latest]
    gradient_collectives = [n for n in nodes if is_op(n, COLLECTIVES)]
    if not broadcasts or not gradient_collectives:
        return False
    interleaved = position[broadcasts[0]] < position[gradient_collectives[-1]]
    last_issue = gradient_collectives[-1]

    anchored: dict[Node, list[Node]] = {}
    for b in broadcasts:
        anchor = latest[b]
        if not interleaved and position[last_issue] > position[anchor]:
            anchor = last_issue
        anchored.setdefault(anchor, []).append(b)

    mutations = [position[n] for n in nodes if _mutates(n)]
    order: list[Node] = []
    placed: set[Node] = set()
    for n in nodes:
        if n in placed:
            continue
        order.append(n)
        placed.add(n)
        for b in anchored.get(n, ()):
            update = sorted(_unplaced_ancestors(b, placed), key=position.__getitem__)
            if not all(_movable(u) for u in update if u is not b) or any(is_collective(u) for u in update if u is not b):
                record(PASS, "skipped: the update depends on a collective, a wait or a mutation", b)
                continue
            if any(position[n] < m < position[b] for m in mutations):  # it might read what that writes
                record(PASS, "skipped: a mutation between the gradient and the update", b)
                continue
            order.extend(update)
            placed.update(update)
            record(PASS, "update placed after its gradient", b)

    # each broadcast's wait just before its first user
    waits = {next(iter(b.users)) for b in broadcasts}
    final: list[Node] = []
    pending: dict[Node, Node] = {}  # wait -> itself, held back until a user needs it
    for n in order:
        if n in waits:
            pending[n] = n
            continue
        for i in n.all_input_nodes:
            if i in pending:
                final.append(pending.pop(i))
        final.append(n)
    final[-1:-1] = list(pending)  # waits nobody reads: just before the output

    if final == nodes:
        return False
    for prev, n in zip(final, final[1:]):
        if prev.next is not n:
            prev.append(n)
    record(PASS, "interleaved schedule" if interleaved else "after-backward schedule")
    return True
