"""Walking a graph: aliases of a value, what a node depends on and what depends on it, which
nodes write their arguments."""

from __future__ import annotations

import operator
from collections.abc import Callable

from torch.fx import Node

from .ops import WAIT


def is_alias(node: Node) -> bool:
    """``node``'s output shares memory with its first input (a view, a piece of a split, or a
    collective's wait)."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is WAIT or target is operator.getitem:
        return True
    schema = getattr(target, "_schema", None)
    return (
        schema is not None
        and bool(schema.returns)
        and schema.returns[0].alias_info is not None
        and not schema.returns[0].alias_info.is_write
    )


def aliases(node: Node) -> list[Node]:
    """``node`` and every node whose output shares its memory (views of it, views of those)."""
    found, frontier = {node: None}, [node]  # insertion-ordered set
    while frontier:
        for user in frontier.pop().users:
            if is_alias(user) and user not in found:
                found[user] = None
                frontier.append(user)
    return list(found)


def returned(node: Node) -> bool:
    """The graph returns ``node``'s result or a view of it (a forward saving it for backward):
    it stays alive to the graph's end, wherever the graph computes it."""
    return any(user.op == "output" for n in aliases(node) for user in n.users)


def input_cone(collective: Node) -> list[Node]:
    """The nodes that feed only ``collective``: pure call_functions all of whose users are
    ``collective`` or in the cone (a quantization's scales feed both its values and its packed
    bytes), which can move with it; unordered."""
    pure = ancestors([collective], lambda n: n.op == "call_function" and not n.is_impure())
    cone = {collective}
    for node in reversed(collective.graph.nodes):  # a node's users before the node
        if node in pure and node.users and all(u in cone for u in node.users):
            cone.add(node)
    return list(cone - {collective})


def ancestors(starts: list[Node], keep: Callable[[Node], bool] = lambda n: True) -> set[Node]:
    """``starts`` and every node they depend on through inputs for which ``keep`` holds."""
    seen, stack = set(starts), list(starts)
    while stack:
        for i in stack.pop().all_input_nodes:
            if keep(i) and i not in seen:
                seen.add(i)
                stack.append(i)
    return seen


def dependents(starts: list[Node]) -> set[Node]:
    """``starts`` and every node that depends on them."""
    seen, stack = set(starts), list(starts)
    while stack:
        for u in stack.pop().users:
            if u not in seen:
                seen.add(u)
                stack.append(u)
    return seen


def mutates(n: Node) -> bool:
    """Whether ``n`` calls an op that writes one of its arguments."""
    schema = getattr(n.target, "_schema", None)
    return n.op == "call_function" and schema is not None and schema.is_mutable
