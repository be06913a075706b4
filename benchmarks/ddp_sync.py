"""Gradient synchronisation in DDP: this project's passes against the peers they must beat.

    python -m benchmarks.ddp_sync                 # 2 CPU ranks over loopback
    python -m benchmarks.ddp_sync --link 2gbit    # 2 ranks on a 2 Gbit/s link (root, ip, tc)

Models: MLPs of Linear + ReLU, ``mlp-32x256`` (32 layers of width 256: 64 small tensors, 4 MB
of bf16 gradients; at batch 32 its backward, ~10 ms here, is shorter than those bytes' ~17 ms
on a 2 Gbit/s link), ``mlp-32x256-b128`` (the same at batch 128: backward compute longer than
its gradient traffic) and ``mlp-8x1024`` (8 layers of width 1024 at batch 32: 16 tensors, 8.4M
parameters, bandwidth-bound on a slow link); the main example's transformer as
``transformer-small`` / ``transformer-medium``; ``mlp-2x64`` (2 layers of width 64, batch 8) is
the smallest run, to check that the script works. Configurations:

- peers: eager DDP (fp32), eager DDP + torch's ``fp16_compress_hook``, and compiled DDP with
  the same hook as ours plus torch's own bucketing (``torch._inductor.config
  .bucket_all_reduces_fx = "all"``);
- ours: compiled DDP + ``bf16_compress_hook`` with ``passes.install()`` (``default_pipeline``
  and Inductor's scheduling kept as the passes left it), and without passes for reference;
  compiled DDP + ``int8_compress_hook`` (error feedback on) with the passes, whose ratio to the
  bf16 row is printed under the table;
- compute alone: the same model compiled without DDP (no communication at all).

Every configuration's steps (forward + backward with gradient synchronisation) are interleaved,
one step of each in turn with the order rotated every step, so machine noise hits all alike.
Per configuration, on rank 0: median step, its ratio to the best peer's median, collectives
and bytes sent to collectives per step, and the exposed communication: time the step spends
blocked in ``wait_tensor``, from torch.profiler over 5 steps (eager DDP waits inside its C++
reducer, which the profiler does not attribute: "-"), and the time in matmuls per step from the
same profile (the same matmuls in every configuration: more time means the cores were busy
with something else, such as the collectives' own copies, reductions and socket traffic).

The bound printed under each table is what no schedule can beat: gradient traffic can start
only in backward, so a step takes at least forward + time to the first gradient + wire time of
every gradient byte in the wire dtype (an all_reduce of that many bf16 elements, timed on the
same link), or the step's compute alone if that is longer. The column "vs achievable" divides
each step by what this machine allows it: the larger of its collectives alone and the compute
alone while the wire is busy (``achievable.py``); "vs two-way contention" by the least step when
the compute and the collectives slow each other as much as measured here
(``achievable.contended_ms``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as ddp_default_hooks
from torch.nn.parallel import DistributedDataParallel

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
    vs_achievable,
)
from benchmarks.common.compile_time import time_fake_tensor_updates
from benchmarks.common.launch import (
    add_configs_argument,
    add_link_argument,
    add_smoke_argument,
    apply_smoke,
    chosen_configs,
    describe_link,
    itemsize,
    launch,
)
from benchmarks.common.models import MODELS, SMOKE_MODEL, loss_of, make_model
from benchmarks.common.step_timeline import COLLECTIVES, MATMULS, profiled_steps, timeline, waits

PEERS = ["eager DDP", "eager DDP + torch fp16 hook", "compiled + bf16 hook + torch bucketing"]
OURS = ["compiled + bf16 hook + passes"]
INT8 = "compiled + int8 hook + passes"
COMPUTE = "compute alone (compiled, no DDP)"
CONFIGS = PEERS + OURS + [INT8, "compiled + bf16 hook", COMPUTE]
SMOKE = ["eager DDP", *OURS, INT8, COMPUTE]  # what the report needs


class Config:
    def __init__(self, name: str, model: str, index: int, pipeline_options: dict):
        self.name = name
        self.net, self.inputs, self.target = make_model(model, index + 1)
        self.times: list[float] = []
        self.compiled = name.startswith("compiled") or name.startswith("compute")
        elements = sum(p.numel() for p in self.net.parameters())
        self.wire_bytes = None
        if name.startswith("eager"):
            self.model = DistributedDataParallel(self.net)
            if "fp16" in name:
                self.model.register_comm_hook(
                    dist.group.WORLD, ddp_default_hooks.fp16_compress_hook
                )
            # every parameter, in DDP's buckets
            self.wire_bytes = elements * (2 if "fp16" in name else 4)
        elif name.startswith("compute"):
            self.model = torch.compile(self.net)
            self.wire_bytes = 0
        elif "int8" in name:
            _, self.model = ch.compile_ddp(
                self.net, ch.QuantizedState(dist.group.WORLD), ch.int8_compress_hook
            )
        else:
            _, self.model = ch.compile_ddp(
                self.net, ch.LowPrecisionState(dist.group.WORLD), ch.bf16_compress_hook
            )
        self.inductor_config = {"bucket_all_reduces_fx": "all"} if "torch bucketing" in name else {}
        self.pipeline = passes.default_pipeline(**pipeline_options) if "passes" in name else None

    def _context(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch._inductor.config.patch(self.inductor_config))
        if self.pipeline is not None:
            stack.enter_context(passes.install(self.pipeline))
        if self.compiled:
            stack.enter_context(ch.compiled_autograd())
        return stack

    def step(self) -> None:
        # As ``optimizer.zero_grad()`` does by default: every backward creates its gradients
        # (one compiled backward graph for every step), and no step pays a memset of them.
        self.net.zero_grad(set_to_none=True)
        with self._context():
            out = self.model(*self.inputs)
            (loss_of(out, self.target) + 0 * self.net.extra.sum()).backward()

    def profile(self, steps: int = 5) -> None:
        """Collectives, bytes to collectives, blocked wait time per step, and the last step's
        timeline."""
        events = profiled_steps(self.step, steps)
        self.timeline = timeline(events)
        issued = [e for e in events if e.name in COLLECTIVES]
        functional = [e for e in issued if e.name.startswith("_c10d_functional")]
        self.collectives = len(functional or issued) / steps
        if self.wire_bytes is None:
            self.wire_bytes = (
                sum(math.prod(e.input_shapes[0]) * itemsize(e.input_dtypes[0]) for e in functional)
                / steps
            )
        self.exposed_ms = (
            sum(e.cpu_time_total for e in waits(events)) / 1e3 / steps if self.compiled else None
        )
        self.matmul_ms = sum(e.cpu_time_total for e in events if e.name in MATMULS) / 1e3 / steps


def wire_ms(elements: int, dtype: torch.dtype, reps: int = 10) -> tuple[float, float]:
    """Median wall time of an all_reduce of ``elements`` values of ``dtype`` on this group, and
    the CPU time this process (all its threads) spent meanwhile."""
    x = torch.ones(elements, dtype=dtype)
    wall, cpu = [], []
    for _ in range(reps + 1):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        dist.all_reduce(x)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall[1:]) * 1e3, statistics.median(cpu[1:]) * 1e3


def first_gradient_ms(model: str, reps: int = 10) -> tuple[float, float]:
    """Eager forward time and time from the start of backward to the first gradient
    (post-accumulate-grad hook), medians; the compiled backward is one kernel sequence with no
    such hook point, and eager runs the same matmuls."""
    net, inputs, target = make_model(model, 1)
    stamps: list[float] = []
    for p in net.parameters():
        p.register_post_accumulate_grad_hook(lambda _: stamps.append(time.perf_counter()))
    fwd, first = [], []
    for _ in range(reps + 1):
        stamps.clear()
        t0 = time.perf_counter()
        loss = loss_of(net(*inputs), target)
        t1 = time.perf_counter()
        loss.backward()
        fwd.append(t1 - t0)
        first.append(min(stamps) - t1)
    return statistics.median(fwd[1:]) * 1e3, statistics.median(first[1:]) * 1e3


def run_model(
    rank: int,
    model: str,
    steps: int,
    pipeline_options: dict,
    link: str | None,
    traffic,
    names: list[str] = CONFIGS,
    traced: str = OURS[0],
) -> dict | None:
    """Time, profile and print one model's table (rank 0) of the configurations ``names``,
    which hold one peer at least, ours, int8, the compute alone and ``traced`` (whose profiled
    step's timeline is printed); returns it for ``results``."""
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = True  # eager DDP first: the C++ reducer
    names = [n for n in names if n.startswith("eager")] + [
        n for n in names if not n.startswith("eager")
    ]
    configs = [Config(n, model, i, pipeline_options) for i, n in enumerate(names)]
    updating = time_fake_tensor_updates()
    for c in configs:
        counters["passes"].clear()
        t0, updated = time.perf_counter(), updating.passes
        c.step()  # compile; eager DDP builds its final buckets after the first iteration
        c.step()  # compiled autograd may build one more graph per model on the second step
        c.compile_s, c.passes_s = time.perf_counter() - t0, counters["passes"]["pipeline: us"] / 1e6
        c.update_s = updating.passes - updated
    for i in range(steps):
        for c in configs[i % len(configs) :] + configs[: i % len(configs)]:
            dist.barrier()
            t0 = time.perf_counter()
            c.step()
            c.times.append(time.perf_counter() - t0)
    world = dist.get_world_size()
    for c in configs:
        c.profile()
        c.calls = record_collectives(c.step, world)
        c.alone_ms = replay_ms(c.calls, world)
    compute_alone = next(c for c in configs if c.name == COMPUTE)
    busy = compute_busy_ms(compute_alone.step, compute_alone.times, traffic, link)
    for c in configs:  # every rank replays the collectives
        c.alone_busy_ms = under_compute_ms(c.calls, world, compute_alone.step)
    elements = sum(p.numel() for p in configs[0].net.parameters())
    wire, wire_cpu = wire_ms(elements, torch.bfloat16)
    fwd, first = first_gradient_ms(model)
    ours = next(c for c in configs if c.name in OURS)
    timelines = [None] * dist.get_world_size()
    shown = next(c for c in configs if c.name == traced)
    dist.all_gather_object(timelines, shown.timeline)  # the same profiled step on every rank
    if rank != 0:
        return None
    configs.sort(key=lambda c: CONFIGS.index(c.name))
    median = {c.name: statistics.median(c.times) * 1e3 for c in configs}
    best_peer = min((p for p in PEERS if p in median), key=median.__getitem__)
    compute = median[COMPUTE]
    bound = max(fwd + first + wire, compute)
    tensors = sum(1 for _ in configs[0].net.parameters()) - 1
    print(f"\n### {model} ({tensors} tensors, {(elements - 1) / 1e6:.2f}M parameters)\n")
    print(
        "| configuration | median step (ms) | vs best peer | vs bound | collectives/step | MB to "
        "collectives/step | exposed communication (ms/step) | matmuls (ms/step) | vs achievable | "
        "vs two-way contention |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = [
        dict(
            config=c.name,
            median_ms=median[c.name],
            vs_best_peer=median[c.name] / median[best_peer],
            vs_bound=median[c.name] / bound,
            collectives=c.collectives,
            mb=c.wire_bytes / 2**20,
            exposed_ms=c.exposed_ms,
            matmul_ms=c.matmul_ms,
            alone_ms=c.alone_ms,
            achievable_ms=achievable_ms(busy, c.alone_ms),
            alone_busy_ms=c.alone_busy_ms,
            contended_ms=contended_ms(compute, busy, c.alone_ms, c.alone_busy_ms),
        )
        for c in configs
    ]
    for r in rows:
        exposed = "-" if r["exposed_ms"] is None else f"{r['exposed_ms']:.1f}"
        print(
            f"| {r['config']} | {r['median_ms']:.1f} | {r['vs_best_peer']:.2f}x | "
            f"{r['vs_bound']:.2f}x | {r['collectives']:g} | {r['mb']:.1f} | {exposed} | "
            f"{r['matmul_ms']:.1f} | {vs_achievable(r['median_ms'], r['achievable_ms'])} | "
            f"{vs_achievable(r['median_ms'], r['contended_ms'])} |"
        )
    print(
        f"\n{INT8}: {median[INT8] / median[OURS[0]]:.2f}x {OURS[0]} (int8 with error feedback "
        "against bf16, both with the passes)."
    )
    share = (ours.passes_s + ours.update_s) / ours.compile_s
    print(
        f"\nthe passes took {ours.passes_s * 1e3:.0f} ms, and Inductor's fake-tensor update of "
        f"what they changed {ours.update_s * 1e3:.0f} ms, of the {ours.compile_s:.1f} s its first "
        f"two steps took (compile included; {share:.1%}; 0 when Inductor served the graphs from "
        "its cache)."
    )
    print(
        f"\ntimeline of one profiled step of {shown.name} on every rank (ms from the step's start; "
        "every collective's issue, its time in the backend's thread, its wait):\n"
    )
    for r, lines in enumerate(timelines):
        print(f"  rank {r}:\n" + "\n".join("    " + line for line in lines))
    print(
        f"\nbest peer: {best_peer}. Bound {bound:.1f} ms = max(forward {fwd:.1f} + first gradient "
        f"{first:.1f} + wire time of all gradients in bf16 {wire:.1f}, compute alone "
        f"{compute:.1f}); forward and first gradient timed eagerly, wire time as one all_reduce "
        f"of {elements / 1e6:.2f}M bf16 elements, which also took {wire_cpu:.1f} ms of CPU time "
        "in each rank's process. Achievable per row: the larger of its collectives alone (the "
        "same collectives issued back to back with nothing else) and "
        f"{TRAFFIC_ROW!r} ({busy:.1f} ms), what this machine allows the step. Two-way "
        "contention per row: the least step of achievable.contended_ms, from the compute alone, "
        "that, the row's collectives alone and the same with the compute alone running "
        "alongside ("
        + ", ".join(
            "-" if r["alone_busy_ms"] is None else f"{r['alone_busy_ms']:.0f}" for r in rows
        )
        + " ms per row)."
    )
    return results.table(
        f"{model} ({tensors} tensors, {(elements - 1) / 1e6:.2f}M parameters)",
        rows,
        ratio="vs_best_peer",
        bound_ms=bound,
        note=f"forward {fwd:.1f} + first gradient {first:.1f} + wire {wire:.1f} ms; "
        f"compute alone {compute:.1f} ms; {TRAFFIC_ROW} {busy:.1f} ms",
    )


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> bool:
    if rank == 0:
        print(
            f"{describe_link()}, gloo, 1 thread each; {args.steps} interleaved steps per "
            f"configuration, medians on rank 0; torch {torch.__version__}, "
            f"{time.strftime('%Y-%m-%d')}",
            flush=True,
        )
    traffic = dist.new_group(backend="gloo")  # for under_traffic_ms, on every rank
    tables = [
        run_model(
            rank,
            model,
            args.steps,
            _pipeline_options(args),
            args.link,
            traffic,
            chosen_configs(args, CONFIGS, [*SMOKE, args.timeline]),
            args.timeline,
        )
        for model in args.models
    ]
    if rank == 0:
        results.write(args, "ddp_sync", describe_link(), tables)
    return True


def _pipeline_options(args: argparse.Namespace) -> dict:
    """The passes' options the command line sets."""
    names = ("bucket_cap_mb", "quantized_bucket_cap_mb")
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--models",
        nargs="+",
        default=["mlp-32x256", "mlp-32x256-b128", "mlp-8x1024"],
        choices=list(MODELS),
    )
    parser.add_argument(
        "--bucket-cap-mb", type=float, help="the passes' bucket cap (default: the pipeline's)"
    )
    parser.add_argument(
        "--quantized-bucket-cap-mb",
        type=float,
        help="the passes' bucket cap for int8 collectives (default: the pipeline's)",
    )
    parser.add_argument(
        "--timeline",
        choices=CONFIGS,
        default=OURS[0],
        metavar="CONFIG",
        help=f"the configuration whose profiled step's timeline is printed (default: {OURS[0]})",
    )
    add_link_argument(parser)
    add_smoke_argument(parser)
    add_configs_argument(parser, CONFIGS)
    results.add_output_arguments(parser)
    parser.set_defaults(world_size=2)
    launch(_worker, apply_smoke(parser.parse_args(), models=[SMOKE_MODEL]))


if __name__ == "__main__":
    main()
