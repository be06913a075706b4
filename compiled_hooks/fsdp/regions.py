"""One compile per distinct block in a whole-model compile: under a traced root forward, each
``data_parallel`` block runs as a ``torch.compiler.nested_compile_region`` whose inputs are the
block's gathered parameters. The gathers (and, in backward, the reductions) stay in the outer
graph, where the passes bucket them per block and issue them a block ahead; the region holds
the block's computation only, so identical blocks share one traced, partitioned and generated
subgraph::

    before (one graph, every block inlined)      after (blocks as regions)
    w1 = wait(all_gather(f1))                    w1 = wait(all_gather(f1))
    ... block 1's ops, reading w1 ...            y1 = invoke_subgraph(block, w1, x)
    w2 = wait(all_gather(f2))                    w2 = wait(all_gather(f2))
    ... block 2's ops, reading w2 ...            y2 = invoke_subgraph(block, w2, y1)

Regions are on while :func:`~compiled_hooks.marks.compile_blocks_once` is
(``passes.install()`` turns them on with
the joint-graph rewrite that keeps ``reshard_after_forward``: without it the region's forward
would hand its gathered parameters to its backward, and the backward would not gather again).
A block is a region unless one of its parameters is tensor-parallel (a DTensor read), and only
in a traced root forward: a block compiled on its own is its own graph already.

Two calls reuse one subgraph when their keys match (:func:`region_key`): the block's structure
(every submodule's class, parameters, buffers and plain attributes) and the inputs' pytree,
dtypes, ranks, sizes and ``requires_grad``. Where ``nested_compile_region`` takes no
``reuse_hash_fn`` (torch before 2.12), Dynamo traces every call and keeps one subgraph per
distinct graph.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

__all__ = [
    "block_key",
    "variant",
    "region_key",
    "flat_region_key",
    "compile_region",
]

_PLAIN = (int, float, bool, str, type(None))


def _plain(v: Any) -> bool:
    return isinstance(v, _PLAIN) or (isinstance(v, tuple) and all(map(_plain, v)))


def block_key(block: nn.Module) -> int:
    """A stable hash of what makes ``block`` compute what it computes, bar its inputs and the
    values of its tensors: per submodule, its path and its classes (the whole MRO, so the class
    ``data_parallel`` swapped in names the original), its parameters' and buffers' names,
    shapes, dtypes and ``requires_grad``, and its attributes of plain types (so blocks told
    apart by an ``int`` such as a layer index never share a subgraph)."""
    parts: list[tuple[Any, ...]] = []
    for path, m in block.named_modules():
        parts.append((path, *((c.__module__, c.__qualname__) for c in type(m).__mro__)))
        tensors = [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
        for n, t in sorted(tensors, key=lambda item: item[0]):
            parts.append((n, tuple(t.shape), str(t.dtype), t.requires_grad))
        parts.extend((n, repr(v)) for n, v in sorted(vars(m).items()) if _plain(v))
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def variant(seen: list[Any], sizes: list[tuple[Any, ...]]) -> int:
    """The index of ``sizes`` (one call's input sizes; for a call on tensors only, each
    gathered parameter's ``(dtype, requires_grad)``, its size being its layout's, then each
    argument's ``(dtype, requires_grad, *size)``) in ``seen``, appended if new. Sizes compare
    without a guard where they are the same symbol or the same int, so a dynamic size does not
    specialize."""
    found = next((i for i, s in enumerate(seen) if s == sizes), len(seen))
    if found == len(seen):
        seen.append(sizes)
    return found


def region_key(
    block: nn.Module, key: int, variant: int, params: tuple, args: tuple, kwargs: dict
) -> int:
    """The reuse key of one region call (traced by Dynamo, so built from constants only): the
    block's :func:`block_key`, the :func:`variant` of its inputs' sizes, and each input's dtype,
    rank and ``requires_grad``, with the pytree's shape as the count and kinds of its leaves."""
    meta = tuple(
        (t.dtype, t.dim(), t.requires_grad) if isinstance(t, torch.Tensor) else type(t).__name__
        for t in tree_leaves((params, args, kwargs))
    )
    return hash((key, variant, len(args), tuple(kwargs), meta))


def flat_region_key(block: nn.Module, key: int, variant: int, *tensors: torch.Tensor) -> int:
    """:func:`region_key` of a call on tensors only, passed flat, whose ``variant`` indexes its
    inputs' dtypes, ``requires_grad`` and sizes (see :func:`variant`): the block's key, the
    variant and the count of inputs."""
    return hash((key, variant, len(tensors)))


def compile_region(
    body: Callable[..., Any], reuse_key: Callable[..., int] = region_key
) -> Callable[..., Any]:
    """``body(block, key, variant, ...)`` as a nested compile region reused by ``reuse_key`` (by
    Dynamo's graph comparison where torch takes no ``reuse_hash_fn``)."""
    if "reuse_hash_fn" in inspect.signature(torch.compiler.nested_compile_region).parameters:
        return torch.compiler.nested_compile_region(body, reuse_hash_fn=reuse_key)
    return torch.compiler.nested_compile_region(body)
