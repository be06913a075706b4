"""schedule_collectives: issue every collective as early as its inputs allow, wait as late as
its uses allow.

Communication overlaps computation only between a collective and its wait. This pass widens
that window in the graph, for every functional collective (bucketed or not):

- each ``wait_tensor``, with the unary ops that only decompress or reshape its result (the
  chain's post ops: casts, constant scales, views), moves to just before the first node that
  uses the result;
- each collective moves up to just after the last of its inputs, but never above the previous
  collective (the order of collectives stays the graph's, the same on every rank) nor above a
  node with side effects (a mutation might write what it reads). A ``data_parallel`` block's
  all-gather stays where it is: ``prefetch_block_all_gathers`` places those.

For two layers' gradients of a compiled DDP backward::

    before                                 after
    g1 = mm(...)                           g1 = mm(...)
    c1 = convert_element_type(g1, bf16)    c1 = convert_element_type(g1, bf16)
    r1 = all_reduce(c1, "avg", group)      r1 = all_reduce(c1, "avg", group)
    w1 = wait_tensor(r1)                   g2 = mm(...)                 # overlaps r1
    o1 = convert_element_type(w1, f32)     c2 = convert_element_type(g2, bf16)
    g2 = mm(...)                           r2 = all_reduce(c2, "avg", group)
    c2 = convert_element_type(g2, bf16)    w1 = wait_tensor(r1)
    r2 = all_reduce(c2, "avg", group)      o1 = convert_element_type(w1, f32)
    w2 = wait_tensor(r2)                   w2 = wait_tensor(r2)
    o2 = convert_element_type(w2, f32)     o2 = convert_element_type(w2, f32)
    copy_(grad1, o1); copy_(grad2, o2)     copy_(grad1, o1); copy_(grad2, o2)

Only collectives, waits and those pure post ops move, so values are unchanged; linear in the
graph's nodes. Inductor's scheduler reorders nodes again (its peak-memory ordering puts each
wait right after its collective); :func:`passes.install` turns that ordering off and runs
Inductor's ``sink_waits``, which keeps the waits late, on every graph but a ``data_parallel``
one (:func:`passes.registration.sink_waits_outside_blocks`).
"""

from __future__ import annotations

from torch.fx import Graph, Node

from .core.chains import is_chain_op
from .core.interface import graph_pass
from .core.marks import block_of, check_graph, is_collective, is_op
from .core.ops import ALL_GATHER, WAIT
from .core.record import record

__all__ = ["schedule_collectives", "schedule_problems"]

PASS = "schedule_collectives"


def _post(wait: Node) -> list[Node]:
    """The wait and the single-user unary chain ops after it (decompress, scale, view)."""
    run = [wait]
    node = wait
    while len(node.users) == 1:
        (user,) = node.users
        if not (is_chain_op(user) and user.all_input_nodes == [node]):
            break
        run.append(user)
        node = user
    return run


def _sink_waits(graph: Graph) -> bool:
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    held: dict[Node, list[list[Node]]] = {}  # first use -> the runs to put right before it
    moving: set[Node] = set()
    for node in nodes:
        if not (is_op(node, (WAIT,)) and is_collective(node.args[0])):
            continue
        run = _post(node)
        if run[-1].users:
            held.setdefault(min(run[-1].users, key=order.__getitem__), []).append(run)
            moving.update(run)
    # A first use is never a moving node (its input would be the run's end, so it would belong
    # to the run). Runs sharing a first use go in the order it reads them, as
    # interleave_zero_broadcasts places the waits it holds back.
    final: list[Node] = []
    for node in nodes:
        if node in moving:
            continue
        runs = held.get(node)
        if runs:
            reads = {n: i for i, n in enumerate(node.all_input_nodes)}
            for run in sorted(runs, key=lambda r: reads[r[-1]]):
                final.extend(run)
        final.append(node)
    if final == nodes:
        return False
    for prev, n in zip(final, final[1:]):
        if prev.next is not n:
            prev.append(n)
    record(PASS, "waits moved to their first use")
    return True


def _side_effects(node: Node, known: dict) -> bool:
    """``node.is_impure()``, asked once per target (it depends only on the target here)."""
    if node.op != "call_function":
        return node.op not in ("placeholder", "get_attr") and node.is_impure()
    if node.target not in known:
        known[node.target] = node.is_impure()
    return known[node.target]


def _prefetched(node: Node) -> bool:
    """A data_parallel block's all-gather: prefetch_block_all_gathers places it, so that the
    gathered parameters alive at once stay bounded; it is not raised here."""
    return is_op(node, (ALL_GATHER,)) and block_of(node) is not None


def _raise_collectives(graph: Graph) -> bool:
    # Positions as (index in the graph before this step, number of collectives placed there):
    # a collective moved right after node X sorts between X and X's old successor.
    pos: dict[Node, tuple[int, int]] = {n: (i, 0) for i, n in enumerate(graph.nodes)}
    barrier = None  # the latest collective or node with side effects
    known: dict = {}
    moved = 0
    for node in list(graph.nodes):
        if _prefetched(node):
            barrier = node  # prefetch_block_all_gathers places it
        elif is_collective(node):
            anchor = max(
                node.all_input_nodes + ([barrier] if barrier is not None else []),
                key=pos.__getitem__,
                default=None,
            )
            if anchor is not None and anchor is not node.prev and pos[anchor] < pos[node]:
                anchor.append(node)
                pos[node] = (pos[anchor][0], pos[anchor][1] + 1)
                moved += 1
                record(PASS, "collective issued right after its inputs", node)
            barrier = node
        elif _side_effects(node, known):
            barrier = node
    return moved > 0


def schedule_problems(graph: Graph) -> list[str]:
    """What in ``graph`` breaks the schedule this pass makes: a wait (or its decompress) with an
    unrelated node between it and the first use of its result, or a collective that could be
    issued earlier. Empty for a graph this pass has scheduled (the randomized pass test checks
    every pipeline's output with it)."""
    problems = []
    runs = {}
    for node in graph.nodes:
        if is_op(node, (WAIT,)) and is_collective(node.args[0]):
            for n in _post(node):
                runs[n] = node
    for wait in dict.fromkeys(runs.values()):
        end = _post(wait)[-1]
        node = end.next
        while node.op != "root" and node not in end.users:
            if node not in runs:
                problems.append(
                    f"{wait.name} waits before {node.name}, which does not use its result"
                )
                break
            node = node.next
    barrier: Node | None = None
    known: dict = {}
    for node in graph.nodes:
        if _prefetched(node):
            barrier = node
        elif is_collective(node):
            if node.prev not in node.all_input_nodes and node.prev is not barrier:
                problems.append(f"{node.name} could be issued before {node.prev.name}")
            barrier = node
        elif _side_effects(node, known):
            barrier = node
    return problems


@graph_pass(
    after=(
        "bucket_compressed_collectives",
        "bucket_low_rank_factors",
        "bucket_block_all_gathers",
        "bucket_block_reduce_scatters",
        "bucket_quantized_collectives",
        "sink_quantized_receives",
        "interleave_zero_broadcasts",
    )
)
def schedule_collectives(graph: Graph) -> bool:
    """Move waits late and collectives early (see the module docstring). True when the graph
    changed."""
    check_graph(PASS, graph)
    sunk = _sink_waits(graph)
    return _raise_collectives(graph) or sunk
