"""New nodes with valid fake values (``meta["val"]``), cheaply where a pass makes many: a
bucket's flat ``cat``, its split back into pieces, and views."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, cast

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import Graph, Node

from compiled_hooks import compat

from .marks import is_op
from .ops import VIEW_OPS, aten, val

_VIEWS = (aten.view.default, aten.reshape.default)  # their values: view_value


def new_node(
    graph: Graph,
    target: Callable,
    args: tuple,
    kwargs: dict | None = None,
    name: str = "",
    value: Any = None,
) -> Node:
    """Create ``target(*args, **kwargs)`` at the graph's insert point with a valid ``meta["val"]``:
    ``value`` when the caller computed it, a view's by :func:`view_value`, else propagated
    through the inputs' fake mode."""
    node = graph.create_node("call_function", target, args, kwargs or {}, name=name or None)
    if value is None and target in _VIEWS and not kwargs:
        value = view_value(val(args[0]), args[1])
    if value is not None:
        node.meta["val"] = value
        return node
    fake_args = torch.fx.node.map_arg((args, kwargs or {}), val)
    mode = compat.fake_mode(
        [v for v in torch.utils._pytree.tree_leaves(fake_args) if isinstance(v, torch.Tensor)]
    )
    if mode is None:
        raise RuntimeError(f"{target}: inputs carry no fake tensor values (meta['val'])")
    # A pass's new nodes are one of a kind (a bucket's cat of K members, its split into K): the
    # fake-tensor cache would hash every input and check every output for nothing, which costs
    # more than the op itself for large buckets.
    with mode, compat.fake_tensor_cache_off(mode):
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


def flat_value(like: FakeTensor, numel: int) -> torch.Tensor:
    """The fake value of a new contiguous 1-D tensor of ``numel`` elements of ``like``'s dtype and
    device: what a ``cat`` of 1-D pieces gives, without the fake kernel walking every input."""
    with like.fake_mode:
        return torch.empty(numel, dtype=like.dtype, device=like.device)


def _meta_alias(value: Any) -> torch.Tensor | None:
    """A plain meta tensor over a contiguous fake ``value``'s storage, with its layout (None for
    anything else: a real tensor, a symbolic size, a layout a view could not keep). What a view
    op gives on it is, wrapped in ``value``'s fake mode, the op's fake value: computed without
    a propagation through the fake mode, which costs more than the rest of a node's creation."""
    if not isinstance(value, FakeTensor):
        return None
    # sizes first: a symbolic size's contiguity would be a guard, not a bool
    if not all(isinstance(s, int) for s in (*value.shape, value.storage_offset())):
        return None
    if not value.is_contiguous():
        return None
    alias = torch.empty((0,), dtype=value.dtype, device="meta")
    return alias.set_(value.untyped_storage(), value.storage_offset(), value.shape, value.stride())


def _wrap(value: FakeTensor, meta: torch.Tensor) -> FakeTensor:
    # FakeTensor itself, not the converter's from_meta_and_device: that also enters each meta
    # tensor in the converter's weak-keyed memo tables, and no one looks these values up again.
    return FakeTensor(value.fake_mode, meta, value.device)


def view_value(value: Any, shape: list[int]) -> torch.Tensor | None:
    """The fake value of ``view(value, shape)`` (or ``reshape``, the same on a contiguous
    tensor): a view of ``value``'s storage. None where :func:`_meta_alias` is, or ``shape`` is
    not a list of ints: let the fake kernel do it."""
    alias = _meta_alias(value)
    if alias is None or not all(isinstance(s, int) for s in shape):
        return None
    return _wrap(value, alias.view(shape))


def split_values(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor] | None:
    """The fake values of ``split_with_sizes(flat, sizes)`` for a contiguous 1-D fake ``flat``:
    views of its storage at the pieces' offsets, as the op gives (None for any other ``flat``:
    let the fake kernel do it). The fake kernel costs a propagation per piece, linear in a
    bucket's members with a large constant."""
    alias = _meta_alias(flat)
    if alias is None or flat.dim() != 1 or sum(sizes) != flat.numel():
        return None
    return [_wrap(cast(FakeTensor, flat), piece) for piece in torch.split_with_sizes(alias, sizes)]


def split_node(graph: Graph, flat: Node, sizes: list[int], name: str) -> Node:
    """``split_with_sizes(flat, sizes)`` at the insert point, its values from
    :func:`split_values`: a bucket's result cut back into its members' pieces."""
    value = split_values(val(flat), sizes)
    return new_node(graph, aten.split_with_sizes.default, (flat, sizes), name=name, value=value)


def piece_of(graph: Graph, pieces: Node, i: int, shape: list[int] | None) -> Node:
    """Piece ``i`` of the :func:`split_node` ``pieces`` at the insert point, viewed in ``shape``
    (None: left 1-D)."""
    piece = graph.call_function(operator.getitem, (pieces, i))
    piece.meta["val"] = val(pieces)[i]
    return piece if shape is None else new_node(graph, aten.view.default, (piece, shape))
