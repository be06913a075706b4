"""Gradient synchronisation in DDP: eager vs compiled, with and without compression and passes.

    python benchmarks/ddp_sync.py            # 2 CPU ranks over gloo, two model sizes
    python benchmarks/ddp_sync.py --profile  # and where each step's CPU time goes

Same model (the main example's transformer, 52 parameter tensors) and batch for every
configuration; their steps are interleaved (one step of each in turn, the order rotated every
step) so that machine noise hits all of them alike. Reported per configuration: median time of
forward + backward (including gradient communication) on rank 0, its ratio to eager DDP,
collectives per step and kernels per step:

- eager: DDP buckets (collectives) and ATen ops dispatched (kernels), counted in one step;
- compiled: all_reduce calls and kernel launches in Inductor's output code for forward and
  backward.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as ddp_default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train_ddp import TinyTransformer, batch, loss_fn  # noqa: E402

import compiled_hooks as ch  # noqa: E402
import passes  # noqa: E402

SIZES = {"small": dict(dim=64, layers=4), "medium": dict(dim=256, layers=4)}
CONFIGS = ["eager", "eager + torch fp16 hook", "compiled", "compiled + bf16 hook", "compiled + bf16 hook + passes",
           "compiled + bf16 hook + passes (2 MB buckets)"]


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _code_counts(codes: list[str]) -> tuple[int, int]:
    code = "\n".join(codes)
    collectives = len(re.findall(r"_c10d_functional\.(?:all_reduce|reduce_scatter)\w*\.default\(", code))
    kernels = len(re.findall(r"^\s{8}(?:cpp_fused\w*|extern_kernels\.\w+|torch\.ops\.aten\.\w+\.\w+)\(", code, re.M))
    return collectives, kernels


class Config:
    def __init__(self, name: str, size: dict, rank: int, tokens, targets):
        torch.manual_seed(0)
        self.name, self.net = name, TinyTransformer(**size)
        self.tokens, self.targets = tokens, targets
        self.times: list[float] = []
        self.compiled = name.startswith("compiled")
        state = ch.LowPrecisionState(dist.group.WORLD)
        if self.compiled:
            hook = ch.bf16_compress_hook if "bf16" in name else None
            self.ddp, self.model = ch.compile_ddp(self.net, state, hook)
            for p in self.net.parameters():
                p.grad = torch.zeros_like(p)
        else:
            self.ddp = self.model = DistributedDataParallel(self.net)
            if "fp16" in name:
                self.ddp.register_comm_hook(dist.group.WORLD, ddp_default_hooks.fp16_compress_hook)
        self.pipeline = None
        if "passes" in name:
            cap = re.search(r"\((\d+) MB buckets\)", name)
            self.pipeline = passes.default_pipeline(**({"bucket_cap_mb": float(cap.group(1))} if cap else {}))
        self.collectives = self.kernels = None

    def _context(self):
        stack = contextlib.ExitStack()
        if self.pipeline is not None:
            stack.enter_context(passes.install(self.pipeline))
        if self.compiled:
            stack.enter_context(ch.compiled_autograd())
        return stack

    def step(self) -> None:
        self.net.zero_grad(set_to_none=False)
        with self._context():
            loss_fn(self.model, self.tokens, self.targets).backward()

    def first_step(self) -> None:
        """Compile (compiled configs) and count collectives and kernels."""
        if self.compiled:
            from torch._inductor.utils import run_and_get_code

            _, codes = run_and_get_code(self.step)
            self.collectives, self.kernels = _code_counts(codes)
        else:
            self.step()  # DDP builds its final buckets after the first iteration
            counter = CountOps()
            with counter:
                self.step()
            self.kernels = counter.count
            self.collectives = len(self.ddp._get_ddp_logging_data()["bucket_sizes"].split(","))


def run_size(rank: int, size_name: str, steps: int, profile: bool) -> list[dict] | None:
    size = SIZES[size_name]
    tokens, targets = batch(rank, 0, batch_size=8, seq_len=32)
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = True  # eager DDP: the C++ reducer
    configs = [Config(n, size, rank, tokens, targets) for n in CONFIGS if not n.startswith("compiled")]
    configs += [Config(n, size, rank, tokens, targets) for n in CONFIGS if n.startswith("compiled")]
    for c in configs:
        c.first_step()
    for c in configs:  # one untimed round: compiled autograd builds one more graph per model here
        c.step()
    for i in range(steps):
        order = configs[i % len(configs):] + configs[: i % len(configs)]
        for c in order:
            dist.barrier()
            t0 = time.perf_counter()
            c.step()
            c.times.append(time.perf_counter() - t0)
    profiles = [_profile(c) for c in configs] if profile else [None] * len(configs)
    if rank != 0:
        return None
    n_tensors = sum(1 for _ in configs[0].net.parameters())
    n_params = sum(p.numel() for p in configs[0].net.parameters())
    base = statistics.median(configs[0].times)
    return [dict(size=f"{size_name} ({n_tensors} tensors, {n_params / 1e6:.2f}M params)", config=c.name,
                 median_ms=statistics.median(c.times) * 1e3, ratio=statistics.median(c.times) / base,
                 collectives=c.collectives, kernels=c.kernels, profile=prof) for c, prof in zip(configs, profiles)]


PROFILED = {"matmul": ("aten::mm", "aten::addmm", "aten::bmm"),
            "collective + wait": ("c10d::allreduce_", "_c10d_functional::wait_tensor", "_c10d_functional::all_reduce_"),
            "compile-cache lookup": ("TorchDynamo Cache Lookup",)}


def _profile(c: Config, steps: int = 5) -> dict[str, float]:
    """Self CPU ms per step by category, from torch.profiler over ``steps`` steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            dist.barrier()
            c.step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e3 / steps
    out = {k: sum(e.self_cpu_time_total for e in events if e.key in names) / 1e3 / steps for k, names in PROFILED.items()}
    out["other"] = total - sum(out.values())
    return out


def _print_table(rows: list[dict]) -> None:
    print("| model | configuration | median step (ms) | vs eager | collectives/step | kernels/step |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['size']} | {r['config']} | {r['median_ms']:.1f} | {r['ratio']:.2f}x | {r['collectives']} "
              f"| {r['kernels']} |")


def _worker(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    rows = []
    for size_name in args.sizes:
        rows += run_size(rank, size_name, args.steps, args.profile) or []
    if rank == 0:
        print(f"\n{world_size} ranks (gloo, 1 thread each), {args.steps} interleaved steps per configuration, "
              f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}\n")
        _print_table(rows)
        if args.profile:
            print("\nSelf CPU time per step on rank 0 (ms), torch.profiler over 5 steps:\n")
            print("| model | configuration | " + " | ".join(PROFILED) + " | other |")
            print("|---|---|" + "---:|" * (len(PROFILED) + 1))
            for r in rows:
                print(f"| {r['size']} | {r['config']} | " + " | ".join(f"{v:.1f}" for v in r["profile"].values()) + " |")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--profile", action="store_true", help="also break each step's CPU time down")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, args), nprocs=2)


if __name__ == "__main__":
    main()
