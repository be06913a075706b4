"""Compiled PowerSGD against eager PowerSGD and against bf16 compression with the passes.

    python -m benchmarks.powersgd                 # 2 CPU ranks over loopback
    python -m benchmarks.powersgd --link 2gbit    # 2 ranks on a 2 Gbit/s link (root, ip, tc)

Model: ``ddp_sync.py``'s ``mlp-8x1024`` (8 layers of 1024 x 1024, batch 32; bandwidth-bound on
a slow link; ``--model`` picks another of its models), each rank regressing its own fixed
batch. Configurations, each training its own copy of the model with SGD (lr 0.01) from the same
initialization:

- eager DDP + torch's ``powerSGD_hook`` at rank 1 and 4 (needs numpy, which torch's state
  uses; without it these rows are left out and the reason printed);
- compiled DDP + this project's ``powerSGD_hook`` at rank 1 and 4, with ``passes.install()``
  (P and Q all_reduces bucketed by ``bucket_low_rank_factors``);
- compiled DDP + ``bf16_compress_hook`` + passes (the best configuration of ``ddp_sync.py``);
- eager DDP fp32, for the loss a compression must approach.

PowerSGD starts at step 2 (``start_powerSGD_iter=2``) in every configuration; the timed steps
come after the warm-up. Steps of all configurations are interleaved, the order rotated every
step. Per configuration, on rank 0: median step (forward, backward with synchronisation,
optimizer step), its ratio to compiled + bf16 + passes and to eager torch PowerSGD at the same
rank, collectives and MB sent to collectives per step (torch.profiler), and the loss after
the warm-up and the timed steps, averaged over the ranks.
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
from torch.nn.parallel import DistributedDataParallel

import compiled_hooks as ch
import passes
from benchmarks.common import results
from benchmarks.common.launch import (
    add_link_argument,
    add_smoke_argument,
    apply_smoke,
    describe_link,
    itemsize,
    launch,
)
from benchmarks.common.models import MODELS, loss_of, make_model
from benchmarks.common.step_timeline import COLLECTIVES
from compiled_hooks.powersgd import PowerSGDState, powerSGD_hook

START, WARMUP, LR = 2, 4, 0.1
BF16 = "compiled + bf16 hook + passes"


def torch_powersgd() -> tuple[object, str | None]:
    """torch's eager hook module, or why it cannot run here."""
    try:
        import numpy  # noqa: F401 - torch's PowerSGDState draws its seeds with numpy
    except ImportError:
        return None, "numpy is not installed (torch's PowerSGDState needs it)"
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_hook

    return torch_hook, None


