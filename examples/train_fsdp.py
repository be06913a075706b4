"""Compile-native FSDP (``compiled_hooks.fsdp.data_parallel``) with a compression comm hook,
checked against FSDP2's own mixed precision.

    python examples/train_fsdp.py                     # spawns 2 ranks (CPU + gloo without a GPU)
    torchrun --nproc-per-node 2 examples/train_fsdp.py

Each rank trains the main example's tiny transformer twice from the same seed: once sharded with
``data_parallel(model, mesh)``, its gradients reduced by ``bf16_compress_hook`` and the whole
step compiled as one graph with this project's passes; once with FSDP2 (``fully_shard`` on every
block and the root, eager) and ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``, the
reference. Rank 0 prints both losses every step and how far the final losses are apart; exits
non-zero beyond ``--tolerance``. ``PASSES_CHECK_RANKS=1`` turns on the rank-divergence guard.
"""

from __future__ import annotations

import warnings

# torch warns at import when numpy is missing (numpy is not a dependency).
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
# FSDP2 (the reference) warns that the model returns a view; nothing here modifies it in place.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module")


import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from train_ddp import TinyTransformer, example_parser, launch
from train_fsdp2 import train_side_by_side

import compiled_hooks as ch
import passes
from compiled_hooks.fsdp import data_parallel, register_comm_hook


def build_native(mesh, device: torch.device):
    torch.manual_seed(0)
    model = data_parallel(TinyTransformer(dim=64, layers=2).to(device), mesh)
    register_comm_hook(model, ch.LowPrecisionState(mesh.get_group()), ch.bf16_compress_hook)
    return model, torch.compile(model, fullgraph=True)


def build_fsdp2(mesh, device: torch.device):
    torch.manual_seed(0)
    model = TinyTransformer(dim=64, layers=2).to(device)
    mp_policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model, model


def run(rank: int, world_size: int, steps: int, tolerance: float, device: torch.device) -> bool:
    mesh = init_device_mesh(device.type, (world_size,))
    models = {
        "data_parallel + bf16_compress_hook": build_native(mesh, device),
        "FSDP2 reduce_dtype=bf16": build_fsdp2(mesh, device),
    }
    return train_side_by_side(rank, world_size, models, "data_parallel", steps, tolerance, device)


def _run_args(rank: int, world_size: int, args) -> bool:
    with passes.install():
        return run(rank, world_size, args.steps, args.tolerance, args.device)


def main() -> None:
    launch(_run_args, example_parser(__doc__.split("\n\n")[0]).parse_args())


if __name__ == "__main__":
    main()
