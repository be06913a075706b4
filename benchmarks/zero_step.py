"""A whole training step with a sharded optimizer: torch's ZeRO vs this project's compiled ZeRO.

    python -m benchmarks.zero_step                # 2 CPU ranks over loopback
    python -m benchmarks.zero_step --link 2gbit   # 2 ranks on a 2 Gbit/s link (root, ip, tc)
    python -m benchmarks.zero_step --profile      # and each configuration's kernel profile

Same model (the main example's transformer) and batch for every configuration; their steps are
interleaved (one step of each in turn, the order rotated every step) so that machine noise hits
all of them alike. A step is forward + backward + AdamW step, gradients averaged over the
ranks; every DDP is built with ``bucket_cap_mb=4`` (with DDP's default 25 MB the
transformer's 12.8 MB of gradients go out in two buckets, the second only when backward ends;
the ZeRO hooks bucket by it, and the unsharded compiled DDP then issues 4 all_reduces instead of
2). Reported per configuration: median step time on rank 0, its ratio to the first
configuration, collectives per step (Inductor's output code for the compiled ones),
optimizer-state bytes per rank, and how far the parameters ended from the first
configuration's (relative to the largest parameter; all train the same model on the same data):

- compiled DDP + AdamW: unsharded optimizer (every rank holds all state), step after backward;
  and the same with torch's own all_reduce bucketing in Inductor
  (``torch._inductor.config.bucket_all_reduces_fx = "all"``, "torch bucketing");
- eager DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)``: its overlap mode
  (``overlap_with_ddp=True`` with ``ddp_zero_hook``) needs NCCL, so it steps after backward;
- compiled ZeRO (``compiled_hooks.zero``), the step inside the compiled backward, with the
  default pipeline (which schedules it with ``interleave_zero_broadcasts``), in both schedules,
  and with ``shard_buckets=True`` without and with ``shard_weight_update`` (forced on gloo,
  where the pass leaves graphs alone by default);
- compiled DDP without an optimizer step: the reference for the optimizer step's time where
  the step runs inside the backward (the column "optimizer step").

Then the optimizer step alone, profiled: torch's ``Optimizer.step`` of the unsharded
configuration and the compiled ZeRO update of every bucket (after backward), 20 calls in turn;
its compute per call (ops and kernels, communication and the compiled step's entry excluded,
see :func:`step_alone`, ``NOT_COMPUTE``) and the median of the calls' ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
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
from benchmarks.common.launch import (
    add_link_argument,
    add_smoke_argument,
    apply_smoke,
    describe_link,
    launch,
)
from benchmarks.common.models import TinyTransformer, batch, loss_fn
from compiled_hooks.zero import ZeroOptimizer, hook_with_zero_step, hook_with_zero_step_interleaved

LR = 1e-3
BUCKET_CAP_MB = 4  # every DDP here (see the module docstring)
NO_STEP = "compiled DDP, no optimizer step"
COMPUTE = "compute alone (compiled, no DDP) + AdamW"
CONFIGS = [
    "compiled DDP + AdamW (unsharded)",
    "compiled DDP + AdamW (unsharded), torch bucketing",
    "eager DDP + torch ZeroRedundancyOptimizer",
    "compiled ZeRO, after backward",
    "compiled ZeRO, interleaved",
    "compiled ZeRO, interleaved, shard_buckets",
    "compiled ZeRO, interleaved, shard_buckets + shard_weight_update",
    NO_STEP,
    COMPUTE,
]
SMOKE = [CONFIGS[0], "compiled ZeRO, interleaved", NO_STEP, COMPUTE]  # what the report needs
COLLECTIVE = re.compile(
    r"_c10d_functional\.(all_reduce|reduce_scatter_tensor|all_gather_into_tensor|broadcast|all_to_all_single)\w*"
    r"\.default\("
)


def _state_bytes(state: dict) -> int:
    return sum(
        t.numel() * t.element_size()
        for s in state.values()
        for t in s.values()
        if torch.is_tensor(t)
    )


class Config:
    def __init__(self, name: str, size: dict, tokens, targets):
        torch.manual_seed(0)
        self.name, self.net, self.tokens, self.targets = (
            name,
            TinyTransformer(**size),
            tokens,
            targets,
        )
        self.times: list[float] = []
        self.compiled = name.startswith(("compiled", "compute"))
        self.pipeline = None
        self.zero = self.opt = None
        if name.startswith("eager"):
            self.model = DistributedDataParallel(self.net, bucket_cap_mb=BUCKET_CAP_MB)
            self.opt = ZeroRedundancyOptimizer(
                self.net.parameters(), optimizer_class=torch.optim.AdamW, lr=LR
            )
        elif "ZeRO" in name:
            shard = "shard_buckets" in name
            self.zero = ZeroOptimizer(
                self.net.parameters(), torch.optim.AdamW, shard_buckets=shard, lr=LR
            )
            ddp, self.model = ch.compile_ddp(self.net, bucket_cap_mb=BUCKET_CAP_MB)
            make = (
                hook_with_zero_step if "after backward" in name else hook_with_zero_step_interleaved
            )
            ddp.register_comm_hook(
                ch.DefaultState(dist.group.WORLD), make(ch.allreduce_hook, ddp, self.zero, shard)
            )
            # shard_weight_update is forced on gloo here, to measure it (by default it leaves gloo
            # alone)
            forced = {"shard_weight_update": True, "shard_backends": ("gloo", "nccl")}
            self.pipeline = passes.default_pipeline(
                **(forced if "shard_weight_update" in name else {})
            )
        elif name == COMPUTE:
            self.model = torch.compile(self.net)
            self.opt = torch.optim.AdamW(self.net.parameters(), lr=LR)
        else:
            _, self.model = ch.compile_ddp(self.net, bucket_cap_mb=BUCKET_CAP_MB)
            self.opt = None if name == NO_STEP else torch.optim.AdamW(self.net.parameters(), lr=LR)
        self.inductor_config = {"bucket_all_reduces_fx": "all"} if "torch bucketing" in name else {}
        self.step_times: list[float] = []  # the optimizer step alone, where it runs after backward
        if self.compiled:
            for p in self.net.parameters():  # one backward graph for every step
                p.grad = torch.zeros_like(p)
        self.collectives = None

    def step(self) -> None:
        self.net.zero_grad(set_to_none=False)
        if self.compiled:
            with (
                passes.install(self.pipeline) if self.pipeline else contextlib.nullcontext(),
                ch.compiled_autograd(),
                torch._inductor.config.patch(self.inductor_config),
            ):
                loss_fn(self.model, self.tokens, self.targets).backward()
        else:
            loss_fn(self.model, self.tokens, self.targets).backward()
        if self.opt is not None:
            t0 = time.perf_counter()
            self.opt.step()
            self.step_times.append(time.perf_counter() - t0)

    def first_step(self) -> None:
        if self.compiled:
            from torch._inductor.utils import run_and_get_code

            _, codes = run_and_get_code(self.step)
            self.collectives = len(COLLECTIVE.findall("\n".join(codes)))
        else:
            self.step()

    def state_bytes(self) -> int:
        if self.zero is not None:
            return self.zero.state_bytes()
        if isinstance(self.opt, ZeroRedundancyOptimizer):
            return _state_bytes(self.opt.optim.state)
        return _state_bytes(self.opt.state)


PROFILED = [
    "compiled DDP + AdamW (unsharded)",
    "compiled ZeRO, after backward",
    "compiled ZeRO, interleaved",
    NO_STEP,
]
ALONE = ["compiled DDP + AdamW (unsharded)", "compiled ZeRO, after backward"]
ALONE_CALLS = 20
# not the optimizer's compute: communication (issuing collectives, waiting for them, the
# barrier between calls; gloo's and NCCL's own threads), and the entry into the step compiled
# alone (Dynamo's guard check, the compiled graph's call and argument checks: inside the
# backward the step shares the backward graph's)
NOT_COMPUTE = (
    "_c10d_functional::",
    "c10d::",
    "gloo:",
    "nccl:",
    "TorchDynamo Cache Lookup",
    "## Call CompiledFxGraph",
    "Torch-Compiled Region",
    "AOTDispatcher",
    "Pregraph bytecode",
)


def profile(fn: Callable[[], Any], calls: int):
    """``calls`` calls of ``fn`` under ``torch.profiler``, a barrier before each: its events,
    averaged by name."""
    with torch.profiler.profile() as prof:
        for _ in range(calls):
            dist.barrier()
            fn()
    return prof.key_averages()


def compute_ms(fn: Callable[[], Any]) -> float:
    """One call of ``fn``, profiled: its time in ops and kernels (self times, so nothing
    twice), what is not the optimizer's compute (``NOT_COMPUTE``) excluded."""
    return (
        sum(e.self_cpu_time_total for e in profile(fn, 1) if not e.key.startswith(NOT_COMPUTE))
        / 1e3
    )


