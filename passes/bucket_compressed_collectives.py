"""bucket_compressed_collectives: bucket compressed collectives, casts and scales inside the bucket.

Compiled DDP with a compression hook issues one small collective per parameter: Inductor's
``ddp_fusion`` only buckets all_reduces fed by a plain division. This pass buckets the
compressed ones (the collective's input is a cast to a narrower float dtype) per
(collective, group, reduce op, wire dtype), adjacent in collective order (any other collective
in between separates them), up to ``bucket_cap_mb`` of wire bytes; the first bucket goes out
as soon as it holds ``first_bucket_cap_mb`` (DDP's rule), so a gradient larger than that cap
goes out in it.
The default cap (``bucket_cap_mb=None``) is derived from the graph: a quarter of the wire
bytes of the candidates of that kind, between 2 MB and 25 MB (DDP's default)
(:func:`passes.core.bucket.derived_cap`), so a small model gets one to three buckets.

For two gradients ``a`` and ``b`` (after ``fold_collective_scaling``)::

    before                                     after
    ca = convert_element_type(a, bf16)         ca = convert_element_type(a, bf16)
    ra = all_reduce(ca, "avg", group)          cb = convert_element_type(b, bf16)
    wa = wait_tensor(ra)                       flat = cat([reshape(ca, [-1]), reshape(cb, [-1])])
    oa = convert_element_type(wa, f32)         r = all_reduce(flat, "avg", group)
    cb = convert_element_type(b, bf16)         ...                # rest of backward overlaps
    rb = all_reduce(cb, "avg", group)          w = wait_tensor(r)
    wb = wait_tensor(rb)                       pieces = split_with_sizes(w, [na, nb])
    ob = convert_element_type(wb, f32)         oa = convert_element_type(view(pieces[0], sa), f32)
    copy_(ga, oa); copy_(gb, ob)               ob = convert_element_type(view(pieces[1], sb), f32)
                                               copy_(ga, oa); copy_(gb, ob)

Every member's pre-collective ops (scales, casts, views) move next to the ``cat``, so Inductor
computes them straight into the flat buffer (one copy-in); every member's post-collective
ops read its piece of the bucket, so the decompress is fused into the copy-out. The bucket is
issued right after its last member's input is ready, and waited right before the first use of
any member's result, so it overlaps with the rest of the graph. A reduce_scatter bucket lays
members out rank-major, so each rank's shard holds its shard of every member. Linear in the
graph's nodes. A ``data_parallel`` block's reduce-scatters are left to its own pass.

Collective order stays a function of the graph alone (buckets follow graph order), so every
rank issues the same collectives in the same order. Idempotent: a bucket's input is a ``cat``,
not a cast, so it is never a candidate again. Members are left alone when their chain has a
non-constant factor or a shared intermediate, and a bucket is dropped when a member's result
is used before the bucket's last input is ready; both are counted in ``counters["passes"]``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.fx import Graph, Node

from .core.bucket import derived_cap, is_compressed, merge_chains
from .core.chains import Chain, chains
from .core.interface import graph_pass
from .core.marks import block_of, check_graph, is_collective
from .core.ops import val
from .core.record import record

__all__ = ["bucket_compressed_collectives", "Options"]

PASS = "bucket_compressed_collectives"


def _key(chain: Chain) -> tuple[Any, ...]:
    return (
        chain.collective.target,
        chain.group_name,
        chain.reduce_op,
        chain.wire_dtype,
        val(chain.collective).device,
    )


def _wire_bytes(chain: Chain) -> int:
    inp = val(chain.collective.args[0])
    return inp.numel() * inp.element_size()


def _caps(
    nbytes: dict[Node, int], keys: dict[Node, tuple], cap_mb: float | None
) -> dict[tuple, float]:
    """Bucket cap in bytes per key: ``cap_mb``, or derived (see the module docstring)."""
    total: dict[tuple, int] = {}
    for node, n in nbytes.items():
        total[keys[node]] = total.get(keys[node], 0) + n
    if cap_mb is not None:
        return {k: cap_mb * 2**20 for k in total}
    return {k: derived_cap(t) for k, t in total.items()}


def _buckets(
    graph: Graph,
    candidates: dict[Node, Chain],
    keys: dict[Node, tuple],
    nbytes: dict[Node, int],
    caps: dict[tuple, float],
    first_cap_mb: float,
) -> list[list[Chain]]:
    """Greedy in collective order: a bucket takes the next collective while it is a candidate
    of the same key, the wire bytes fit the cap and it does not depend on a member's result.
    The first bucket instead closes as soon as it holds ``first_cap_mb`` (DDP's rule), so a
    gradient larger than that cap goes out in it, as early as backward produces it, instead of
    waiting for the next bucket to fill.
    Any other collective in between ends the bucket, so the pass never reorders collectives
    relative to each other and a second run finds nothing left to merge.

    One pass over the graph: every node is labelled with the latest candidate (by graph order)
    it depends on. Members of a bucket are consecutive candidates, so a candidate depends on a
    member exactly when its input's label is at least the first member's.

    (Inductor's ``greedy_bucket_collective_by_mb`` would do, but in torch 2.13 it applies the
    first bucket's cap to every bucket.)
    """
    buckets: list[list[Chain]] = []
    current: list[Chain] = []
    # Bytes in the current bucket, and its number: bucket 0 gets the first cap. Every close
    # counts, also at a non-candidate collective with nothing open, so that a second run, where
    # a first run's bucket stands as such a collective, numbers and caps exactly as the first.
    size = index = 0
    latest: dict[Node, int] = {}  # node -> index of the latest candidate it depends on
    first_member = count = 0

    def close() -> None:
        nonlocal current, size, index
        if len(current) > 1:
            buckets.append(current)
        current, size, index = [], 0, index + 1

    label = latest.get
    for node in graph.nodes:
        depends_on = -1
        for i in node.all_input_nodes:
            depends_on = max(depends_on, label(i, -1))
        chain = candidates.get(node)
        if chain is None:
            if depends_on >= 0:  # absent reads as -1
                latest[node] = depends_on
            if is_collective(node):  # only adjacent candidates share a bucket
                close()
            continue
        full = index > 0 and size + nbytes[node] > caps[keys[node]]
        if current and (
            keys[node] != keys[current[0].collective] or depends_on >= first_member or full
        ):
            close()
        if not current:
            first_member = count
        current.append(chain)
        size += nbytes[node]
        latest[node] = count
        count += 1
        if index == 0 and size >= first_cap_mb * 2**20:
            close()  # DDP's rule for the first bucket: it goes out once it holds the first cap
    close()
    return buckets


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of :func:`bucket_compressed_collectives`."""

    bucket_cap_mb: float | None = None
    """Cap of one bucket in MiB; None derives it from the graph's compressed bytes."""
    first_bucket_cap_mb: float = 1.0
    """Cap of the first bucket in MiB, so the wire starts early."""


@graph_pass(
    options=Options,
    after=(
        "fold_collective_scaling",
        "shard_weight_update",
        "all_to_all_weight_update",
    ),
)
def bucket_compressed_collectives(
    graph: Graph, bucket_cap_mb: float | None = None, first_bucket_cap_mb: float = 1.0
) -> bool:
    """Bucket compressed all_reduce / reduce_scatter chains (see the module docstring).
    Returns True when the graph changed."""
    check_graph(PASS, graph)
    if (bucket_cap_mb is not None and bucket_cap_mb <= 0) or first_bucket_cap_mb <= 0:
        raise ValueError(
            f"{PASS}: bucket caps must be positive, got {bucket_cap_mb}, {first_bucket_cap_mb}"
        )
    candidates: dict[Node, Chain] = {}
    for chain in chains(graph, PASS):
        # data_parallel's: per block
        if not is_compressed(chain) or block_of(chain.collective) is not None:
            continue
        if chain.problem:
            record(PASS, f"skipped: {chain.problem}", chain.collective)
            continue
        if not isinstance(chain.group_name, str):
            record(PASS, "skipped: group passed as a graph input", chain.collective)
            continue
        candidates[chain.collective] = chain
    if len(candidates) < 2:
        return False

    keys = {node: _key(chain) for node, chain in candidates.items()}
    nbytes = {node: _wire_bytes(chain) for node, chain in candidates.items()}
    caps = _caps(nbytes, keys, bucket_cap_mb)
    buckets = _buckets(graph, candidates, keys, nbytes, caps, first_bucket_cap_mb)
    order = {n: i for i, n in enumerate(graph.nodes)}
    moved: set[Node] = set()
    changed = False
    for bucket in buckets:
        changed |= merge_chains(PASS, graph, bucket, order, moved) is not None
    return changed
