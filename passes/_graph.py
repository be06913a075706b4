"""What the passes share: op sets, chain matching around a collective, group facts, the
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
import operator
import os
import sys
import weakref
from collections.abc import Callable
from fractions import Fraction
from typing import Any, cast

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensor, disable_fake_tensor_cache
from torch.fx import Graph, Node

from compiled_hooks import compat
from compiled_hooks.graph_contract import BLOCK

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

# Backends where reduce op avg is worth folding into: NCCL averages inside the collective.
# gloo implements avg too (torch 2.13), but as a sum followed by a division pass over the
# result in the wire dtype, issued after the wire time, which costs more than the multiplication
# it saves (docs/benchmarks.md). There the factors become one multiplication before the cast,
# inside the cast's kernel. "fake" is the test backend (no communication; it stands for NCCL in
# traced graphs).
AVG_BACKENDS = frozenset({"nccl", "fake"})
# The most bytes per destination one all_to_all the gloo rewrites send (all_to_all_weight_update,
# all_gather_as_all_to_all, reduce_scatter_as_all_to_all) where the ranks span hosts: on a
# bandwidth-bound link gloo moves one large all_to_all well below the link's rate, and the same
# bytes in pieces of this size, all in flight, close to it. Where every rank runs on one host the
# exchange goes through loopback, where one all_to_all moves at memory speed and each piece costs
# more than it saves: there it goes out whole (docs/benchmarks.md, "Collective costs on gloo").
ALL_TO_ALL_CHUNK_BYTES = 512 << 10


def record(pass_name: str, event: str, node: Node | None = None) -> None:
    """Count ``event`` in ``counters["passes"]`` and log it (logger ``passes``, DEBUG)."""
    counters["passes"][f"{pass_name}: {event}"] += 1
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
    groups = _foreign_groups(node.graph)
    source = node.args[0] if node.target is WAIT and node.args else node
    return bool(groups) and isinstance(source, Node) and _group(source) in groups


def _group(collective: Node) -> Any:
    return collective.args[-1] if collective.args else None


_FOREIGN: weakref.WeakKeyDictionary[Graph, frozenset] = weakref.WeakKeyDictionary()


def _foreign_groups(graph: Graph) -> frozenset:
    """The groups of :func:`foreign` collectives, found the first time a pass sees ``graph``
    (:func:`check_graph`), while data_parallel's marks are all there (a pass that replaces a
    collective need not keep its mark)."""
    if graph not in _FOREIGN:
        collectives = [
            n
            for n in graph.nodes
            if n.op == "call_function"
            and getattr(n.target, "namespace", None) == "_c10d_functional"
            and n.target is not WAIT
        ]
        ours = {_group(n) for n in collectives if block_of(n) is not None}
        theirs = {_group(n) for n in collectives} - ours if ours else set()
        _FOREIGN[graph] = frozenset(theirs)
    return _FOREIGN[graph]


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


_CHAIN_TARGETS = frozenset(SCALE_OPS + VIEW_OPS)


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
    """Whether a collective carries int8: the packed rows of the int8 hooks
    (:mod:`compiled_hooks.int8_collectives`), never a parameter's or a gradient's values."""
    source = collective.args[0] if collective.args else None
    val = source.meta.get("val") if isinstance(source, Node) else None
    return isinstance(val, torch.Tensor) and val.dtype == torch.int8


def block_of(node: Node) -> str | None:
    """The ``data_parallel`` block a collective belongs to, if it is marked with one."""
    return node.meta.get("custom", {}).get(BLOCK)


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


def check_graph(pass_name: str, graph: Any) -> None:
    """A pass takes a ``torch.fx.Graph``; anything else is a usage error."""
    if isinstance(graph, torch.fx.GraphModule):
        raise TypeError(f"{pass_name}: expected a torch.fx.Graph, got a GraphModule; pass gm.graph")
    if not isinstance(graph, Graph):
        raise TypeError(f"{pass_name}: expected a torch.fx.Graph, got {type(graph).__name__}")
    _foreign_groups(graph)


def chains(graph: Graph, pass_name: str) -> list[Chain]:
    """Every matched chain, in graph order of the collectives. Collectives without fake-tensor
    metadata (a graph not traced the way Inductor traces) are skipped and counted."""
    check_graph(pass_name, graph)
    out = []
    for node in graph.nodes:
        if not is_op(node, COLLECTIVES):
            continue
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


@dataclasses.dataclass(frozen=True)
class GroupInfo:
    size: int
    backend: str


def group_info(group_name: Any) -> GroupInfo | None:
    """Size and backend of the group a collective names; None if it cannot be resolved
    (a group passed as a graph input, or one this process does not know)."""
    if not isinstance(group_name, str):
        return None
    try:
        pg = compat.resolve_process_group(group_name)
        return GroupInfo(pg.size(), str(dist.get_backend(pg)).lower())
    except Exception:  # noqa: BLE001 - an unknown group is simply not ours to rewrite
        return None


def new_node(
    graph: Graph,
    target: Callable,
    args: tuple,
    kwargs: dict | None = None,
    name: str = "",
    value: Any = None,
) -> Node:
    """Create ``target(*args, **kwargs)`` at the graph's insert point with a valid ``meta["val"]``:
    ``value`` when the caller computed it, else propagated through the inputs' fake mode."""
    node = graph.create_node("call_function", target, args, kwargs or {}, name=name or None)
    if value is not None:
        node.meta["val"] = value
        return node
    fake_args = torch.fx.node.map_arg((args, kwargs or {}), val)
    mode = torch._guards.detect_fake_mode(
        [v for v in torch.utils._pytree.tree_leaves(fake_args) if isinstance(v, torch.Tensor)]
    )
    if mode is None:
        raise RuntimeError(f"{target}: inputs carry no fake tensor values (meta['val'])")
    # A pass's new nodes are one of a kind (a bucket's cat of K members, its split into K): the
    # fake-tensor cache would hash every input and check every output for nothing, which costs
    # more than the op itself for large buckets.
    with mode, disable_fake_tensor_cache(mode):
        node.meta["val"] = target(*fake_args[0], **fake_args[1])
    return node


