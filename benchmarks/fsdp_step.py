"""FSDP training steps: compile-native ``data_parallel`` against FSDP2 and a SimpleFSDP-style
compile.

    python -m benchmarks.fsdp_step                 # 2 CPU ranks over loopback
    python -m benchmarks.fsdp_step --link 2gbit    # 2 ranks on a 2 Gbit/s link (root, ip, tc)

Models: ``mlp-8x1024`` (8 Linear(1024, 1024) + ReLU, batch 32, every Linear a block) and
``transformer`` (the main example's transformer at width 256, 4 blocks, batch 8); ``mlp-2x64``
(2 Linear(64, 64), batch 8) is the smallest run, to check that the script works. Every
configuration reduces gradients in bf16, with fp32 parameters or ``param_dtype`` bf16:

- peers: FSDP2 eager (``fully_shard`` per block and the root, resharding after forward); FSDP2
  with every block compiled; SimpleFSDP-style (parameters as ``Shard(0)`` DTensors
  redistributed to ``Replicate`` on use, keeping the gathered parameters for backward, written
  here) compiled whole with Inductor's FSDP bucketing (``bucket_all_gathers_fx="only_fsdp"``,
  ``bucket_reduce_scatters_fx="all"``);
- ours: ``data_parallel`` with ``reduce_dtype`` bf16, compiled whole, with and without
  ``passes.install()``, for ``reshard_after_forward`` True and False; and ``data_parallel``
  keeping its gathered parameters with int8 on the wire both ways (``gather_dtype=torch.int8``
  and ``int8_compress_hook`` with error feedback, no ``reduce_dtype``) with the passes, whose
  peer is the bf16 ``data_parallel keep + passes`` row;
- compute alone: the unsharded model compiled, no communication.

Steps (forward + backward) are interleaved, one of each configuration in turn, the order rotated
every step; medians on rank 0. Per configuration: median step, its ratio to the best compiled
peer (``keep`` rows) or to FSDP2 eager (``reshard`` rows), collectives and MB they move per step
(counted by the profiler over one step: the full size of each all-gather's output and
reduce-scatter's input), and the peak bytes of gathered parameters alive at once, from the
partitioned forward and backward graphs of our configurations. Two references per row: the bound,
each rank sending ``(N - 1) / N`` of every collective's full size at the link's rate, or the compute
alone if longer; and the same collectives issued back to back with nothing else, which on gloo
take well over their bytes' time (its reduce-scatter runs at under half the link rate), so a step
at 1.0x of them overlaps all of its compute. Last, one more reference row: the compute alone
again while a second gloo group sends all_to_alls (in the passes' pieces) as fast as the link
takes them, from a thread of each rank: what the compute costs when the wire is busy, which on
a machine whose ranks share few cores is what overlapping communication makes it cost. The
column "vs achievable" divides each step by the larger of that row and the configuration's
collectives alone: what this machine allows the step, if communication and compute overlap
fully. The column "vs two-way contention" accounts for the collectives slowing down too while
the cores compute: their replay again while a thread of each rank runs the compute alone over
and over, and ``achievable.contended_ms``, the least step when overlap slows both sides by the
measured factors.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import compiled_hooks as ch
import passes
from benchmarks.common import results
from benchmarks.common.achievable import (
    TRAFFIC_ROW,
    achievable_ms,
    compute_busy_ms,
    contended_ms,
    record_collectives,
    replay_ms,
    under_compute_ms,
)
from benchmarks.common.launch import (
    add_configs_argument,
    add_link_argument,
    add_smoke_argument,
    apply_smoke,
    chosen_configs,
    describe_link,
    launch,
    link_bytes_per_s,
)
from benchmarks.common.models import MLPS, SMOKE_MODEL, make_blocks_model, synchronize
from benchmarks.common.simple_fsdp import INDUCTOR_FSDP_BUCKETING, simple_fsdp
from benchmarks.common.step_timeline import profiled_steps, timeline
from compiled_hooks.fsdp import data_parallel, register_comm_hook
from passes.testing import gathered_bytes_alive, partitioned_graphs


class Config:
    def __init__(self, name: str, model: str, index: int, mesh, param_dtype):
        self.name, self.times = name, []
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.bfloat16)
        net, blocks, self.x = make_blocks_model(model, index)
        self.options: dict[str, Any] = {}
        self.installed = False
        self.peak_mb: float | None = None
        if name.startswith("FSDP2"):
            for b in blocks:
                fully_shard(b, mesh=mesh, mp_policy=mp)
                if "compiled" in name:
                    b.compile()
            self.run = fully_shard(net, mesh=mesh, mp_policy=mp)
        elif name.startswith("SimpleFSDP"):
            self.run = torch.compile(simple_fsdp(net, mesh, mp), fullgraph=True)
            self.options = INDUCTOR_FSDP_BUCKETING
            self.x = self._cast(param_dtype)
        elif name.startswith("compute"):
            self.run = torch.compile(net.to(param_dtype or torch.float32), fullgraph=True)
            self.x = self._cast(param_dtype)
        else:
            reshard, int8 = "reshard" in name, "int8" in name
            self.installed = "passes" in name
            if int8:  # the hook compresses by itself
                mp = MixedPrecisionPolicy(param_dtype=param_dtype)
            self.net = data_parallel(
                net,
                mesh,
                mp_policy=mp,
                reshard_after_forward=reshard,
                blocks=blocks,
                gather_dtype=torch.int8 if int8 else None,
            )
            if int8:
                state = ch.QuantizedState(mesh.get_group())
                register_comm_hook(self.net, state, ch.int8_compress_hook)
            self.run = torch.compile(self.net, fullgraph=True)

    def _cast(self, dtype) -> torch.Tensor:
        return self.x.to(dtype) if dtype is not None and self.x.is_floating_point() else self.x

    def context(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch._inductor.config.patch(self.options))
        if self.installed:
            stack.enter_context(passes.install())
        return stack

    def step(self) -> None:
        with self.context():
            out = self.run(self.x)
            out.float().square().mean().backward()
        synchronize(self.x.device)

    def measure_peak(self) -> None:
        """Peak gathered-parameter bytes alive in the partitioned forward and backward graphs
        (not for int8 gathers: what they gather is int8, what the blocks use is computed from
        it)."""
        if not hasattr(self, "net") or self.name == INT8:
            return
        graphs = partitioned_graphs(
            lambda compile: (
                compile(self.net, fullgraph=True)(self.x).float().square().mean().backward()
            )
        )
        self.peak_mb = (
            max(max(gathered_bytes_alive(gm.graph), default=0) for _, gm in graphs) / 2**20
        )


PEERS_KEEP = ["SimpleFSDP-style + Inductor bucketing"]
PEERS_RESHARD = ["FSDP2 eager", "FSDP2 compiled per block"]
INT8 = "data_parallel keep + int8 + passes"
OURS = [
    "data_parallel keep",
    "data_parallel keep + passes",
    "data_parallel reshard",
    "data_parallel reshard + passes",
    INT8,
]
COMPUTE = "compute alone (compiled, unsharded)"  # last: the references are measured with it
CONFIGS = PEERS_RESHARD + PEERS_KEEP + OURS + [COMPUTE]
# what the report needs
SMOKE = ["FSDP2 eager", *PEERS_KEEP, "data_parallel keep + passes", COMPUTE]


def run_model(
    rank: int,
    world: int,
    model: str,
    param_dtype,
    steps: int,
    link: str | None,
    traffic,
    names: list[str] = CONFIGS,
    traced: tuple[str, ...] = (),
) -> dict | None:
    """Time and print one model's table (rank 0) of the configurations ``names`` (the compute
    alone last), and the timeline of a profiled step of each of ``traced`` on every rank;
    returns the table for ``results``."""
    torch._dynamo.reset()
    # data_parallel's root forward is one code object, compiled per configuration and again
    # for its peak-memory graphs
    torch._dynamo.config.recompile_limit = 2 * len(names)
    mesh = init_device_mesh("cpu", (world,))
    configs = [Config(n, model, i, mesh, param_dtype) for i, n in enumerate(names)]
    for c in configs:
        c.step()  # compile
        c.step()
        c.calls = record_collectives(c.step, world)
        c.collectives, c.mb = len(c.calls), sum(b for *_, b in c.calls) / 2**20
        c.alone_ms = replay_ms(c.calls, world)
        c.measure_peak()
    for i in range(steps):
        for c in configs[i % len(configs) :] + configs[: i % len(configs)]:
            dist.barrier()
            t0 = time.perf_counter()
            c.step()
            c.times.append(time.perf_counter() - t0)
    rate = link_bytes_per_s(link)
    busy = compute_busy_ms(configs[-1].step, configs[-1].times, traffic, link)
    for c in configs:
        c.alone_busy_ms = under_compute_ms(c.calls, world, configs[-1].step)
    timelines: dict[str, list] = {}
    for name in traced:
        timelines[name] = [None] * world
        shown = next(c for c in configs if c.name == name)
        dist.all_gather_object(timelines[name], timeline(profiled_steps(shown.step, 3)))
    if rank != 0:
        return None
    median = {c.name: statistics.median(c.times) * 1e3 for c in configs}
    compute = median[COMPUTE]
    dtype = "fp32" if param_dtype is None else "bf16"
    title = f"{model}, param_dtype {dtype}, reduce bf16"
    print(f"\n### {title}\n")
    print(
        "| configuration | median step (ms) | vs peer | vs bound | vs its collectives alone | "
        "vs achievable | vs two-way contention | collectives/step | MB/step | peak gathered MB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    best_keep = min(PEERS_KEEP, key=median.__getitem__)
    rows = []
    for c in configs:
        peer = best_keep if "keep" in c.name or c.name.startswith("SimpleFSDP") else "FSDP2 eager"
        if c.name == INT8:
            peer = "data_parallel keep + passes"
        wire = c.mb * 2**20 * (world - 1) / world / rate * 1e3 if rate else 0.0
        bound = max(wire, compute)
        achievable = achievable_ms(busy, c.alone_ms)
        contended = contended_ms(compute, busy, c.alone_ms, c.alone_busy_ms)
        rows.append(
            dict(
                config=c.name,
                median_ms=median[c.name],
                vs_peer=median[c.name] / median[peer],
                vs_bound=median[c.name] / bound,
                alone_ms=c.alone_ms,
                vs_alone=median[c.name] / c.alone_ms if c.alone_ms else None,
                achievable_ms=achievable,
                vs_achievable=median[c.name] / achievable,
                alone_busy_ms=c.alone_busy_ms,
                contended_ms=contended,
                vs_contended=median[c.name] / contended,
                collectives=c.collectives,
                mb=c.mb,
                peak_gathered_mb=c.peak_mb,
                bound_ms=bound,
                peer=peer,
            )
        )
    rows.append(
        dict(
            config=TRAFFIC_ROW,
            median_ms=busy,
            vs_peer=busy / median["FSDP2 eager"],
            vs_bound=busy / compute,
            alone_ms=0.0,
            vs_alone=None,
            achievable_ms=busy,
            vs_achievable=1.0,
            alone_busy_ms=0.0,
            contended_ms=busy,
            vs_contended=1.0,
            collectives=0,
            mb=0.0,
            peak_gathered_mb=None,
            bound_ms=compute,
            peer="FSDP2 eager",
        )
    )
    for r in rows:
        peak = "-" if r["peak_gathered_mb"] is None else f"{r['peak_gathered_mb']:.1f}"
        alone = "-" if r["vs_alone"] is None else f"{r['vs_alone']:.2f}x ({r['alone_ms']:.0f} ms)"
        print(
            f"| {r['config']} | {r['median_ms']:.1f} | {r['vs_peer']:.2f}x ({r['peer']}) | "
            f"{r['vs_bound']:.2f}x ({r['bound_ms']:.0f} ms) | {alone} | "
            f"{r['vs_achievable']:.2f}x ({r['achievable_ms']:.0f} ms) | "
            f"{r['vs_contended']:.2f}x ({r['contended_ms']:.0f} ms) | {r['collectives']} | "
            f"{r['mb']:.1f} | {peak} |"
        )
    print(
        "\nbound per row: max(its collectives' bytes sent per rank at "
        f"{'the link rate' if rate else 'an unknown rate (loopback: not counted)'}, compute alone "
        f"{compute:.1f} ms); collectives alone: the same collectives issued back to back with "
        "nothing else, the time gloo needs for them here; achievable: the larger of that and "
        f"{TRAFFIC_ROW!r} ({busy:.1f} ms), what this machine allows the step; two-way "
        "contention: the least step of achievable.contended_ms, from the compute alone, that "
        "row, its collectives alone and the same with the compute alone running alongside ("
        + ", ".join(f"{r['alone_busy_ms']:.0f}" for r in rows[:-1])
        + " ms per row)"
    )
    for name, per_rank in timelines.items():
        print(
            f"\ntimeline of one profiled step of {name} on every rank (ms from the step's "
            "start; every collective's issue, its time in the backend's thread, its wait):\n"
        )
        for r, lines in enumerate(per_rank):
            print(f"  rank {r}:\n" + "\n".join("    " + line for line in lines))
    return results.table(title, rows, ratio="vs_peer", note=f"compute alone {compute:.1f} ms")


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> bool:
    if rank == 0:
        print(
            f"{describe_link()}, gloo, 1 thread each; {args.steps} interleaved steps per "
            f"configuration, medians on rank 0; torch {torch.__version__}, "
            f"{time.strftime('%Y-%m-%d')}",
            flush=True,
        )
    dtypes = {"fp32": None, "bf16": torch.bfloat16}
    traffic = dist.new_group(backend="gloo")  # for under_traffic_ms, on every rank
    tables = [
        run_model(
            rank,
            world_size,
            model,
            dtypes[d],
            args.steps,
            args.link,
            traffic,
            chosen_configs(args, CONFIGS, SMOKE + args.timeline),
            tuple(args.timeline),
        )
        for model in args.models
        for d in args.param_dtypes
    ]
    if rank == 0:
        results.write(args, "fsdp_step", describe_link(), tables)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--models",
        nargs="+",
        default=["mlp-8x1024", "transformer"],
        choices=[*MLPS, "transformer"],
    )
    parser.add_argument(
        "--param-dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"]
    )
    parser.add_argument(
        "--timeline",
        nargs="+",
        default=[],
        choices=CONFIGS,
        metavar="CONFIG",
        help="print the timeline of a profiled step of these configurations on every rank",
    )
    add_link_argument(parser)
    add_smoke_argument(parser)
    add_configs_argument(parser, CONFIGS)
    results.add_output_arguments(parser)
    parser.set_defaults(world_size=2)
    args = apply_smoke(parser.parse_args(), models=[SMOKE_MODEL], param_dtypes=["fp32"])
    launch(_worker, args)


if __name__ == "__main__":
    main()
