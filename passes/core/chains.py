"""What the passes share: op sets, chain matching around a collective, the
data_parallel block marks, bookkeeping.

A *chain* is what a comm hook puts around one collective in the post-grad graph::

    start -> [scale | cast | view]* -> COLLECTIVE -> wait_tensor -> [scale | cast | view]* -> end

``scale`` is a multiplication or division by a Python number, ``cast`` a floating dtype
conversion, ``view`` a reshape. Every node strictly between ``start`` and ``end`` has exactly
one user (the next node of the chain), so a pass may rewrite the inside of a chain without
any other node seeing a different value. ``end`` (the last post node, or the wait) may have
any users.
"""

from __future__ import annotations

import dataclasses
import functools
from fractions import Fraction
from typing import Any, cast

import torch
from torch.fx import Graph, Node

from .marks import calls, check_graph, is_op
from .ops import CAST_OPS, COLLECTIVES, MUL_OPS, SCALE_OPS, VIEW_OPS, WAIT, arg, prims, val
from .record import record


def scale_factor(node: Node) -> Fraction | None:
    """The exact factor ``node`` multiplies its first argument by, or None if it is no
    constant scale (a tensor factor, a rounding mode, a non-finite or zero factor)."""
    if not is_op(node, SCALE_OPS) or node.kwargs or len(node.args) != 2:
        return None
    c = node.args[1]
    if (
        isinstance(c, bool)
        or not isinstance(c, (int, float))
        or c == 0
        or c != c
        or abs(c) == float("inf")
    ):
        return None
    return _factor(c, node.target in MUL_OPS)


@functools.lru_cache(maxsize=1024)
def _factor(c: float, multiplies: bool) -> Fraction:
    """A graph's scales repeat a few constants: each Fraction is made once."""
    return Fraction(c) if multiplies else 1 / Fraction(c)


def is_scale(node: Any) -> bool:
    return is_op(node, SCALE_OPS)


def cast_dtype(node: Node) -> torch.dtype | None:
    """Target dtype of a pure floating dtype conversion, else None."""
    if not is_op(node, CAST_OPS):
        return None
    if node.target is prims.convert_element_type.default:
        dtype = node.args[1]
    else:
        if set(node.kwargs) - {"dtype"} or len(node.args) != 1:
            return None  # also changes device, layout or memory format
        dtype = node.kwargs.get("dtype")
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


_CHAIN_TARGETS = SCALE_OPS + VIEW_OPS  # a tuple: an op's hash is a Python call, == is not


def is_chain_op(node: Any) -> bool:
    if not isinstance(node, Node) or node.op != "call_function":
        return False
    return node.target in _CHAIN_TARGETS or cast_dtype(node) is not None


@dataclasses.dataclass
class Chain:
    """One collective and the hook ops around it (see the module docstring)."""

    collective: Node
    wait: Node
    start: Node  # the value the hook started from
    pre: list[Node]  # start -> ... -> collective input, in data-flow order
    post: list[Node]  # wait -> ... -> end, in data-flow order (wait excluded)
    factors: tuple  # scale_factor() of each of scales(), in order (None for a non-constant one)
    problem: str | None = None  # why the chain must not be rewritten

    @property
    def end(self) -> Node:
        return self.post[-1] if self.post else self.wait

    @property
    def reduce_op(self) -> str:
        return cast(str, self.collective.args[1])

    @property
    def group_name(self) -> Any:
        return self.collective.args[-1]

    @property
    def wire_dtype(self) -> torch.dtype:
        return val(self.collective.args[0]).dtype

    def scales(self) -> list[Node]:
        return [n for n in self.pre + self.post if is_scale(n)]


def match_chain(collective: Node) -> Chain | None:
    """The chain around ``collective``; None if it is not a single-wait functional collective."""
    if not is_op(collective, COLLECTIVES) or len(collective.users) != 1:
        return None
    (wait,) = collective.users
    if not is_op(wait, (WAIT,)):
        return None
    problem = None

    pre: list[Node] = []
    node = arg(collective)
    while is_chain_op(node) and len(node.users) == 1:
        pre.append(node)
        node = arg(node)
    if is_scale(node) or cast_dtype(node) is not None:
        problem = f"intermediate {node.name} has another user"
    pre.reverse()
    start = node

    post: list[Node] = []
    node = wait
    while len(node.users) == 1:
        (user,) = node.users
        if not (is_chain_op(user) and user.args[0] is node):
            break
        post.append(user)
        node = user
    if len(node.users) > 1 and any(is_scale(u) for u in node.users):
        problem = problem or f"intermediate {node.name} has another user"
    factors = []
    for n in pre + post:
        if n.target in SCALE_OPS:
            factor = scale_factor(n)
            if factor is None:
                problem = problem or f"non-constant factor at {n.name}"
            factors.append(factor)
    return Chain(collective, wait, start, pre, post, tuple(factors), problem)


def chains(graph: Graph, pass_name: str) -> list[Chain]:
    """Every matched chain, in graph order of the collectives. Collectives without fake-tensor
    metadata (a graph not traced the way Inductor traces) are skipped and counted."""
    check_graph(pass_name, graph)
    out = []
    for node in calls(graph, COLLECTIVES):
        chain = match_chain(node)
        if chain is None:
            continue
        if not all(
            isinstance(val(n), torch.Tensor) for n in (chain.collective, chain.collective.args[0])
        ):
            record(pass_name, "skipped: no fake-tensor metadata (meta['val'])", node)
            continue
        out.append(chain)
    return out
