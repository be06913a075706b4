"""Which nodes a pass may touch, by what the hooks mark (``compiled_hooks.graph_contract``): a
collective's ``data_parallel`` block, its int8 payload, and another parallelism's collectives
(:func:`foreign`), which no pass matches. The selections every pass makes go through here
(:func:`is_op`, :func:`is_collective`, :func:`calls`), and :func:`check_graph` reads a graph's
marks the first time a pass sees it."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch.fx import Graph, Node

from compiled_hooks.graph_contract import BLOCK, INT8

from .ops import WAIT


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
