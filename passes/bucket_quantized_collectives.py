"""bucket_quantized_collectives: the int8 hooks' collectives of many gradients go out as one.

``int8_compress_hook`` (:mod:`compiled_hooks.int8.hook`) sends each gradient's quantized rows
with one ``all_to_all`` and, in its all-reduce form, gathers the re-quantized shard with one
``all_gather``, of int8 tensors ``[rows, W]`` (a row's scales' bytes, then its values). In a
compiled DDP backward that is two collectives per parameter; ``data_parallel``'s int8 weight
gathers (``gather_dtype=torch.int8``) are one all-gather per parameter. This pass merges the
collectives of one kind, one group and one ``data_parallel`` block (none in DDP: the whole
graph) into buckets of at most ``quantized_bucket_cap_mb`` (by default, outside a block, a
quarter of that kind's bytes, between :data:`MIN_CAP_MB` and 25 MiB:
:func:`passes.core.bucket.derived_cap`, so that the first buckets go out while the backward still
runs; in a block 25 MiB): the members' rows side by side (a ``cat`` along dim 1, so row ``r``
is still what goes to rank ``r``; a member packed by a cat of its own, as
:func:`compiled_hooks.int8.codec.pack` does on CPU, gives that cat's inputs, so a bucket is
one cat), one collective, and each member reads its columns back (a contiguous copy, except
where only the ``dequantize_packed`` op reads them: it takes any strides)::

    before                                      after
    a1 = all_to_all(p1, None, None, G)          ... p1 and p2 computed ...
    w1 = wait(a1)                               b = all_to_all(cat([p1, p2], 1), None, None, G)
    u1 = f(w1)                                  ... compute that needs neither ...
    ... p2 computed ...                         wb = wait(b)
    a2 = all_to_all(p2, None, None, G)          u1 = f(clone(wb[:, :W1]))
    w2 = wait(a2)                               u2 = f(clone(wb[:, W1:]))
    u2 = f(w2)

The bucket goes out right after its last member's input is ready. Everything that depends on a
member's result and came before that point (``u1``, and the all-gather that follows it) moves
down, with the bucket's wait, to just before the first node after it that needs any of them,
so the compute in between runs while the bucket is on the wire. A bucket is left as it is
when one of the nodes that would move is needed by a member's input or writes a tensor (a
mutation could be read in between). The same bytes go to the same ranks: values are the same,
bit for bit. Collective order changes, the same on every rank. Idempotent: one member per
bucket is left alone.

Members: ``all_to_all_single`` with even splits (the same row count to and from every rank)
and ``all_gather_into_tensor`` of a 2-D int8 input, marked as the int8 collectives mark them
(``graph_contract.INT8``; in a graph with no mark, unmarked), with one user, its wait.
"""

from __future__ import annotations

import dataclasses
from typing import cast

import torch
from torch.fx import Graph, Node

from compiled_hooks.graph_contract import DEQUANTIZE_PACKED

from .core.bucket import MAX_CAP_MB, derived_cap
from .core.interface import graph_pass
from .core.marks import block_of, calls, check_graph, is_op, is_quantized
from .core.ops import ALL_GATHER, ALL_TO_ALL, WAIT, aten, val
from .core.record import record
from .core.traversal import ancestors, dependents, mutates
from .core.values import new_node

__all__ = ["bucket_quantized_collectives"]

PASS = "bucket_quantized_collectives"

MIN_CAP_MB = 0.5
"""The floor of the derived cap, below the other buckets' (``passes.core.bucket.MIN_CAP_MB``): an
int8 bucket's receive side (dequantize, sum, the shard's quantize) runs on the CPU after its
wait, and only smaller buckets let the next bucket's wire time hide it."""


@dataclasses.dataclass(frozen=True)
class Options:
    quantized_bucket_cap_mb: float | None = None
    """Cap of one bucket's int8 input in MiB; None derives it from the graph outside a
    data_parallel block, as ``bucket_compressed_collectives`` does with a lower floor
    (:data:`MIN_CAP_MB`), and is 25 MiB in a block."""


def _member(n: Node) -> bool:
    if not is_op(n, (ALL_TO_ALL, ALL_GATHER)):
        return False
    if not is_quantized(n):
        return False
    x = val(n.args[0])
    if x.dim() != 2:
        return False
    if n.target is ALL_TO_ALL and not (_even(n.args[1], x.shape[0]) and n.args[1] == n.args[2]):
        return False
    return len(n.users) == 1 and is_op(next(iter(n.users)), (WAIT,))


def _even(splits: object, rows: int) -> bool:
    """``splits`` are equal ints summing to ``rows`` (None: even, as the functional op says)."""
    if splits is None:
        return True
    if not isinstance(splits, (list, tuple)) or not all(isinstance(s, int) for s in splits):
        return False
    return len(set(splits)) == 1 and sum(splits) == rows


def _key(n: Node) -> tuple:
    return (n.target, block_of(n), *(tuple(a) if isinstance(a, list) else a for a in n.args[1:]))


def _cap(key: tuple, total: int, cap_mb: float | None) -> float:
    """The cap in bytes of the members of ``key``, of ``total`` bytes in all: ``cap_mb``; else
    derived in DDP's graph, and ``MAX_CAP_MB`` in a data_parallel block (one bucket a block,
    which ``prefetch_block_all_gathers`` counts its depth in)."""
    if cap_mb is not None:
        return cap_mb * 2**20
    return derived_cap(total, MIN_CAP_MB) if key[1] is None else MAX_CAP_MB * 2**20


