"""This project's hooks in DDP's C++ reducer against torch's own, in eager DDP and
torch.compile(DDP).

    python -m benchmarks.reducer_hooks                 # 2 CPU ranks over loopback
    python -m benchmarks.reducer_hooks --link 2gbit    # 2 ranks on a 2 Gbit/s link (root, ip, tc)

The setups most DDP users run: eager DDP, and ``torch.compile(DDP(model))`` with Dynamo's
default ``optimize_ddp="ddp_optimizer"`` (the graph split at bucket boundaries, the reduction
left to DDP). In both, DDP's C++ reducer calls the comm hook once per bucket and goes on with
the backward while the returned future is pending. Per setup and model, each hook of this
project (``ddp_comm_hook(hook)``) is timed next to torch's equivalent, its peer:

- ``allreduce_hook`` and ``fp16_compress_hook`` against torch's (``bucket_cap_mb=4``);
- ``bf16_compress_hook`` against this project's ``fp16_compress_hook`` (torch's bf16 hook
  refuses anything but CUDA + NCCL);
- ``int8_compress_hook`` (error feedback on, through its async form ``reduce_async``) against
  this project's ``bf16_compress_hook``: torch has no int8 hook;
- ``powerSGD_hook`` at rank 1 and 4 against torch's (``start_powerSGD_iter=2``), with the whole
  model in one bucket: with several buckets torch's hook issues P and Q all_reduces from future
  callbacks, on gloo's threads, in an order that differs between the ranks, and gloo aborts the
  process ("Received data size doesn't match expected size"). This project's hook issues them
  in one order on every rank (``compiled_hooks.in_order``), so a row with ``bucket_cap_mb=4``
  shows it on the buckets the other hooks get, against the same peer.

Then the ZeRO hooks in eager DDP (AdamW, whole parameters, fp16): the async form against the
same hook run to completion in every bucket (what ``ddp_comm_hook`` did before it returned
pending futures), in both schedules.

Every configuration trains its own copy of the model; their steps (forward + backward, with
the ZeRO rows' update inside it) are interleaved, one of each in turn, in an order shuffled
every round (the same on every rank): a hook and its peer run the same code around them, so a
fixed neighbour would bias their ratio. Per configuration, on rank 0: the median step, its ratio to
its peer, and the time the reducer spent inside the hook per step (torch.profiler, a
``record_function`` around every
hook call, over 3 steps).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel

import compiled_hooks as ch
from benchmarks.common import results
from benchmarks.common.launch import (
    add_link_argument,
    add_smoke_argument,
    apply_smoke,
    describe_link,
    launch,
)
from benchmarks.common.models import loss_of, make_model
from compiled_hooks import zero
from compiled_hooks.powersgd import PowerSGDState, powerSGD_hook

HOOK = "comm hook"
START = 2  # start_powerSGD_iter
WARMUP = 4
# (hook, whose, bucket_cap_mb, peer's hook and whose)
ROWS = [
    ("allreduce", "torch", 4, None),
    ("allreduce", "ours", 4, ("allreduce", "torch")),
    ("fp16", "torch", 4, None),
    ("fp16", "ours", 4, ("fp16", "torch")),
    ("bf16", "ours", 4, ("fp16", "ours")),
    ("int8", "ours", 4, ("bf16", "ours")),
    ("powerSGD r1", "torch", 64, None),
    ("powerSGD r1", "ours", 64, ("powerSGD r1", "torch")),
    ("powerSGD r4", "torch", 64, None),
    ("powerSGD r4", "ours", 64, ("powerSGD r4", "torch")),
    ("powerSGD r4", "ours", 4, ("powerSGD r4", "torch")),
]
ZERO_ROWS = [
    ("hook_with_zero_step", "blocking"),
    ("hook_with_zero_step", "async"),
    ("hook_with_zero_step_interleaved", "blocking"),
    ("hook_with_zero_step_interleaved", "async"),
]


def name_of(setup: str, hook: str, whose: str, cap: float) -> str:
    return f"{setup} + {whose} {hook}" + (
        " (4 MB buckets)" if hook.startswith("powerSGD") and cap == 4 else ""
    )


def blocking(hook):
    """``hook`` without its async form: ``ddp_comm_hook`` runs it to completion per bucket."""

    def run(state, grad):
        hook(state, grad)

    return run


def in_profile(hook):
    """``hook`` inside a ``record_function``: the profiler sees the reducer's time in it."""
    from torch.profiler import record_function

    def timed_hook(state, bucket):
        with record_function(HOOK):
            return hook(state, bucket)

    return timed_hook


def state_and_hook(hook: str, whose: str):
    """The state and the DDP comm hook for ``hook`` (``"powerSGD r4"``: rank 4)."""
    group = dist.group.WORLD
    if hook.startswith("powerSGD"):
        rank = int(hook.split("r")[-1])
        if whose == "torch":
            return (
                torch_powersgd.PowerSGDState(
                    group, matrix_approximation_rank=rank, start_powerSGD_iter=START
                ),
                torch_powersgd.powerSGD_hook,
            )
        return (
            PowerSGDState(group, matrix_approximation_rank=rank, start_powerSGD_iter=START),
            ch.ddp_comm_hook(powerSGD_hook),
        )
    if whose == "torch":
        return group, {
            "allreduce": torch_hooks.allreduce_hook,
            "fp16": torch_hooks.fp16_compress_hook,
        }[hook]
    if hook == "allreduce":
        return ch.DefaultState(group), ch.ddp_comm_hook(ch.allreduce_hook)
    if hook == "int8":
        return ch.QuantizedState(group), ch.ddp_comm_hook(ch.int8_compress_hook)
    return ch.LowPrecisionState(group), ch.ddp_comm_hook(
        {"fp16": ch.fp16_compress_hook, "bf16": ch.bf16_compress_hook}[hook]
    )


