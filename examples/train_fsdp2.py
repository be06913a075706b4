"""FSDP2 with a compression comm hook, checked against FSDP2's own mixed precision.

    python examples/train_fsdp2.py                     # spawns 2 ranks (CPU + gloo without a GPU)
    torchrun --nproc-per-node 2 examples/train_fsdp2.py

Each rank trains the main example's tiny transformer twice from the same seed, with
``fully_shard`` on every block and the root and ``torch.compile`` on every block: once with
``compiled_hooks.fsdp.register_comm_hook(model, LowPrecisionState, bf16_compress_hook,
compile=True)`` (the hook compiled with this project's passes), once with FSDP2's
``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)`` (the reference). Rank 0 prints both
losses every step and how far the final losses are apart; exits non-zero beyond
``--tolerance``. ``PASSES_CHECK_RANKS=1`` turns on the rank-divergence guard.
"""

from __future__ import annotations

import warnings

# torch warns at import when numpy is missing (numpy is not a dependency).
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from train_ddp import (
    TinyTransformer,
    batch,
    example_parser,
    launch,
    loss_fn,
    report_rank_guard,
    synchronize,
)

import compiled_hooks as ch
import passes
from compiled_hooks.fsdp import register_comm_hook


def build(mesh, with_hook: bool, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    model = TinyTransformer(dim=64, layers=2).to(device)
    mp_policy = (
        MixedPrecisionPolicy() if with_hook else MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    )
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
        block.compile()
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    if with_hook:
        register_comm_hook(
            model, ch.LowPrecisionState(dist.group.WORLD), ch.bf16_compress_hook, compile=True
        )
    return model


def run(rank: int, world_size: int, steps: int, tolerance: float, device: torch.device) -> bool:
    mesh = init_device_mesh(device.type, (world_size,))
    models = {
        "bf16_compress_hook": build(mesh, True, device),
        "FSDP2 reduce_dtype=bf16": build(mesh, False, device),
    }
    return train_side_by_side(
        rank,
        world_size,
        {name: (m, m) for name, m in models.items()},
        "hook",
        steps,
        tolerance,
        device,
    )


def train_side_by_side(
    rank: int,
    world_size: int,
    models: dict,
    ours: str,
    steps: int,
    tolerance: float,
    device: torch.device,
) -> bool:
    """Train ``models`` (name -> (module holding the parameters, module to call); ours first, then
    FSDP2 with mixed precision) on the same batches with AdamW; rank 0 prints both losses every
    step and the final relative difference. True when it is within ``tolerance``."""
    opts = {
        name: torch.optim.AdamW(model.parameters(), lr=1e-3) for name, (model, _) in models.items()
    }
    final = {}
    for step in range(steps):
        tokens, targets = batch(rank, step, device=device)
        line = f"step {step:3d}"
        for name, (_, run_model) in models.items():
            synchronize(device)
            t0 = time.perf_counter()
            loss = loss_fn(run_model, tokens, targets)
            loss.backward()
            opts[name].step()
            opts[name].zero_grad()
            synchronize(device)
            elapsed = time.perf_counter() - t0
            mean = loss.detach().clone()
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)
            final[name] = mean.item()
            line += f"  {name}: loss {final[name]:.4f} ({elapsed * 1e3:7.1f} ms)"
        if rank == 0:
            print(line, flush=True)
    value, ref = final.values()
    rel = abs(value - ref) / abs(ref)
    ok = rel <= tolerance
    if rank == 0:
        print(
            f"final loss: {ours} {value:.4f}  FSDP2 mixed precision {ref:.4f}  relative "
            f"difference {rel:.2e} ({'OK' if ok else 'FAIL'}: tolerance {tolerance:.0%}, "
            f"{world_size} ranks)",
            flush=True,
        )
        report_rank_guard()
    return ok


def _run_args(rank: int, world_size: int, args) -> bool:
    with passes.install():
        return run(rank, world_size, args.steps, args.tolerance, args.device)


def main() -> None:
    launch(_run_args, example_parser(__doc__.split("\n\n")[0]).parse_args())


if __name__ == "__main__":
    main()
