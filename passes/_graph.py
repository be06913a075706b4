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
import logging
import weakref
from fractions import Fraction
from typing import Any, cast

import torch
from torch._dynamo.utils import counters
from torch.fx import Graph, Node

from compiled_hooks.graph_contract import BLOCK, INT8

log = logging.getLogger("passes")

aten, prims = torch.ops.aten, torch.ops.prims
c10d_ops = torch.ops._c10d_functional

ALL_REDUCE = c10d_ops.all_reduce.default
REDUCE_SCATTER = c10d_ops.reduce_scatter_tensor.default
ALL_GATHER = c10d_ops.all_gather_into_tensor.default
BROADCAST = c10d_ops.broadcast.default
BROADCAST_ = c10d_ops.broadcast_.default  # in place (reinplace_broadcasts)
ALL_TO_ALL = c10d_ops.all_to_all_single.default
WAIT = c10d_ops.wait_tensor.default
COLLECTIVES = (ALL_REDUCE, REDUCE_SCATTER)

MUL_OPS = (aten.mul.Tensor, aten.mul.Scalar)
DIV_OPS = (aten.div.Tensor, aten.div.Scalar)
CAST_OPS = (prims.convert_element_type.default, aten._to_copy.default)
VIEW_OPS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
SCALE_OPS = MUL_OPS + DIV_OPS


def record(pass_name: str, event: str, node: Node | None = None) -> None:
    """Count ``event`` in ``counters["passes"]`` and log it (logger ``passes``, DEBUG)."""
    counters["passes"][f"{pass_name}: {event}"] += 1
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s: %s%s", pass_name, event, f" at {node.name}" if node is not None else "")


def is_op(node: Any, ops: tuple) -> bool:
    """``node`` calls one of ``ops``; a collective or wait of another parallelism never matches
    (see :func:`foreign`)."""
    return (
        isinstance(node, Node)
        and node.op == "call_function"
        and node.target in ops
        and not foreign(node)
    )


def is_collective(node: Any) -> bool:
    """Any functional collective (not its wait) but another parallelism's (:func:`foreign`)."""
    return (
        isinstance(node, Node)
        and node.op == "call_function"
        and getattr(node.target, "namespace", None) == "_c10d_functional"
        and node.target is not WAIT
        and not foreign(node)
    )


def foreign(node: Node) -> bool:
    """Whether ``node``, a collective or a wait, belongs to another parallelism: in a
    ``data_parallel`` graph (one with collectives marked with a block), a collective on a
    process group that no marked collective uses, such as tensor parallelism's DTensor
    collectives. No pass matches these; to the passes they are nodes with side effects."""
    if getattr(node.target, "namespace", None) != "_c10d_functional":
        return False
    groups = _marks(node.graph).foreign
    if not groups:
        return False
    source = node.args[0] if node.target is WAIT and node.args else node
    return isinstance(source, Node) and _group(source) in groups


def _group(collective: Node) -> Any:
    return collective.args[-1] if collective.args else None


@dataclasses.dataclass(frozen=True)
class _Marks:
    """What a graph's collectives are marked with, read the first time a pass sees the graph
    (:func:`check_graph`), while every mark is there (a pass that replaces a collective need not
    keep its mark)."""

    foreign: frozenset  # the groups of foreign() collectives
    int8: bool  # some collective carries INT8


_MARKS: weakref.WeakKeyDictionary[Graph, _Marks] = weakref.WeakKeyDictionary()


def _marks(graph: Graph) -> _Marks:
    marks = _MARKS.get(graph)
    if marks is None:
        collectives = [
            n
            for n in graph.nodes
            if n.op == "call_function"
            and getattr(n.target, "namespace", None) == "_c10d_functional"
            and n.target is not WAIT
        ]
        ours = {_group(n) for n in collectives if block_of(n) is not None}
        theirs = {_group(n) for n in collectives} - ours if ours else set()
        int8 = any(n.meta.get("custom", {}).get(INT8) for n in collectives)
        marks = _MARKS[graph] = _Marks(frozenset(theirs), int8)
    return marks


def val(node: object) -> Any:
    """The fake value of ``node``; None for a non-node argument."""
    return node.meta.get("val") if isinstance(node, Node) else None


def arg(node: Node, i: int = 0) -> Node:
    """``node.args[i]``, where the op's schema makes it a tensor, hence a node."""
    return cast(Node, node.args[i])


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


def is_quantized(collective: Node) -> bool:
    """Whether a collective carries packed int8 rows (:mod:`compiled_hooks.int8.collectives`),
    never a parameter's or a gradient's values: its input is int8 and it carries the
    :data:`INT8` mark. In a graph where no collective carries the mark, the int8 input alone:
    compiled autograd drops ``annotate``'s marks from the backward it compiles."""
    source = collective.args[0] if collective.args else None
    value = source.meta.get("val") if isinstance(source, Node) else None
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.int8):
        return False
    return bool(collective.meta.get("custom", {}).get(INT8)) or not _marks(collective.graph).int8


def block_of(node: Node) -> str | None:
    """The ``data_parallel`` block a collective belongs to, if it is marked with one."""
    return node.meta.get("custom", {}).get(BLOCK)


def check_graph(pass_name: str, graph: Any) -> None:
    """A pass takes a ``torch.fx.Graph``; anything else is a usage error."""
    if isinstance(graph, torch.fx.GraphModule):
        raise TypeError(f"{pass_name}: expected a torch.fx.Graph, got a GraphModule; pass gm.graph")
    if not isinstance(graph, Graph):
        raise TypeError(f"{pass_name}: expected a torch.fx.Graph, got {type(graph).__name__}")
    _marks(graph)


def calls(graph: Graph, ops: tuple) -> list[Node]:
    """The nodes that call one of ``ops``, in graph order, but another parallelism's collectives
    (:func:`foreign`): through the graph's index by target, not a walk of every node."""
    found = [n for t in ops for n in graph.find_nodes(op="call_function", target=t, sort=False)]
    return [n for n in sorted(found) if not foreign(n)]


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
