"""insert_rank_guard: put a rank-divergence check at the start of every graph that communicates.

The guard compares, across the ranks of each process group, the collectives a compiled graph
will issue, the first time the graph runs, before the first of them is issued (see
:mod:`compiled_hooks.rank_guard` for the run-time side). This pass writes down that sequence
and plants the check::

    before                                        after
    x = placeholder()                             x = placeholder()
    ...                                           check_ranks('{"0": [["all_reduce", "sum", "f32",
                                                                      [16], "train.py:12"], ...]}')
    ar = all_reduce(t, 'sum', '0')                ...
    w = wait_tensor(ar)                           ar = all_reduce(t, 'sum', '0')
    ...                                           w = wait_tensor(ar)

One entry per collective, in graph order (the order Inductor issues them unless its optional
comm reordering is on, which reorders the same way on every rank): the op, its arguments that
must agree (reduce op, broadcast source, group size), the input's dtype and shape, and the
user's source line where the graph has one (printed in errors, not compared: paths may differ
between machines). Shapes that are symbolic (dynamic shapes) are recorded as their expressions: two
ranks whose symbolic sizes differ at run time are not told apart. A graph without collectives is
left alone. Run it last, so it records the order the other passes left.

Idempotent: a graph that already has a check with the same record is unchanged; a stale check
(the graph changed since) is replaced. A graph with a collective it cannot describe (no
metadata, a group passed as a value) gets no check, counted as skipped.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch
from torch.fx import Graph, Node

from compiled_hooks.graph_contract import CHECK_RANKS as CHECK

from .core.interface import graph_pass
from .core.marks import check_graph, is_collective
from .core.ops import val
from .core.record import record

__all__ = ["insert_rank_guard", "collective_record"]

NAME = "insert_rank_guard"

# Positional arguments (after the input) that must be equal on every rank, by collective.
_AGREEING_ARGS = {
    "all_reduce": (1,),
    "all_reduce_": (1,),
    "all_reduce_coalesced": (1,),
    "all_reduce_coalesced_": (1,),
    "reduce_scatter_tensor": (1, 2),
    "reduce_scatter_tensor_coalesced": (1, 2),
    "all_gather_into_tensor": (1,),
    "all_gather_into_tensor_coalesced": (1,),
    "all_gather_into_tensor_out": (1,),
    "broadcast": (1,),
    "broadcast_": (1,),
    "all_to_all_single": (1, 2),
}
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _source(node: Node) -> str:
    """``file:line in fn`` of the innermost frame outside torch the node was traced from, or ''."""
    frames = [
        f
        for f in _FRAME.findall(node.meta.get("stack_trace") or "")
        if not f[0].startswith(_TORCH_DIR)
    ]
    if not frames:
        return ""
    path, line, fn = frames[-1]
    return f"{os.path.basename(path)}:{line} in {fn}"


def _tensor_desc(value: Any) -> list | None:
    """``[dtype, shape]`` of a fake tensor (or a list of them), shapes as ints or expressions."""
    if isinstance(value, torch.Tensor):
        return [
            str(value.dtype).replace("torch.", ""),
            [int(s) if isinstance(s, int) else str(s) for s in value.shape],
        ]
    if (
        isinstance(value, (list, tuple))
        and value
        and all(isinstance(v, torch.Tensor) for v in value)
    ):
        return [_tensor_desc(v) for v in value]
    return None


def collective_record(graph: Graph) -> dict[str, list[list]] | None:
    """``{group_name: [[op, agreeing args, input (dtype, shape), source], ...]}`` in graph order;
    None when a collective cannot be described (no metadata, a group that is not a name)."""
    out: dict[str, list[list]] = {}
    for node in graph.nodes:
        if not is_collective(node):
            continue
        op = node.target._opname
        group = node.args[-1]
        desc = _tensor_desc(
            val(node.args[0])
            if isinstance(node.args[0], Node)
            else [val(a) for a in node.args[0]]
            if isinstance(node.args[0], (list, tuple))
            else None
        )
        if not isinstance(group, str) or desc is None:
            return None
        agreeing = [str(node.args[i]) for i in _AGREEING_ARGS.get(op, ()) if i < len(node.args) - 1]
        out.setdefault(group, []).append([op, agreeing, desc, _source(node)])
    return out


def _existing_checks(graph: Graph) -> list[Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is CHECK]


@graph_pass(
    after=(
        "shard_weight_update",
        "all_to_all_weight_update",
        "fold_collective_scaling",
        "bucket_block_all_gathers",
        "bucket_block_reduce_scatters",
        "bucket_compressed_collectives",
        "bucket_low_rank_factors",
        "fuse_cat_prologue",
        "interleave_zero_broadcasts",
        "schedule_collectives",
        "prefetch_block_all_gathers",
        "reinplace_broadcasts",
        "all_gather_as_all_to_all",
        "reduce_scatter_as_all_to_all",
        "hoist_input_writebacks",
    )
)
def insert_rank_guard(graph: Graph) -> bool:
    """Insert ``check_ranks(record)`` after the graph's inputs if the graph has collectives."""
    check_graph(NAME, graph)
    existing = _existing_checks(graph)
    rec = collective_record(graph)
    if rec is None:
        record(NAME, "skipped: a collective without metadata or with an unnamed group")
    payload = json.dumps(rec, sort_keys=True, separators=(",", ":")) if rec else None
    if len(existing) == 1 and existing[0].args[0] == payload:
        return False
    for node in existing:
        graph.erase_node(node)
    if payload is None:
        return bool(existing)
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        node = graph.call_function(CHECK, (payload,))
    node.meta["val"] = None
    record(NAME, "inserted")
    return True
