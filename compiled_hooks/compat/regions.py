"""``invoke_subgraph``'s internals: the schema torch computes for every region call, and the
donated inputs Inductor gives a region's backward. Part of :mod:`compiled_hooks.compat`, which
re-exports every name here; read them through ``compat``."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._higher_order_ops.invoke_subgraph import invoke_subgraph as _invoke_subgraph

__all__ = ["region_schemas_reused", "region_inputs_kept"]

_GEN_SCHEMA = type(_invoke_subgraph).gen_schema
_SCHEMAS: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()
_REUSING = [0]  # how many region_schemas_reused() are open


def _operand(o: Any) -> Any:
    if isinstance(o, torch.Tensor):
        return (type(o), str(o.shape), str(o.stride()), o.dtype, o.device, o.requires_grad)
    return (type(o), repr(o))


def _reused_gen_schema(hop: Any, subgraph: Any, identifier: Any, *operands: Any) -> Any:
    graph = getattr(subgraph, "subgraph", subgraph)  # a FunctionalizeCtxWrapper's graph
    key = (identifier, getattr(graph, "code", None), tuple(map(_operand, operands)))
    try:
        schemas = _SCHEMAS.setdefault(subgraph, {})
    except TypeError:  # not weakly referenceable
        return _GEN_SCHEMA(hop, subgraph, identifier, *operands)
    if key not in schemas:
        schemas[key] = _GEN_SCHEMA(hop, subgraph, identifier, *operands)
    return schemas[key]


@contextlib.contextmanager
def region_schemas_reused() -> Iterator[None]:
    """Inside, ``invoke_subgraph`` computes a call's schema once per subgraph, its code and the
    kinds of its operands (type, shape, strides, dtype, device, ``requires_grad``). torch computes
    it for every call that needs grad, tracing the subgraph again to check that no operand is
    mutated: for identical blocks, the same trace once per block, in Dynamo and in
    AOTAutograd."""
    hop = type(_invoke_subgraph)

    def reuse() -> None:
        hop.gen_schema = _reused_gen_schema  # type: ignore[method-assign]

    def restore() -> None:
        hop.gen_schema = _GEN_SCHEMA  # type: ignore[method-assign]

    with _while_open(_REUSING, reuse, restore):
        yield


@contextlib.contextmanager
def _while_open(opened: list[int], patch: Callable[[], None], restore: Callable[[], None]):
    """``patch()`` on entering the first of nested contexts counted by ``opened``,
    ``restore()`` on leaving the last."""
    if not opened[0]:
        patch()
    opened[0] += 1
    try:
        yield
    finally:
        opened[0] -= 1
        if not opened[0]:
            restore()


_KEEPING = [0]  # how many region_inputs_kept() are open
_LOWERING_INIT: list[Any] = []  # SubgraphLowering.__init__ while one is open


@contextlib.contextmanager
def region_inputs_kept() -> Iterator[None]:
    """Inside, Inductor lowers a region (``SubgraphLowering``) with no donated input. torch 2.11
    and 2.13 give it the donated-input indices of the backward graph around it, which number
    other inputs: a region's backward then writes its output into an input the outer graph
    reuses, and the gradients come out wrong (pytorch/pytorch#193960, fixed in 2.15)."""
    from torch._inductor.graph import SubgraphLowering

    def keep() -> None:
        init = SubgraphLowering.__init__
        _LOWERING_INIT.append(init)  # the one in place when the first context opened

        def kept_init(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            self.bw_donated_idxs = None

        SubgraphLowering.__init__ = kept_init  # type: ignore[method-assign]

    def restore() -> None:
        SubgraphLowering.__init__ = _LOWERING_INIT.pop()  # type: ignore[method-assign]

    with _while_open(_KEEPING, keep, restore):
        yield
