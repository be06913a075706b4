"""Reduce, eagerly, the unsharded gradients a ``data_parallel`` root accumulated: what
``finalize_backward()`` runs after the last backward of a step whose backwards all accumulated
(manual backward finalization, as torch's ``PipelineStage`` drives it).

A block's gradients go out in one collective, bucketed rank-major as the passes bucket them, and
each piece is added to its parameter's ``.grad`` (a DTensor of the parameter's placements)::

    bucket = cat([pad(g1).view(N, -1), pad(g2).view(N, -1)], dim=1).view(-1)
    hook(state, bucket, out); replica_hook(replica_state, out)        # hybrid_shard: replicas
    p1.grad += out[:n1].view(rows1, ...)[:local_rows1]; p2.grad += out[n1:].view(...)[...]

``replicate`` all-reduces the bucket ``cat([g1.view(-1), g2.view(-1)])`` in place. Hooks that
are not :func:`.gather.stateless` (``int8_compress_hook``) get each parameter on its own, in
the shapes the backward gives them. Blocks go in the order of the root's parameters, the same
on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .gather import stateless
from .layout import Layout, pad_rows
from .reduction import Reduction

__all__ = ["reduce_accumulated"]


def reduce_accumulated(
    parameters: Iterable[tuple[nn.Module, str, Layout]], reduction: Reduction
) -> None:
    """Reduce every gradient ``reduction`` holds accumulated for ``parameters`` (each once, as
    ``DataParallelState.parameters()`` gives them) into their ``.grad``, and drop it."""
    blocks: dict[str, list[tuple[DTensor, Layout, torch.Tensor]]] = {}
    for module, attr, layout in parameters:
        pending = reduction.accumulation.take(layout.name)
        if pending is not None:
            param = cast(DTensor, module.get_parameter(attr))
            blocks.setdefault(layout.block, []).append((param, layout, pending))
    together = stateless(reduction)
    for members in blocks.values():
        for group in [members] if together else [[m] for m in members]:
            _reduce(group, reduction)


def _reduce(members: list[tuple[DTensor, Layout, torch.Tensor]], r: Reduction) -> None:
    param, layout, _ = members[0]
    out_dtype = r.hook_dtypes(r.param_dtype or param.dtype)[1]
    key = {"param": layout.name} if r.per_parameter else {}
    if r.shard_group is None:
        flat = members[0][2] if len(members) == 1 else torch.cat([g.view(-1) for *_, g in members])
        r.hook(r.state, flat, **key)
        sizes = [g.numel() for *_, g in members]
        for (p, lay, _), piece in zip(members, flat.split(sizes)):
            _add_grad(p, piece.view(lay.shape))
        return
    shapes = [r.hook_shapes(lay) for _, lay, _ in members]
    padded = [pad_rows(g, grad[0]) for (_, _, g), (grad, _) in zip(members, shapes)]
    outs = [out for _, out in shapes if out is not None]  # sharded: every one
    if len(members) == 1:
        bucket = padded[0].contiguous()
        out = bucket.new_empty(outs[0], dtype=out_dtype)
    else:
        rows = [g.reshape(r.shard_size(), -1) for g in padded]
        bucket = torch.cat(rows, dim=1).view(-1)
        out = bucket.new_empty(sum(g.shape[1] for g in rows), dtype=out_dtype)
    r.hook(r.state, bucket, out, **key)
    if r.replica_hook is not None:
        r.replica_hook(r.replica_state, out, **key)
    sizes = [lay.rows * (lay.shape[1:].numel()) for _, lay, _ in members]
    for (p, lay, _), piece, shape in zip(members, out.reshape(-1).split(sizes), outs):
        _add_grad(p, piece.view(shape)[: lay.local_rows])


def _add_grad(param: DTensor, local: torch.Tensor) -> None:
    grad = DTensor.from_local(
        local.to(param.dtype),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )
    with torch.no_grad():
        if param.grad is None:
            param.grad = grad
        else:
            param.grad += grad
