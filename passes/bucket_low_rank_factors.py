"""bucket_low_rank_factors: one all_reduce per round of PowerSGD factors, not one per parameter.

Compiled DDP with :func:`compiled_hooks.powersgd.powerSGD_hook` computes, per compressed
gradient ``M``, ``P = M @ Q`` and all_reduces it, orthogonalizes P, computes ``Q = M.T @ P``
and all_reduces that: two tiny collectives per parameter, each paying a collective's fixed
cost, and so does the plain all_reduce of every gradient it does not compress (a bias). This
pass merges them the way the original hook does per bucket: every all_reduce of a matrix
product (``mm``) is a candidate, and so is, in a graph that has such products, every
all_reduce of a gradient that PowerSGD's counting op (``compiled_hooks::powersgd_count``)
also reads. Candidates of the same kind (group, reduce op, dtype, device) at the same
*round* share a bucket, up to ``factor_bucket_cap_mb`` of bytes. The round of a candidate is
the number of candidates on the longest dependency path into it (the P and the uncompressed
all_reduces are round 0, the Q all_reduces round 1), so the members of a bucket never depend
on each other. For two parameters::

    before                                     after
    p1 = mm(m1, q1)                            p1 = mm(m1, q1)
    w1 = wait(all_reduce(p1, sum))             p2 = mm(m2, q2)
    ... orthogonalize(w1) -> Q1 ...            flat = cat([reshape(p1, [-1]), reshape(p2, [-1])])
    p2 = mm(m2, q2)                            w = wait(all_reduce(flat, sum))
    w2 = wait(all_reduce(p2, sum))             w1, w2 = views of split_with_sizes(w, [n1, n2])
    ... orthogonalize(w2) -> Q2 ...            ... orthogonalize(w1), orthogonalize(w2) ...

Each bucket is issued right after its last member's input; whatever used a member's result
moves after the bucket's wait (a stable topological sort, which keeps every other node's
order). Buckets are issued in the order of their last input, a function of the graph alone,
so every rank issues the same collectives in the same order. Members are left alone when
their chain has anything before the collective (a cast, a scale), a problem, or a group passed
as a graph input. Idempotent: a bucket's input is a ``cat``, not a product.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.fx import Graph, Node

from compiled_hooks.graph_contract import POWERSGD_COUNT

from .core.chains import Chain, match_chain
from .core.interface import graph_pass
from .core.marks import check_graph, is_op
from .core.ops import ALL_REDUCE, WAIT, arg, aten, val
from .core.record import record
from .core.values import flat_value, new_node, piece_of, split_node

__all__ = ["bucket_low_rank_factors", "Options"]

PASS = "bucket_low_rank_factors"
MM_OPS = (aten.mm.default,)


def _factor(node: Node) -> bool:
    """An all_reduce of a matrix product."""
    return node.target is ALL_REDUCE and is_op(node.args[0], MM_OPS)


def _counted(node: Node) -> bool:
    """An all_reduce of a gradient that PowerSGD counted (one it averages uncompressed)."""
    return node.target is ALL_REDUCE and any(is_op(u, (POWERSGD_COUNT,)) for u in arg(node).users)


def _candidates(graph: Graph) -> dict[Node, Chain]:
    """The factor all_reduces, and with them PowerSGD's uncompressed ones; none in a graph
    without factors (PowerSGD before ``start_powerSGD_iter``: its full gradients keep their
    own collectives, issued as each gradient is ready). A cheap scan first: most graphs have
    no product feeding an all_reduce, and matching chains costs more."""
    found = [
        n
        for n in graph.find_nodes(op="call_function", target=ALL_REDUCE)
        if _factor(n) or _counted(n)
    ]
    if not any(_factor(n) for n in found):
        return {}
    out = {}
    for node in found:
        chain = match_chain(node)
        if (
            chain is not None
            and not chain.pre
            and chain.problem is None
            and isinstance(chain.group_name, str)
            and isinstance(val(node), torch.Tensor)
        ):
            out[node] = chain
    return out


def _key(chain: Chain) -> tuple[Any, ...]:
    return (chain.group_name, chain.reduce_op, chain.wire_dtype, val(chain.collective).device)


def _rounds(graph: Graph, candidates: dict[Node, Chain]) -> dict[Node, int]:
    """Round of every candidate collective: one walk, each node labelled with the number of
    candidates on the longest path into it."""
    depth: dict[Node, int] = {}
    rounds = {}
    for node in graph.nodes:
        d = max((depth.get(i, 0) for i in node.all_input_nodes), default=0)
        if node in candidates:
            rounds[node] = d
            d += 1
        depth[node] = d
    return rounds


def _merge(graph: Graph, bucket: list[Chain], order: dict[Node, int]) -> None:
    anchor = max((c.start for c in bucket), key=order.__getitem__)
    where = anchor.next
    with graph.inserting_before(where):
        flats = [new_node(graph, aten.reshape.default, (c.start, [-1])) for c in bucket]
        numels = [val(f).numel() for f in flats]
        flat = new_node(
            graph,
            aten.cat.default,
            (flats, 0),
            name="factor_cat",
            value=flat_value(val(flats[0]), sum(numels)),
        )
        coll = new_node(
            graph, ALL_REDUCE, (flat, *bucket[0].collective.args[1:]), name="factor_all_reduce"
        )
        wait = new_node(graph, WAIT, (coll,), name="factor_wait")
        pieces = split_node(graph, wait, numels, "factor_pieces")
        for i, c in enumerate(bucket):
            c.wait.replace_all_uses_with(piece_of(graph, pieces, i, list(val(c.collective).shape)))
    for c in bucket:
        graph.erase_node(c.wait)
        graph.erase_node(c.collective)
    record(PASS, f"bucketed {len(bucket)} factor all_reduces into one", coll)


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of :func:`bucket_low_rank_factors`."""

    factor_bucket_cap_mb: float = 25.0
    """Cap of one bucket of factor all_reduces, in MiB."""


@graph_pass(options=Options)
def bucket_low_rank_factors(graph: Graph, factor_bucket_cap_mb: float = 25.0) -> bool:
    """Bucket the all_reduces of matrix products by round (see the module docstring).
    Returns True when the graph changed."""
    check_graph(PASS, graph)
    if not factor_bucket_cap_mb > 0:
        raise ValueError(
            f"{PASS}: factor_bucket_cap_mb must be positive, got {factor_bucket_cap_mb}"
        )
    candidates = _candidates(graph)
    if len(candidates) < 2:
        return False
    rounds = _rounds(graph, candidates)
    cap = factor_bucket_cap_mb * 2**20
    open_buckets: dict[tuple, list] = {}  # (round, kind) -> [members, bytes]
    buckets: list[list[Chain]] = []
    for node, chain in candidates.items():  # graph order
        nbytes = val(node).numel() * val(node).element_size()
        entry = open_buckets.setdefault((rounds[node], *_key(chain)), [[], 0])
        if entry[0] and entry[1] + nbytes > cap:
            buckets.append(entry[0])
            entry[0], entry[1] = [], 0
        entry[0].append(chain)
        entry[1] += nbytes
    buckets += [members for members, _ in open_buckets.values()]
    buckets = [b for b in buckets if len(b) > 1]
    if not buckets:
        return False
    order = {n: i for i, n in enumerate(graph.nodes)}
    for bucket in buckets:
        _merge(graph, bucket, order)
    stable_topological_sort(graph)
    return True
