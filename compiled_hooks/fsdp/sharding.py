"""How ``data_parallel`` shards one parameter: on the data-parallel mesh, or, for a
tensor-parallel DTensor, on the mesh joining it with the tensor-parallel one, as FSDP2 does.
No communication."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from .. import compat
from .gather import Layout, TensorParallel

__all__ = ["PLACEMENTS", "shard_parameter", "check_tensor_parallel"]

PLACEMENTS: dict[str, tuple[Placement, ...]] = {
    "fully_shard": (Shard(0),),
    "replicate": (Replicate(),),
    "hybrid_shard": (Replicate(), Shard(0)),
}


def shard_parameter(
    p: torch.Tensor, mesh: DeviceMesh, mode: str, name: str, block: str
) -> tuple[nn.Parameter, Layout]:
    """This rank's shard of ``p`` as a parameter, and where its rows live. A plain ``p`` is
    sharded on ``mesh``; a tensor-parallel DTensor ``p`` as FSDP2 shards it: its local tensor
    is split on dim 0 over the shard dimension of ``mesh``, on the mesh joining ``mesh`` with
    its own (``_StridedShard`` where tensor parallelism already splits dim 0). No
    communication."""
    placements = PLACEMENTS[mode]
    shards = 1 if mode == "replicate" else mesh.size(mesh.ndim - 1)
    if not isinstance(p, DTensor):
        dt = distribute_tensor(p.detach(), mesh, list(placements), src_data_rank=None)
        full, tp = p, None
    else:
        full = p.to_local().detach()
        tp = TensorParallel(p.device_mesh, tuple(p.placements), p.shape, p.stride())
        if mode != "replicate":
            split = math.prod(  # tensor parallelism's pieces of dim 0
                p.device_mesh.size(i)
                for i, placement in enumerate(p.placements)
                if isinstance(placement, Shard) and placement.dim == 0
            )
            shard: Placement = compat.StridedShard(0, split_factor=split) if split > 1 else Shard(0)
            placements = (*placements[:-1], shard)
            pieces = torch.chunk(full, shards, dim=0)
            index = mesh.get_local_rank(mesh.ndim - 1)
            local = pieces[index] if index < len(pieces) else full[:0]
        else:
            local = full
        joined = compat.concatenate_meshes([mesh, p.device_mesh])
        dt = DTensor.from_local(
            local.clone(), joined, (*placements, *tp.placements), shape=p.shape, stride=p.stride()
        )
    rows = 0 if mode == "replicate" else math.ceil(full.shape[0] / shards)
    local_rows = dt.to_local().shape[0] if p.dim() else 0
    layout = Layout(name, full.shape, rows, local_rows, block, tp)
    return nn.Parameter(dt, requires_grad=p.requires_grad), layout


def check_tensor_parallel(path: str, p: DTensor, mesh: DeviceMesh) -> None:
    """A DTensor parameter is tensor-parallel on a mesh of its own, whose dimensions and
    ``mesh``'s are sibling dimensions of one named root mesh."""
    where = f"data_parallel: parameter {path!r} is a DTensor on {p.device_mesh}"
    fix = (
        "build one mesh, init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), "
        "parallelize the model over mesh['tp'] and pass mesh['dp'] here"
    )
    if any(placement.is_partial() for placement in p.placements):
        raise ValueError(
            f"{where} with placements {p.placements}: a Partial parameter has no values to "
            "shard; redistribute it to Replicate() or Shard first"
        )
    if mesh.mesh_dim_names is None or p.device_mesh.mesh_dim_names is None:
        raise ValueError(f"{where}; both meshes need named dimensions: {fix}")
    try:
        compat.concatenate_meshes([mesh, p.device_mesh])
    except RuntimeError as e:
        raise ValueError(
            f"{where}, which is not a sibling dimension of the data-parallel mesh {mesh}: {fix}"
        ) from e