def _buckets(graph: Graph, cap_mb: float | None) -> list[list[Node]]:
    """Members in graph order, by kind, group and block, cut where the cap would be passed
    (:func:`_cap`)."""
    members = [n for n in calls(graph, (ALL_TO_ALL, ALL_GATHER)) if _member(n)]
    keys = [_key(n) for n in members]
    nbytes = [val(n.args[0]).numel() for n in members]
    total: dict[tuple, int] = {}
    for key, b in zip(keys, nbytes):
        total[key] = total.get(key, 0) + b
    cap = {k: _cap(k, t, cap_mb) for k, t in total.items()}
    open_: dict[tuple, list[Node]] = {}
    size: dict[tuple, int] = {}
    done: list[list[Node]] = []
    for n, key, b in zip(members, keys, nbytes):
        if key in open_ and size[key] + b > cap[key]:
            done.append(open_.pop(key))
        if key not in open_:
            open_[key], size[key] = [], 0
        open_[key].append(n)
        size[key] += b
    return [b for b in done + list(open_.values()) if len(b) > 1]


def _pieces(x: Node) -> list[Node]:
    """What the bucket's cat takes for the member input ``x``: the inputs of a cat along the
    columns that only the member reads (on CPU a member's rows are packed by one), else ``x``.
    One cat of all the pieces, not a cat of cats: on CPU each int8 cat is a copy."""
    if not is_op(x, (aten.cat.default,)) or len(x.users) != 1 or len(x.args) < 2:
        return [x]
    parts, dim = x.args[0], x.args[1]
    if dim not in (1, -1) or not isinstance(parts, (list, tuple)):
        return [x]
    nodes = [p for p in parts if isinstance(p, Node)]
    return nodes if len(nodes) == len(parts) else [x]


def _merge(graph: Graph, bucket: list[Node]) -> bool:
    order = {n: i for i, n in enumerate(graph.nodes)}
    target = cast(torch._ops.OpOverload, bucket[0].target)
    inputs = [cast(Node, m.args[0]) for m in bucket]
    anchor = max(inputs, key=order.__getitem__)
    waits = [next(iter(m.users)) for m in bucket]
    own = set(bucket) | set(waits)
    reached = dependents(bucket)
    movers = sorted(
        (n for n in reached if order[n] < order[anchor] and n not in own),
        key=order.__getitem__,
    )
    if set(movers) & ancestors(inputs):
        record(PASS, "skipped bucket: a member's input needs another member's result", bucket[0])
        return False
    if any(mutates(n) for n in movers):
        record(PASS, "skipped bucket: a write would move", bucket[0])
        return False
    later = [n for n in reached if order[n] > order[anchor] and n not in own]
    first_use = (
        min(later, key=order.__getitem__) if later else next(iter(graph.find_nodes(op="output")))
    )

    pieces = [p for x in inputs for p in _pieces(x)]
    with graph.inserting_after(anchor):
        cat = new_node(graph, aten.cat.default, (pieces, 1), name="quantized_bucket_cat")
    with graph.inserting_after(cat):
        coll = new_node(graph, target, (cat, *bucket[0].args[1:]), name="quantized_bucket")
        coll.meta["custom"] = dict(bucket[0].meta.get("custom", {}))  # the block, if any
    with graph.inserting_before(first_use):
        wait = new_node(graph, WAIT, (coll,), name="quantized_bucket_wait")
        start = 0
        for m, w in zip(bucket, waits):
            width = val(m.args[0]).shape[1]
            piece = new_node(graph, aten.slice.Tensor, (wait, 1, start, start + width))
            if not all(is_op(u, (DEQUANTIZE_PACKED,)) for u in w.users):  # it takes any strides
                piece = new_node(
                    graph, aten.clone.default, (piece,), {"memory_format": torch.contiguous_format}
                )
            w.replace_all_uses_with(piece)
            start += width
    for n in movers:
        first_use.prepend(n)
    for m, w in zip(bucket, waits):
        graph.erase_node(w)
        graph.erase_node(m)
    for x in inputs:
        if x not in pieces:  # a member's cat, spliced into the bucket's
            graph.erase_node(x)
    record(PASS, f"bucketed {len(bucket)} int8 {target._schema.name.split('::')[-1]}s", coll)
    return True


@graph_pass(options=Options)
def bucket_quantized_collectives(
    graph: Graph, quantized_bucket_cap_mb: float | None = None
) -> bool:
    """Merge the int8 collectives of one kind and group into buckets (see the module
    docstring). Returns True when the graph changed."""
    check_graph(PASS, graph)
    if quantized_bucket_cap_mb is not None and quantized_bucket_cap_mb <= 0:
        raise ValueError(f"{PASS}: the bucket cap must be positive, got {quantized_bucket_cap_mb}")
    changed = False
    for target in (ALL_TO_ALL, ALL_GATHER):  # the gathers follow the all-to-alls' results
        buckets = _buckets(graph, quantized_bucket_cap_mb)
        for bucket in [b for b in buckets if b[0].target is target]:
            changed |= _merge(graph, bucket)
    return changed
