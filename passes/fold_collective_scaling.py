"""fold_collective_scaling: move a hook's constant divisions into the collective.

The comm hooks average in two steps (divide by ``pre`` before the sum, by ``post`` after it)
to keep fp16 from overflowing. For bf16 and fp32 that split only costs two pointwise passes
over every gradient: the collective can average by itself (reduce op ``avg``).

Pattern (a chain, see ``passes.core.chains``), on a group of size N, wire dtype not fp16::

    before                                    after (product of factors == 1/N)
    d = div(g, 4.0)                           c = convert_element_type(g, bf16)
    c = convert_element_type(d, bf16)         r = all_reduce(c, "avg", group)
    r = all_reduce(c, "sum", group)           w = wait_tensor(r)
    w = wait_tensor(r)                        o = convert_element_type(w, f32)
    e = div(w, 2.0)
    o = convert_element_type(e, f32)

Other constant products ``s`` (a loss scale, a gradient-accumulation factor...) with two or
more factors become one ``mul(g, s)`` before the first cast, where Inductor fuses it into the
cast's kernel; a product of exactly 1 removes the factors. The same holds for
``reduce_scatter_tensor``.

Left alone (counted in ``counters["passes"]`` with the reason): a reduce op other than sum,
an fp16 wire dtype (the split guards against overflow), a non-constant factor, an
intermediate with another user, a chain that starts or ends at another collective (its
factors may belong to the other group), a group that cannot be resolved or whose size
disagrees, a single factor unless it is 1/N on an ``avg_backends`` group (nothing to merge:
on gloo a hook's single pre-division already sits in the cast's kernel).
``avg`` is used only on ``avg_backends`` (those that average inside the collective, not gloo:
see ``passes.core.groups.AVG_BACKENDS``) and never at world size 1 (NCCL's avg is wrong there; at
N == 1 the product is 1 and the factors simply go). Idempotent: a folded chain has reduce op
avg, or a single factor.

Numerics: exact when all factors are powers of two (every division by a power of two is
exact, and so is the rounding of a sum scaled by one); otherwise within one rounding of the
wire dtype, with one rounding fewer than before.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection
from fractions import Fraction

import torch
from torch.fx import Graph

from .core.chains import Chain, chains
from .core.groups import AVG_BACKENDS, GroupInfo, group_info
from .core.interface import graph_pass
from .core.marks import is_op
from .core.ops import COLLECTIVES, REDUCE_SCATTER, WAIT, aten
from .core.record import record
from .core.values import new_node

__all__ = ["fold_collective_scaling", "Options"]

PASS = "fold_collective_scaling"
FOLDABLE_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _why_not(chain: Chain, info: GroupInfo | None) -> str | None:
    if chain.reduce_op != "sum":
        return f"reduce op {chain.reduce_op!r} (only 'sum' is folded)"
    if chain.problem:
        return chain.problem
    if is_op(chain.start, (WAIT,)) or any(is_op(u, COLLECTIVES) for u in chain.end.users):
        return "chained with another collective (factors may belong to another group)"
    if chain.wire_dtype == torch.float16:
        return "fp16 wire dtype keeps its pre/post split (overflow)"
    if chain.wire_dtype not in FOLDABLE_WIRE_DTYPES:
        return f"wire dtype {chain.wire_dtype}"
    if info is None:
        return f"unknown process group {chain.group_name!r}"
    if chain.collective.target is REDUCE_SCATTER and chain.collective.args[2] != info.size:
        size = chain.collective.args[2]
        return f"group size {size} != size of group {chain.group_name!r} ({info.size})"
    return None


def _remove(graph: Graph, node) -> None:
    node.replace_all_uses_with(node.args[0])
    graph.erase_node(node)


@functools.lru_cache(maxsize=256)
def _product(factors: tuple[Fraction, ...]) -> Fraction:
    """A graph's chains repeat a few factor lists (one per hook): each product is made once."""
    product = Fraction(1)
    for f in factors:
        product *= f
    if float(product) == 1.0:  # e.g. * 3 then * 0.333...: a scale of 1.0 would be a no-op
        product = Fraction(1)
    return product


def _fold(
    graph: Graph, chain: Chain, scales: list, info: GroupInfo, avg_backends: Collection[str]
) -> bool:
    product = _product(chain.factors)
    to_avg = info.size > 1 and product == Fraction(1, info.size) and info.backend in avg_backends
    if product != 1 and not to_avg and len(scales) < 2:
        record(PASS, "skipped: a single factor, nothing to fold", chain.collective)
        return False
    for n in scales:
        _remove(graph, n)
    if product == 1:
        record(PASS, "removed factors with product 1", chain.collective)
    elif to_avg:
        args = list(chain.collective.args)
        args[1] = "avg"
        chain.collective.args = tuple(args)
        record(PASS, "folded factors into reduce op avg", chain.collective)
    else:
        first = next((n for n in chain.pre if n not in scales), chain.collective)
        with graph.inserting_before(first):
            mul = new_node(
                graph, aten.mul.Tensor, (chain.start, float(product)), name="folded_scale"
            )
        first.replace_input_with(chain.start, mul)
        record(PASS, "merged factors into one scale", chain.collective)
    return True


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of :func:`fold_collective_scaling`."""

    avg_backends: Collection[str] = AVG_BACKENDS
    """Backends trusted with reduce op avg (the factors fold into the collective there)."""


@graph_pass(options=Options)
def fold_collective_scaling(graph: Graph, avg_backends: Collection[str] = AVG_BACKENDS) -> bool:
    """Fold constant factors around sum all_reduce / reduce_scatter (see the module docstring).
    ``avg_backends``: backends trusted with reduce op avg. Returns True when the graph changed."""
    changed = False
    infos: dict = {}  # group name -> GroupInfo, looked up once per graph
    for chain in chains(graph, PASS):
        scales = chain.scales()
        if not scales:
            continue
        name = chain.group_name
        if name not in infos:
            infos[name] = group_info(name)
        reason = _why_not(chain, infos[name])
        if reason is not None:
            record(PASS, f"skipped: {reason}", chain.collective)
            continue
        changed |= _fold(graph, chain, scales, infos[name], avg_backends)
    return changed
