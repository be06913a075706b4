"""The SimpleFSDP-style peer (torchtitan's ``experiments/graph_trainer/simple_fsdp.py``, in a
few lines) and the Inductor options that bucket its collectives."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

INDUCTOR_FSDP_BUCKETING = {"bucket_all_gathers_fx": "only_fsdp", "bucket_reduce_scatters_fx": "all"}


def simple_fsdp(model: nn.Module, mesh, mp: MixedPrecisionPolicy) -> nn.Module:
    """SimpleFSDP's design in a few lines: ``Shard(0)`` DTensor parameters, redistributed to
    ``Replicate`` (an all-gather in ``param_dtype``) on every read; the gradient comes back as a
    ``Partial`` sum, reduce-scattered in ``reduce_dtype`` by DTensor and averaged here."""
    world = mesh.size()

    def read(self, name):
        full = self._parameters[name].redistribute(
            placements=[Replicate()], forward_dtype=mp.param_dtype, backward_dtype=mp.reduce_dtype
        )
        return Average.apply(full.to_local(grad_placements=[Partial()]), world)

    for m in list(model.modules()):
        names = [n for n, p in m._parameters.items() if p is not None]
        for n in names:
            m._parameters[n] = nn.Parameter(
                distribute_tensor(m._parameters[n].detach(), mesh, [Shard(0)], src_data_rank=None)
            )
        if names:
            m.__class__ = type(
                f"Simple{type(m).__name__}",
                (type(m),),
                {n: property(lambda self, n=n: read(self, n)) for n in names},
            )
    return model


class Average(torch.autograd.Function):
    """Identity forward; divides the gradient by the world size (SimpleFSDP sums)."""

    @staticmethod
    def forward(ctx, x, world):
        ctx.world = world
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.world, None