def reapply(graph: Graph, value: Node, ops: list[Node]) -> Node:
    """``ops`` (a chain's elementwise scales and casts, and views) applied again, in order, to
    ``value`` at the graph's insert point; views are skipped, so ``value`` keeps its own shape
    (the ops act elementwise). Returns the last new node (``value`` if none)."""
    for op in ops:
        if not is_op(op, VIEW_OPS):
            value = new_node(
                graph, cast(Callable, op.target), (value, *op.args[1:]), dict(op.kwargs)
            )
    return value


def ranks_on_one_host() -> bool:
    """Whether torchrun's environment says that every rank of the job runs on this host
    (``LOCAL_WORLD_SIZE == WORLD_SIZE``); False where either is unset. The same on every rank of
    a job that torchrun (or a launcher setting its variables) started."""
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    return local is not None and local == world


def resolve_chunk_bytes(pass_name: str, chunk_bytes: int | None) -> int:
    """The most bytes per destination one all_to_all of ``pass_name`` sends: ``chunk_bytes``
    where given (a positive int, else ``ValueError``); by default ``ALL_TO_ALL_CHUNK_BYTES``,
    or no limit where :func:`ranks_on_one_host`."""
    if chunk_bytes is None:
        return sys.maxsize if ranks_on_one_host() else ALL_TO_ALL_CHUNK_BYTES
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(
            f"{pass_name}: all_to_all_chunk_bytes must be a positive int or None, "
            f"got {chunk_bytes!r}"
        )
    return chunk_bytes


def chunk_bounds(count: int, item_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges that split ``count`` items of ``item_bytes`` each into equal pieces
    of at most ``chunk_bytes`` (at least one item each; the last piece may be shorter)."""
    if count <= 0:
        return [(0, count)]
    pieces = -(-count // max(1, chunk_bytes // max(1, item_bytes)))
    size = -(-count // pieces)
    return [(lo, min(lo + size, count)) for lo in range(0, count, size)]


def flat_value(like: FakeTensor, numel: int) -> torch.Tensor:
    """The fake value of a new contiguous 1-D tensor of ``numel`` elements of ``like``'s dtype and
    device: what a ``cat`` of 1-D pieces gives, without the fake kernel walking every input."""
    with like.fake_mode:
        return torch.empty(numel, dtype=like.dtype, device=like.device)


def split_values(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor] | None:
    """The fake values of ``split_with_sizes(flat, sizes)`` for a contiguous 1-D fake ``flat``:
    views of its storage at the pieces' offsets, as the op gives (None for any other ``flat``:
    let the fake kernel do it). Computed on a plain meta tensor over the same storage and
    wrapped once each; the fake kernel costs a propagation per piece, linear in a bucket's
    members with a large constant."""
    mode = getattr(flat, "fake_mode", None)
    if mode is None or flat.dim() != 1 or not flat.is_contiguous() or sum(sizes) != flat.numel():
        return None
    base = torch.empty((0,), dtype=flat.dtype, device="meta")
    base.set_(flat.untyped_storage(), flat.storage_offset(), flat.shape, flat.stride())
    return [
        mode.fake_tensor_converter.from_meta_and_device(mode, piece, flat.device)
        for piece in torch.split_with_sizes(base, sizes)
    ]
