"""Pipeline parallelism with data-parallel stages: pp 2 x dp 2 on 4 gloo ranks over loopback,
torch's ``PipelineStage`` and ``Schedule1F1B``, stages sharded by FSDP2 or by ``data_parallel``.

    python -m benchmarks.pipeline

Model: 8 blocks of Linear(1024, 1024) + ReLU split into 2 stages of 4, fp32, 4 micro-batches of
32 per step, a mean-square loss. Configurations: FSDP2 stages eager and with each block compiled
(torchtitan's default), ``data_parallel`` stages compiled whole and per block, with the passes
(under PP it keeps its gathered parameters for backward, torchtitan's default there; FSDP2's
stages are built with ``reshard_after_forward=False`` too). Steps (the schedule's step and SGD)
are interleaved, one of each configuration in turn; medians on rank 0. Per configuration: the
median step, its ratio to FSDP2 eager, and per step on rank 0, the collectives and MB on the
data-parallel group (all-gathers, reduce-scatters, all-to-alls) and the pipeline's sends and
receives (the profiler's count over one step each). This 2-core machine runs 4 ranks: no speed bound
is claimed; the counts are the point.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import passes
from benchmarks.common import results
from benchmarks.common.achievable import record_collectives
from benchmarks.common.launch import (
    add_configs_argument,
    add_smoke_argument,
    apply_smoke,
    chosen_configs,
    interleaved_median_ms,
    launch,
)
from compiled_hooks.fsdp import data_parallel

CONFIGS = [
    "FSDP2 + PP eager",
    "FSDP2 + PP, each block compiled",
    "data_parallel + PP, each stage compiled, passes",
    "data_parallel + PP, each block compiled, passes",
]
SMOKE = [CONFIGS[0], CONFIGS[2]]
MICRO_BATCHES = 4


def build(config: str, mesh, width: int, blocks: int, batch: int) -> Callable[[], None]:
    """One step of ``config`` on this rank: the schedule's step, then SGD."""
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks)]
    pp = mesh["pp"].get_local_rank()
    stage_module = nn.Sequential(*layers[pp * blocks // 2 : (pp + 1) * blocks // 2])
    if config.startswith("FSDP2"):
        for block in stage_module:
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
        fully_shard(stage_module, mesh=mesh["dp"], reshard_after_forward=False)
    else:
        data_parallel(stage_module, mesh["dp"], blocks=list(stage_module))
    if "each block compiled" in config:
        for block in stage_module:  # FSDP2's hooks break the graph (first_step.py's peer too)
            block.compile(fullgraph=config.startswith("data_parallel"))
    elif "each stage compiled" in config:
        stage_module.compile(fullgraph=True)
    stage = PipelineStage(stage_module, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(
        stage, n_microbatches=MICRO_BATCHES, loss_fn=lambda out, y: (out - y).square().mean()
    )
    opt = torch.optim.SGD(stage_module.parameters(), lr=1e-3)
    x = torch.randn(batch * MICRO_BATCHES, width)

    def step() -> None:
        if pp == 0:
            schedule.step(x)
        else:
            schedule.step(target=x)
        opt.step()
        opt.zero_grad()

    return step


def traffic(step: Callable[[], None], dp_size: int) -> tuple[int, float, int]:
    """In one ``step()`` each: the collectives on the data-parallel group and their MB
    (``achievable.record_collectives``: an all-gather's output, a reduce-scatter's or
    all-to-all's input), and the pipeline's sends and receives."""
    calls = record_collectives(step, dp_size) or []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    p2p = sum(1 for e in prof.events() if e.name in ("c10d::send", "c10d::recv_"))
    return len(calls), sum(c[3] for c in calls) / 1e6, p2p


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> bool:
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "dp"))
    configs = chosen_configs(args, CONFIGS, SMOKE)
    with passes.install():
        steps = {c: build(c, mesh, args.width, args.blocks, args.batch) for c in configs}
        for step in steps.values():  # compile
            step()
        counted = {c: traffic(step, world_size // 2) for c, step in steps.items()}
        medians = interleaved_median_ms(steps, args.steps)
    if rank:
        return True
    title = (
        f"{args.blocks} x Linear({args.width}, {args.width}) in 2 stages, {MICRO_BATCHES} "
        f"micro-batches of {args.batch}, Schedule1F1B; pp 2 x dp {world_size // 2}, gloo over "
        f"loopback; {args.steps} interleaved steps, medians on rank 0; torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    print(title + "\n")
    print("| config | step (ms) | vs FSDP2 + PP eager | dp collectives | dp MB | pp sends/recvs |")
    print("|---|---:|---:|---:|---:|---:|")
    base = medians[CONFIGS[0]]
    rows = []
    for c in configs:
        ms = medians[c]
        dp_calls, dp_mb, pp_calls = counted[c]
        vs = ms / base
        rows.append(
            dict(
                config=c,
                median_ms=ms,
                vs_peer=vs,
                dp_collectives=dp_calls,
                dp_mb=dp_mb,
                pp_p2p=pp_calls,
            )
        )
        print(f"| {c} | {ms:.1f} | {vs:.2f}x | {dp_calls} | {dp_mb:.1f} | {pp_calls} |")
    results.write(args, "pipeline", "loopback", [results.table(title, rows, ratio="vs_peer")])
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    add_smoke_argument(parser)
    add_configs_argument(parser, CONFIGS)
    results.add_output_arguments(parser)
    parser.set_defaults(world_size=4, link=None)
    args = apply_smoke(parser.parse_args(), width=64, blocks=4, batch=4)
    launch(_worker, args)


if __name__ == "__main__":
    main()