class Config:
    def __init__(self, name: str, model: str, index: int, cap: float, peer: str | None):
        self.name, self.peer, self.times = name, peer, []
        self.net, self.inputs, self.target = make_model(model, index + 1)
        self.ddp = DistributedDataParallel(self.net, bucket_cap_mb=cap)
        self.model = self.ddp

    def step(self) -> None:
        self.net.zero_grad(set_to_none=True)
        out = self.model(*self.inputs)
        (loss_of(out, self.target) + 0 * self.net.extra.sum()).backward()

    def hook_ms(self, steps: int = 3) -> float:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                dist.barrier()
                self.step()
        return sum(e.cpu_time_total for e in prof.events() if e.name == HOOK) / 1e3 / steps


def hook_config(
    setup: str, hook: str, whose: str, cap: float, peer, model: str, index: int
) -> Config:
    name = name_of(setup, hook, whose, cap)
    c = Config(
        name,
        model,
        index,
        cap,
        name_of(setup, *peer, 4 if not peer[0].startswith("powerSGD") else 64) if peer else None,
    )
    state, ddp_hook = state_and_hook(hook, whose)
    c.ddp.register_comm_hook(state, in_profile(ddp_hook))
    if setup == "compiled":
        c.model = torch.compile(c.ddp)
    return c


def zero_config(schedule: str, form: str, model: str, index: int) -> Config:
    c = Config(
        f"eager + {schedule}, fp16 hook {form}",
        model,
        index,
        4,
        f"eager + {schedule}, fp16 hook blocking" if form == "async" else None,
    )
    optimizer = zero.ZeroOptimizer(c.net.parameters(), torch.optim.AdamW, lr=1e-4)
    hook = ch.fp16_compress_hook if form == "async" else blocking(ch.fp16_compress_hook)
    c.ddp.register_comm_hook(
        ch.LowPrecisionState(dist.group.WORLD),
        in_profile(getattr(zero, schedule)(hook, c.ddp, optimizer)),
    )
    return c


def run_model(rank: int, model: str, steps: int) -> list[dict] | None:
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = "ddp_optimizer"
    configs = [
        hook_config(setup, *row, model, i + len(ROWS) * k)
        for k, setup in enumerate(("eager", "compiled"))
        for i, row in enumerate(ROWS)
    ]
    configs += [zero_config(*row, model, 2 * len(ROWS) + i) for i, row in enumerate(ZERO_ROWS)]
    for c in configs:
        for _ in range(WARMUP):  # compile; DDP rebuilds its buckets; PowerSGD starts at step 2
            c.step()
    for i in range(steps):
        order = list(configs)
        # no configuration always follows the same one; the same on every rank
        random.Random(i).shuffle(order)
        for c in order:
            dist.barrier()
            t0 = time.perf_counter()
            c.step()
            c.times.append(time.perf_counter() - t0)
    in_hook = {c.name: c.hook_ms() for c in configs}
    if rank != 0:
        return None
    median = {c.name: statistics.median(c.times) * 1e3 for c in configs}
    tables = []
    for title, group in [
        (
            "eager DDP",
            [c for c in configs if c.name.startswith("eager + ") and "zero" not in c.name],
        ),
        (
            "torch.compile(DDP), ddp_optimizer",
            [c for c in configs if c.name.startswith("compiled")],
        ),
        ("ZeRO hooks in eager DDP, AdamW", [c for c in configs if "zero" in c.name]),
    ]:
        print(f"\n### {model}: {title}\n")
        print("| configuration | median step (ms) | vs peer | peer | in the hook (ms/step) |")
        print("|---|---:|---:|---|---:|")
        rows = [
            dict(
                config=c.name,
                median_ms=median[c.name],
                vs_peer=median[c.name] / median[c.peer] if c.peer else None,
                peer=c.peer or "",
                hook_ms=in_hook[c.name],
            )
            for c in group
        ]
        for r in rows:
            vs = "-" if r["vs_peer"] is None else f"{r['vs_peer']:.2f}x"
            print(
                f"| {r['config']} | {r['median_ms']:.1f} | {vs} | {r['peer'] or '-'} | "
                f"{r['hook_ms']:.2f} |"
            )
        tables.append(results.table(f"{model}: {title}", rows, ratio="vs_peer"))
    return tables


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> bool:
    torch._dynamo.config.recompile_limit = (
        64  # one compiled DDP per configuration, all of one class
    )
    torch._dynamo.config.accumulated_recompile_limit = 1024
    if rank == 0:
        print(
            f"{describe_link()}, gloo, 1 thread each; {WARMUP} warm-up + {args.steps} interleaved "
            f"steps per configuration, medians on rank 0; torch {torch.__version__}, "
            f"{time.strftime('%Y-%m-%d')}",
            flush=True,
        )
    tables = []
    for model in args.models:
        tables += run_model(rank, model, args.steps) or []
    if rank == 0:
        results.write(args, "reducer_hooks", describe_link(), tables)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--models", nargs="+", default=["mlp-8x1024", "mlp-32x256"])
    add_link_argument(parser)
    add_smoke_argument(parser)
    results.add_output_arguments(parser)
    parser.set_defaults(world_size=2)
    launch(_worker, apply_smoke(parser.parse_args(), models=["mlp-2x64"]))


if __name__ == "__main__":
    main()