def step_alone(c: Config) -> Callable[[], Any]:
    """The optimizer step of ``c`` alone, on the gradients its last step left: torch's
    ``Optimizer.step``; for compiled ZeRO, the update of every bucket the hooks reduce
    (``ZeroOptimizer.update_bucket`` on each bucket's averaged row, reduced once beforehand),
    compiled by Inductor with the default pipeline: the own rows' deltas, the exchange of the
    rows of deltas and the write-back, without the backward around them."""
    if c.zero is None:
        return c.opt.step
    zero, state = c.zero, ch.DefaultState(dist.group.WORLD)
    reduced = [
        zero.reduce_bucket(ch.allreduce_hook, state, [(i, zero.params[i].grad) for i in bucket])
        for bucket in zero.storage.buckets
    ]

    @torch.compile(fullgraph=True)
    def update():
        for items, row in reduced:
            zero.update_bucket(items, row)

    def step():
        # kernels profiled one by one (compute_ms), not inside the graph's call
        with (
            passes.install(c.pipeline),
            torch._inductor.config.patch({"cpp.enable_kernel_profile": True}),
        ):
            update()

    for _ in range(3):  # compile and warm up
        step()
    return step


def kernel_table(c: Config, events, steps: int) -> str:
    """Self CPU time per op and per Inductor kernel (``enable_kernel_profile``), the largest
    first, per step. Where the optimizer's work is: torch's ``Optimizer.step`` for the
    unsharded step; in the compiled ZeRO backward the kernels of the update (loops over the
    bucket's own row with a ``sqrt``) and the write-back, which Inductor's output code names
    (``TORCH_LOGS=output_code``)."""
    rows = sorted(events, key=lambda e: -e.self_cpu_time_total)[:40]
    lines = [
        f"| {e.key[:60]} | {e.self_cpu_time_total / steps / 1e3:.2f} | {e.count // steps} |"
        for e in rows
    ]
    total = [
        f"; torch's Optimizer.step in all {e.cpu_time_total / steps / 1e3:.2f} ms"
        for e in events
        if e.key.startswith("Optimizer.step")
    ]
    return "\n".join(
        [
            f"\n{c.name}: self CPU time per step (ms), calls per step{''.join(total)}\n",
            "| op or kernel | ms | calls |",
            "|---|---:|---:|",
            *lines,
        ]
    )


