"""The checks :func:`~compiled_hooks.fsdp.data_parallel` makes of its arguments, before it
changes anything."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from .. import weight_gathers
from .root import data_parallel_state
from .sharding import check_tensor_parallel

__all__ = ["check_arguments", "MODES", "PIPELINE_DIM"]

MODES = {"fully_shard": 1, "replicate": 1, "hybrid_shard": 2}  # mode -> mesh dimensions
PIPELINE_DIM = "pp"  # the mesh dimension name of pipeline parallelism (torchtitan's)


def check_arguments(
    module: nn.Module, mesh: DeviceMesh, mode: str, mp_policy: Any, reshard: Any, gather_dtype: Any
) -> None:
    """Raise, naming the problem, where ``data_parallel`` cannot take its arguments."""
    name = "data_parallel"
    if not isinstance(module, nn.Module):
        raise TypeError(f"{name}: expected an nn.Module, got {type(module).__name__}")
    if mode not in MODES:
        raise ValueError(f"{name}: mode must be one of {sorted(MODES)}, got {mode!r}")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{name}: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if PIPELINE_DIM in (mesh.mesh_dim_names or ()):
        raise ValueError(
            f"{name}: the mesh {mesh} includes the pipeline dimension {PIPELINE_DIM!r}; pass "
            f"the data-parallel dimension, mesh['dp'] of a ({PIPELINE_DIM!r}, 'dp') mesh"
        )
    if mesh.ndim != MODES[mode]:
        layout = "a 2-D (replicate, shard) mesh" if mode == "hybrid_shard" else "a 1-D mesh"
        raise ValueError(f"{name}: mode {mode!r} needs {layout}, got a {mesh.ndim}-D mesh")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"{name}: mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got "
            f"{type(mp_policy).__name__}"
        )
    if reshard is not None and not isinstance(reshard, bool):
        raise TypeError(f"{name}: reshard_after_forward must be a bool or None, got {reshard!r}")

    if gather_dtype is not None and gather_dtype not in weight_gathers.dtypes():
        known = " or ".join(str(d) for d in weight_gathers.dtypes())
        raise ValueError(
            f"{name}: gather_dtype must be None (gather in mp_policy.param_dtype) or {known}, "
            f"got {gather_dtype!r}"
        )
    if gather_dtype is not None and mode == "replicate":
        raise ValueError(f"{name}: mode 'replicate' gathers nothing, so it takes no gather_dtype")
    for path, m in module.named_modules():
        what = f"submodule {path!r}" if path else "the module"
        if isinstance(m, FSDPModule):
            raise ValueError(
                f"{name}: {what} is already wrapped by FSDP2 (fully_shard / replicate)"
            )
        if data_parallel_state(m) is not None:
            raise ValueError(f"{name}: {what} is already wrapped by data_parallel")
    devices = {p.device for p in module.parameters()}
    if len(devices) > 1:
        raise ValueError(
            f"{name}: the parameters are on several devices {sorted(map(str, devices))}; move the "
            "module to one device first"
        )
    if devices and next(iter(devices)).type != mesh.device_type:
        raise ValueError(
            f"{name}: the parameters are on {next(iter(devices))} but the mesh is a "
            f"{mesh.device_type!r} mesh"
        )
    for path, p in module.named_parameters():
        if isinstance(p, DTensor):
            check_tensor_parallel(path, p, mesh)
    if mode != "replicate":
        for path, p in module.named_parameters():
            if p.dim() == 0:
                raise ValueError(
                    f"{name}: parameter {path!r} is a scalar, which cannot be sharded on dim 0; "
                    "make it a 1-element tensor"
                )
