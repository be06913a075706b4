"""fuse_cat_prologue: a bucket's scales and casts move into the members of its ``cat``.

A hook that receives a bucket already packed (the ZeRO hooks' ``cat`` of gradients, a user's
own flat bucket) divides and casts the whole flat tensor before the collective. Inductor then
writes the members into the ``cat`` buffer, reads it back in a second kernel for the scale, and
writes a third buffer: a full pass over the bucket, as much memory traffic as the compiled
AdamW arithmetic over all its parameters. Elementwise ops commute with
concatenation, so the pass applies them to each member instead; Inductor fuses each into the
kernel that writes the member into the bucket, and the collective reads the ``cat`` itself::

    before                                   after
    flat = cat([a, b])                       sa = div(a, 2.0)
    d = div(flat, 2.0)                       sb = div(b, 2.0)
    c = convert_element_type(d, bf16)        ca = convert_element_type(sa, bf16)
    r = all_reduce(c, "sum", group)          cb = convert_element_type(sb, bf16)
                                             r = all_reduce(cat([ca, cb]), "sum", group)

Matched: an ``all_reduce`` / ``reduce_scatter_tensor`` whose input chain (``passes.core.chains``)
starts at a ``cat`` along dim 0 of 1-D tensors that nothing else reads, through constant
scales, floating casts and 1-D views only. Anything else is left alone. Values are bitwise
the same (the same op on every element). Idempotent: afterwards the collective reads the
``cat``, with no chain in between. Run after ``fold_collective_scaling`` (it merges the
factors first) and after ``bucket_compressed_collectives`` (it keeps seeing single compressed
collectives as such).
"""

from __future__ import annotations

from typing import cast

from torch.fx import Graph

from .core.bucket import cat_prologue_problem
from .core.chains import chains
from .core.interface import graph_pass
from .core.marks import is_op
from .core.ops import VIEW_OPS, arg, aten, val
from .core.record import record
from .core.values import flat_value, new_node, reapply

__all__ = ["fuse_cat_prologue"]

PASS = "fuse_cat_prologue"


@graph_pass(after=("fold_collective_scaling", "bucket_compressed_collectives"))
def fuse_cat_prologue(graph: Graph) -> bool:
    """Move the scales and casts between a bucket's ``cat`` and its collective into the
    members (see the module docstring). Returns True when the graph changed."""
    changed = False
    for chain in chains(graph, PASS):
        cat = chain.start
        if not chain.pre or not is_op(cat, (aten.cat.default,)):  # the common case: not counted
            continue
        reason = cat_prologue_problem(cat, chain.pre)
        if reason is not None:
            record(PASS, f"skipped: {reason}", chain.collective)
            continue
        with graph.inserting_before(chain.collective):  # 1-D views of a 1-D tensor: identities
            members = [reapply(graph, m, chain.pre) for m in cast(list, cat.args[0])]
            total = sum(val(m).numel() for m in members)
            flat = new_node(
                graph, aten.cat.default, (members,), value=flat_value(val(members[0]), total)
            )
        chain.collective.replace_input_with(arg(chain.collective), flat)
        for n in reversed([cat, *chain.pre]):
            graph.erase_node(n)
        moved = sum(not is_op(n, VIEW_OPS) for n in chain.pre)
        record(PASS, f"moved {moved} op(s) into the cat's members", chain.collective)
        changed = True
    return changed
