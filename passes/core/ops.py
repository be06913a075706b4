"""The ops the passes look for (functional collectives, scales, casts, views), and a node's
fake value and tensor arguments."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.fx import Node

from compiled_hooks.graph_contract import (  # noqa: F401  (for the passes)
    BUCKET_PACK,
    BUCKET_UNPACK,
    RANK_SUM,
    exact_predivisor,
)

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


def val(node: object) -> Any:
    """The fake value of ``node``; None for a non-node argument."""
    return node.meta.get("val") if isinstance(node, Node) else None


def arg(node: Node, i: int = 0) -> Node:
    """``node.args[i]``, where the op's schema makes it a tensor, hence a node."""
    return cast(Node, node.args[i])