def run(
    rank: int,
    size: dict,
    steps: int,
    link: str | None,
    traffic,
    profiled: bool = False,
    names: list[str] = CONFIGS,
) -> tuple[list[dict], list[str], float] | None:
    """Time the configurations ``names`` (the first of ``CONFIGS``, ``NO_STEP`` and ``COMPUTE``
    among them); on rank 0 their rows, the profiled kernel tables and the compute's time under
    traffic."""
    tokens, targets = batch(rank, 0, batch_size=8, seq_len=32)
    torch._dynamo.config.optimize_ddp = True  # eager DDP first: the C++ reducer
    configs = [Config(n, size, tokens, targets) for n in names if n.startswith("eager")]
    configs += [Config(n, size, tokens, targets) for n in names if not n.startswith("eager")]
    configs.sort(key=lambda c: CONFIGS.index(c.name))
    for c in configs:
        c.first_step()
    for c in configs:  # one untimed round: compiled autograd builds one more graph per model here
        c.step()
    for i in range(steps):
        for c in configs[i % len(configs) :] + configs[: i % len(configs)]:
            dist.barrier()
            t0 = time.perf_counter()
            c.step()
            c.times.append(time.perf_counter() - t0)
    # every configuration trains the same model on the same data: how far apart did they end?
    flat = [torch.cat([p.detach().reshape(-1) for p in c.net.parameters()]) for c in configs]
    world = dist.get_world_size()
    calls = {c.name: record_collectives(c.step, world) for c in configs}
    collectives_alone = {name: replay_ms(calls[name], world) for name in calls}
    compute = next(c for c in configs if c.name == COMPUTE)
    busy = compute_busy_ms(compute.step, compute.times, traffic, link)
    # every rank replays the collectives
    under_compute = {name: under_compute_ms(calls[name], world, compute.step) for name in calls}
    compute_median_ms = statistics.median(compute.times) * 1e3
    tables = [
        kernel_table(c, profile(c.step, 10), 10) for c in configs if profiled and c.name in PROFILED
    ]
    # the optimizer step alone, profiled (last: it steps the optimizers again)
    steps_alone = {c.name: step_alone(c) for c in configs if c.name in ALONE}
    alone: dict[str, list[float]] = {name: [] for name in steps_alone}
    for _ in range(ALONE_CALLS):  # in turn, so that noise hits both alike
        for name, fn in steps_alone.items():
            alone[name].append(compute_ms(fn))
    if rank != 0:
        return None
    n_tensors = sum(1 for _ in configs[0].net.parameters())
    n_params = flat[0].numel()
    base = statistics.median(configs[0].times)
    no_step = statistics.median(next(c for c in configs if c.name == NO_STEP).times)

    def optimizer_ms(c: Config) -> float:
        """The optimizer step: timed alone where it runs after backward (its timed steps'
        median); inside the compiled backward, the step's median minus that of the same compiled
        DDP step without an optimizer."""
        if c.step_times:
            return statistics.median(c.step_times[-steps:]) * 1e3
        return (statistics.median(c.times) - no_step) * 1e3

    return (
        [
            dict(
                model=f"{n_tensors} tensors, {n_params / 1e6:.2f}M params",
                config=c.name,
                median_ms=statistics.median(c.times) * 1e3,
                ratio=statistics.median(c.times) / base,
                collectives=c.collectives,
                state_mb=c.state_bytes() / 1e6 if c.name != NO_STEP else 0.0,
                optimizer_ms=optimizer_ms(c) if c.name != NO_STEP else 0.0,
                alone_ms=statistics.median(alone[c.name]) if c.name in alone else None,
                alone_ratio=statistics.median(
                    a / b for a, b in zip(alone[c.name], alone[configs[0].name])
                )
                if c.name in alone
                else None,
                diff=((f - flat[0]).abs().max() / flat[0].abs().max()).item(),
                achievable_ms=achievable_ms(busy, collectives_alone[c.name]),
                alone_busy_ms=under_compute[c.name],
                contended_ms=contended_ms(
                    compute_median_ms, busy, collectives_alone[c.name], under_compute[c.name]
                ),
            )
            for c, f in zip(configs, flat)
        ],
        tables,
        busy,
    )


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> bool:
    if args.profile:
        torch._inductor.config.cpp.enable_kernel_profile = True
    traffic = dist.new_group(backend="gloo")  # for under_traffic_ms, on every rank
    size = dict(dim=args.dim, layers=args.layers)
    names = SMOKE if args.smoke else CONFIGS
    result = run(rank, size, args.steps, args.link, traffic, args.profile, names)
    if rank == 0:
        rows, tables, busy = result
        print(
            f"\n{describe_link()} (gloo, 1 thread each), {args.steps} interleaved steps per "
            f"configuration, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, model: "
            f"{rows[0]['model']}\n"
        )
        print(
            "| configuration | median step (ms) | vs first | optimizer step (ms, share of the "
            "step) | optimizer step alone, compute, profiled (ms, vs first) | collectives/step | "
            "optimizer state per rank (MB) | max parameter difference vs first | vs achievable | "
            "vs two-way contention |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            coll = "-" if r["collectives"] is None else r["collectives"]
            prof = (
                "-" if r["alone_ms"] is None else f"{r['alone_ms']:.1f} ({r['alone_ratio']:.2f}x)"
            )
            print(
                f"| {r['config']} | {r['median_ms']:.1f} | {r['ratio']:.2f}x | "
                f"{r['optimizer_ms']:.1f} ({r['optimizer_ms'] / r['median_ms']:.0%}) | {prof} | "
                f"{coll} | {r['state_mb']:.2f} | {r['diff']:.1e} | "
                f"{vs_achievable(r['median_ms'], r['achievable_ms'])} | "
                f"{vs_achievable(r['median_ms'], r['contended_ms'])} |"
            )
        print(
            "\noptimizer step: timed alone where it runs after backward; inside the compiled "
            f"backward (ZeRO), the step's median minus the median of '{NO_STEP}' (the same "
            f"forward and backward). Alone, profiled: after the steps, {ALONE_CALLS} calls of the "
            "optimizer step by itself under torch.profiler (torch's Optimizer.step; for compiled "
            "ZeRO the compiled update of every bucket on its averaged row), in turn: median time "
            "in ops and kernels per call, and the median of the calls' ratios; communication "
            "(issuing and waiting for collectives) and the compiled step's entry (guards, graph "
            "call) excluded. Achievable per row: the larger of its collectives alone (the same "
            f"collectives issued back to back with nothing else) and {TRAFFIC_ROW!r} with "
            f"'{COMPUTE}' ({busy:.1f} ms; the unsharded optimizer's compute, more than a sharded "
            "one's), what this machine allows the step. Two-way contention per row: the least "
            "step of achievable.contended_ms, from that compute alone, the same under traffic, "
            "the row's collectives alone and the same with that compute running alongside ("
            + ", ".join(
                "-" if r["alone_busy_ms"] is None else f"{r['alone_busy_ms']:.0f}" for r in rows
            )
            + " ms per row)."
        )
        for table in tables:
            print(table)
        results.write(
            args,
            "zero_step",
            describe_link(),
            [
                results.table(
                    f"transformer ({rows[0]['model']}), forward + backward + AdamW step",
                    rows,
                    ratio="ratio",
                )
            ],
        )
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--world-size", type=int, default=2, help="ranks over loopback (a --link run has 2)"
    )
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="then profile 10 steps of the unsharded, ZeRO and no-step configurations "
        "(rank 0's kernels)",
    )
    add_link_argument(parser)
    add_smoke_argument(parser)
    results.add_output_arguments(parser)
    launch(_worker, apply_smoke(parser.parse_args(), dim=32, layers=1))


if __name__ == "__main__":
    main()
