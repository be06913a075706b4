"""What the bucketing passes share: which collectives are compressed, when a bucket's prologue
can move into its members, and merging a bucket of collective chains into one collective."""

from __future__ import annotations

from typing import cast

from torch.fx import Graph, Node

from .chains import Chain, cast_dtype, chains, scale_factor
from .marks import is_op
from .ops import ALL_REDUCE, BUCKET_PACK, REDUCE_SCATTER, VIEW_OPS, WAIT, aten, val
from .record import record
from .values import flat_value, new_node, piece_of, split_node

DERIVED_BUCKETS, MIN_CAP_MB, MAX_CAP_MB = 4, 2.0, 25.0


def derived_cap(total_bytes: int, floor_mb: float = MIN_CAP_MB) -> float:
    """A bucket cap in bytes for collectives of ``total_bytes`` in all: a quarter of them,
    between ``floor_mb`` and ``MAX_CAP_MB`` (DDP's default). Traffic starts only once the
    first bucket is full, and the last bucket's wire time is exposed after its last member, so
    about four buckets keep the link busy from early on while a bandwidth-bound step waits
    only for the last quarter; the floor keeps each collective's fixed cost small against its
    wire time."""
    return min(max(total_bytes / DERIVED_BUCKETS, floor_mb * 2**20), MAX_CAP_MB * 2**20)


def is_compressed(chain: Chain) -> bool:
    """Whether the last cast before ``chain``'s collective narrows the dtype (fp32 -> bf16)."""
    for n in reversed(chain.pre):
        dtype = cast_dtype(n)
        if dtype is not None:
            return dtype.itemsize < val(n.args[0]).dtype.itemsize
    return False


def compressed_collectives(graph: Graph, pass_name: str) -> set[Node]:
    """The all_reduce / reduce_scatter collectives fed by a narrowing cast: a superset of what
    ``bucket_compressed_collectives`` buckets (its candidates must also be free of problems)."""
    return {chain.collective for chain in chains(graph, pass_name) if is_compressed(chain)}


def cat_prologue_problem(cat: Node, pre: list[Node]) -> str | None:
    """Why the ops ``pre`` after a bucket's ``cat`` cannot move into its members (None: they
    can)."""
    if len(cat.users) != 1:
        return "the cat has another user"
    if any(not hasattr(val(m), "dim") or val(m).dim() != 1 for m in cast(list, cat.args[0])):
        return "a member is not 1-D"  # so the cat is along dim 0 (or -1, the same)
    for n in pre:
        if not (scale_factor(n) is not None or cast_dtype(n) is not None or is_op(n, VIEW_OPS)):
            return f"{n.name} is not a constant scale, cast or view"
        if val(n).dim() != 1:
            return f"{n.name} is not 1-D"
    return None


def merge_chains(
    pass_name: str,
    graph: Graph,
    bucket: list[Chain],
    order: dict[Node, int],
    moved: set[Node],
    packed: bool = False,
) -> Node | None:
    """Merge one bucket of all_reduce or reduce_scatter chains into one collective of a ``cat``:
    every member's pre-collective ops move next to the ``cat`` (one copy-in), and its
    post-collective ops read its piece of the result (one copy-out); a reduce_scatter bucket is
    laid out rank-major (``cat`` of ``[N, -1]`` views along dim 1). ``packed``: the copy-in is
    one ``bucket_pack`` call (:mod:`compiled_hooks.bucket_copies`) instead, which Inductor does
    not compile; the members' pre-collective ops stay kernels of their own. The bucket goes out
    right after its last member's input is ready and is waited right before the first use of any
    member's result. Returns the bucket's collective, which carries the first member's
    ``meta["custom"]``; None (and counted) if a member's result is used before that input.

    ``order`` numbers the graph's nodes as it was before any merge; nodes an earlier merge moved
    are in ``moved``, and only if this bucket's anchors or uses are among them is the graph
    numbered again."""
    users = [u for c in bucket for u in c.end.users]
    if moved.intersection(users) or moved.intersection(c.start for c in bucket):
        order.clear()
        order.update((n, i) for i, n in enumerate(graph.nodes))
        moved.clear()
    moving = {n for c in bucket for n in c.pre + [c.collective, c.wait]}
    anchor = max((c.start for c in bucket), key=order.__getitem__)
    first_use = min(users, key=order.__getitem__)
    if order[first_use] <= order[anchor]:
        record(
            pass_name,
            "skipped bucket: a member's result is used before its last input is ready",
            first_use,
        )
        return None

    insert_before = anchor.next
    while insert_before in moving or insert_before.op == "placeholder":
        insert_before = insert_before.next
    rs = bucket[0].collective.target is REDUCE_SCATTER
    group_size = bucket[0].collective.args[2] if rs else None

    flats = []
    for c in bucket:
        for n in c.pre:
            insert_before.prepend(n)
            moved.add(n)
        inp = c.collective.args[0]
        if not packed and (rs or val(inp).dim() != 1):  # a 1-D all_reduce input is already flat
            with graph.inserting_before(insert_before):
                inp = new_node(graph, aten.reshape.default, (inp, [group_size, -1] if rs else [-1]))
        flats.append(inp)
    with graph.inserting_before(insert_before):
        if packed:
            rows = group_size if rs else 1
            flat = new_node(graph, BUCKET_PACK, (flats, rows), name="bucket_pack")
        else:
            flat_val = None if rs else flat_value(val(flats[0]), sum(val(f).numel() for f in flats))
            flat = new_node(
                graph, aten.cat.default, (flats, 1 if rs else 0), name="bucket_cat", value=flat_val
            )
            if rs:
                flat = new_node(graph, aten.reshape.default, (flat, [-1]))
        rest = bucket[0].collective.args[1:]
        target = REDUCE_SCATTER if rs else ALL_REDUCE
        coll = new_node(
            graph, target, (flat, *rest), name="bucket_" + target._schema.name.split("::")[-1]
        )
        if "custom" in bucket[0].collective.meta:
            coll.meta["custom"] = dict(bucket[0].collective.meta["custom"])

    # the pieces and the members' post-collective ops, in bucket order, right before first_use
    with graph.inserting_before(first_use):
        wait = new_node(graph, WAIT, (coll,), name="bucket_wait")
        sizes = [val(c.collective).numel() for c in bucket]
        pieces = split_node(graph, wait, sizes, "bucket_pieces")
        for i, c in enumerate(bucket):
            out = val(c.collective)
            piece = piece_of(graph, pieces, i, list(out.shape) if out.dim() != 1 else None)
            c.wait.replace_all_uses_with(piece)
            for n in c.post:
                first_use.prepend(n)
                moved.add(n)
            graph.erase_node(c.wait)
            graph.erase_node(c.collective)
    record(pass_name, f"bucketed {len(bucket)} collectives into one", coll)
    return coll