class Config:
    def __init__(self, name: str, model: str, index: int, rank: int = 0):
        self.name, self.times = name, []
        self.net, self.inputs, self.target = make_model(model, index + 1)
        self.compiled = name.startswith("compiled")
        self.pipeline = None
        if name.startswith("eager"):
            self.model = DistributedDataParallel(self.net)
            if "powerSGD" in name:
                torch_hook, _ = torch_powersgd()
                state = torch_hook.PowerSGDState(
                    dist.group.WORLD, matrix_approximation_rank=rank, start_powerSGD_iter=START
                )
                self.model.register_comm_hook(state, torch_hook.powerSGD_hook)
        else:
            if "powerSGD" in name:
                state, hook = (
                    PowerSGDState(
                        dist.group.WORLD, matrix_approximation_rank=rank, start_powerSGD_iter=START
                    ),
                    powerSGD_hook,
                )
            else:
                state, hook = ch.LowPrecisionState(dist.group.WORLD), ch.bf16_compress_hook
            _, self.model = ch.compile_ddp(self.net, state, hook)
            self.pipeline = passes.default_pipeline()
            for p in self.net.parameters():  # one backward graph for every step
                p.grad = torch.zeros_like(p)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=LR)

    def step(self) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=False)
        with contextlib.ExitStack() as stack:
            if self.compiled:
                stack.enter_context(passes.install(self.pipeline))
                stack.enter_context(ch.compiled_autograd())
            loss = loss_of(self.model(*self.inputs), self.target)
            (loss + 0 * self.net.extra.sum()).backward()
        self.opt.step()
        return loss.detach()

    def profile(self, steps: int = 3) -> None:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(steps):
                dist.barrier()
                self.step()
        events = [e for e in prof.events() if e.name in COLLECTIVES]
        functional = [e for e in events if e.name.startswith("_c10d_functional")]
        self.collectives = len(functional or events) / steps
        self.mb = (
            sum(
                math.prod(e.input_shapes[0]) * itemsize(e.input_dtypes[0])
                for e in (functional or events)
            )
            / steps
            / 2**20
        )


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> bool:
    torch_hook, why_not = torch_powersgd()
    names = ["eager DDP fp32"]
    names += [f"eager DDP + torch powerSGD rank {r}" for r in args.ranks] if torch_hook else []
    names += [f"compiled + powerSGD rank {r} + passes" for r in args.ranks] + [BF16]
    if rank == 0:
        print(
            f"{describe_link()}, gloo, 1 thread each; {args.model}, {WARMUP} warm-up + "
            f"{args.steps} interleaved steps per configuration, medians on rank 0; torch "
            f"{torch.__version__}, {time.strftime('%Y-%m-%d')}",
            flush=True,
        )
        if why_not:
            print(f"eager torch powerSGD_hook left out: {why_not}", flush=True)
    torch._dynamo.config.optimize_ddp = True  # eager DDP first: the C++ reducer
    configs = []
    for i, name in enumerate(names):
        r = int(name.split("rank ")[1].split()[0]) if "rank" in name else 0
        configs.append(Config(name, args.model, i, r))
    for c in configs:
        for _ in range(WARMUP):  # compile, PowerSGD's switch at step 2 and its recompile
            c.step()
    losses = {}
    for i in range(args.steps):
        for c in configs[i % len(configs) :] + configs[: i % len(configs)]:
            dist.barrier()
            t0 = time.perf_counter()
            losses[c.name] = c.step()
            c.times.append(time.perf_counter() - t0)
    for c in configs:
        dist.all_reduce(losses[c.name], op=dist.ReduceOp.AVG)
        c.profile()
    if rank != 0:
        return True
    median = {c.name: statistics.median(c.times) * 1e3 for c in configs}
    print(
        "\n| configuration | median step (ms) | vs bf16 + passes | vs eager torch PowerSGD, same "
        f"rank | collectives/step | MB to collectives/step | loss after {WARMUP + args.steps} "
        "steps |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for c in configs:
        peer = (
            f"eager DDP + torch powerSGD rank {c.name.split('rank ')[1].split()[0]}"
            if "rank" in c.name
            else None
        )
        rows.append(
            dict(
                config=c.name,
                median_ms=median[c.name],
                vs_bf16_passes=median[c.name] / median[BF16],
                vs_torch_powersgd=median[c.name] / median[peer]
                if peer in median and peer != c.name
                else None,
                collectives=c.collectives,
                mb=c.mb if c.compiled else None,
                loss=losses[c.name].item(),
            )
        )
    for r in rows:
        vs_peer = "-" if r["vs_torch_powersgd"] is None else f"{r['vs_torch_powersgd']:.2f}x"
        # the C++ reducer's collectives carry no shapes in the profile
        mb = "-" if r["mb"] is None else f"{r['mb']:.2f}"
        print(
            f"| {r['config']} | {r['median_ms']:.1f} | {r['vs_bf16_passes']:.2f}x | {vs_peer} | "
            f"{r['collectives']:g} | {mb} | {r['loss']:.5f} |"
        )
    recompiles = counters["stats"]["unique_graphs"]
    print(
        f"\n{recompiles} graphs compiled in all (forward and backward of every compiled "
        "configuration, PowerSGD's backward twice: before and after its start)",
        flush=True,
    )
    results.write(
        args,
        "powersgd",
        describe_link(),
        [
            results.table(
                f"{args.model}, forward + backward + SGD step", rows, ratio="vs_bf16_passes"
            )
        ],
    )
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--model", default="mlp-8x1024", choices=list(MODELS), help="a model of ddp_sync.py"
    )
    parser.add_argument(
        "--ranks", type=int, nargs="+", default=[1, 4], help="PowerSGD approximation ranks"
    )
    add_link_argument(parser)
    add_smoke_argument(parser)
    results.add_output_arguments(parser)
    parser.set_defaults(world_size=2)
    launch(_worker, apply_smoke(parser.parse_args(), model="mlp-2x64", ranks=[1]))


if __name__ == "__main__":
    main()
