"""Gradient accumulation: a step of 4 micro-batches that reduces every micro-batch, against one
that accumulates with ``set_requires_gradient_sync(False)`` and reduces the sum once.

    python -m benchmarks.accumulation                 # 2 CPU ranks over loopback
    python -m benchmarks.accumulation --link 2gbit    # 2 ranks on a 2 Gbit/s link (root, ip, tc)

Model: ``fsdp_step.py``'s ``mlp-8x1024`` (8 Linear(1024, 1024) + ReLU, every Linear a block,
batch 32 per micro-batch), fp32, resharding after forward. Configurations: FSDP2 eager and
``data_parallel`` compiled whole with the passes, each reducing every micro-batch and with the
switch off for all but the last. Steps (the micro-batches' forwards and backwards) are interleaved,
one of each configuration in turn; medians on rank 0. Per configuration: median step, its ratio
to the same library reducing every micro-batch, the collectives and MB per step (the profiler's
count over one step: an all-gather's output, a reduce-scatter's or all-to-all's input), and the
unsharded gradients held after the last no-sync micro-batch (FSDP2's ``unsharded_accumulated_grad``,
``data_parallel``'s ``accumulated_gradient_bytes()``).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import passes
from benchmarks.common import results
from benchmarks.common.achievable import record_collectives
from benchmarks.common.launch import (
    add_configs_argument,
    add_link_argument,
    add_smoke_argument,
    apply_smoke,
    chosen_configs,
    describe_link,
    interleaved_median_ms,
    launch,
)
from benchmarks.common.models import make_blocks_model
from compiled_hooks import compat
from compiled_hooks.fsdp import data_parallel

MICRO_BATCHES = 4
CONFIGS = [
    "FSDP2 eager, reduce each micro-batch",
    "FSDP2 eager, set_requires_gradient_sync",
    "data_parallel + passes, reduce each micro-batch",
    "data_parallel + passes, set_requires_gradient_sync",
]
SMOKE = CONFIGS[2:]


def fsdp2_held_bytes(model: torch.nn.Module) -> int:
    """The unsharded gradients FSDP2's modules hold accumulated."""
    held = 0
    for m in model.modules():
        if isinstance(m, torch.distributed.fsdp.FSDPModule):
            for group in compat.fsdp_param_groups(m):
                for p in group.fsdp_params:
                    grad = compat.fsdp_accumulated_grad(p)
                    held += 0 if grad is None else grad.numel() * grad.element_size()
    return held


def build(config: str, tag: int, model_name: str) -> Callable[[], int]:
    """``config``'s step: it runs the micro-batches and returns the bytes held before the last
    one's backward."""
    model, blocks, x = make_blocks_model(model_name, tag)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    switch = config.endswith("set_requires_gradient_sync")
    if config.startswith("FSDP2"):
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        run, held = model, fsdp2_held_bytes
    else:
        data_parallel(model, mesh, blocks=blocks)
        run = torch.compile(model, fullgraph=True)

        def held(m: torch.nn.Module) -> int:
            return m.accumulated_gradient_bytes()

    def step() -> int:
        seen = 0
        for i in range(MICRO_BATCHES):
            last = i == MICRO_BATCHES - 1
            if switch:
                model.set_requires_gradient_sync(last)
            if last:
                seen = held(model)
            run(x).square().mean().backward()
        model.zero_grad()
        return seen

    return step


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> bool:
    configs = chosen_configs(args, CONFIGS, SMOKE)
    with passes.install():
        steps = {c: build(c, i, args.model) for i, c in enumerate(configs)}
        held = {c: step() for c, step in steps.items()}  # compile, and the bytes held
        traffic = {c: record_collectives(step, world_size) or [] for c, step in steps.items()}
        medians = interleaved_median_ms(steps, args.steps)
    if rank:
        return True
    title = (
        f"{args.model}, fp32, {MICRO_BATCHES} micro-batches per step; {describe_link()}, gloo; "
        f"{args.steps} interleaved steps, medians on rank 0; torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    print(title + "\n")
    print(
        "| config | step (ms) | vs reducing each micro-batch | collectives | MB "
        "| unsharded gradients held (MB) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    for c in configs:
        peer = c.split(",")[0] + ", reduce each micro-batch"
        ms = medians[c]
        row = {
            "config": c,
            "median_ms": ms,
            "vs_peer": ms / medians[peer] if peer in medians else None,
            "collectives": len(traffic[c]),
            "mb": sum(call[3] for call in traffic[c]) / 1e6,
            "held_mb": held[c] / 1e6,
        }
        rows.append(row)
        vs = "-" if row["vs_peer"] is None else f"{row['vs_peer']:.2f}x"
        print(
            f"| {c} | {ms:.1f} | {vs} | {row['collectives']} | {row['mb']:.1f} | "
            f"{row['held_mb']:.2f} |"
        )
    results.write(
        args, "accumulation", describe_link(), [results.table(title, rows, ratio="vs_peer")]
    )
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", default="mlp-8x1024", choices=["mlp-2x64", "mlp-8x1024"])
    add_link_argument(parser)
    add_smoke_argument(parser)
    add_configs_argument(parser, CONFIGS)
    results.add_output_arguments(parser)
    parser.set_defaults(world_size=2)
    args = apply_smoke(parser.parse_args(), model="mlp-2x64")
    with contextlib.suppress(KeyboardInterrupt):
        launch(_worker, args)


if __name__ == "__main__":
    main()
