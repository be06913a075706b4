"""Where the int8 step's CPU time goes: compiled DDP with ``int8_compress_hook`` + the passes
beside ``bf16_compress_hook`` + the passes, each rank's step profiled per op and per Inductor
kernel.

    python -m benchmarks.int8_step_cpu [--model mlp-8x1024] [--steps 5]

Two gloo ranks over loopback, one thread each, ``ddp_sync.py``'s model and configurations;
after two compiling steps each configuration runs ``--steps`` steps under torch.profiler with
Inductor's kernel profiling on (``cpp.enable_kernel_profile``: every generated C++ kernel is an
event of its own). Every event's self CPU time goes to the first category that it or an
op around it belongs to (:func:`by_category`), per step, the median over the ranks:

- the int8 hook's custom op with everything it calls: the receive's dequantize
  (``compiled_hooks::dequantize_packed``);
- the bucket's cat (``aten::cat``), the matmuls, the collectives' waits;
- Inductor's generated kernels (``..._cpp_fused_...``): the int8 send and shard quantize, with
  the residuals' updates written in place, are among them, beside the work both hooks do (the
  bf16 casts and the backward's pointwise ops);
- the rest.

The int8 work per step is its dequantize and cat rows plus its generated
kernels: all of them (an upper bound, since they hold the backward's own pointwise work too), and
only what they take beyond the bf16 configuration's (a lower one, since the bf16 kernels cast and
sum where the int8 ones quantize).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

from benchmarks.common.launch import add_smoke_argument, apply_smoke, launch
from benchmarks.common.models import MODELS, SMOKE_MODEL
from benchmarks.common.step_timeline import MATMULS, profiled_steps
from benchmarks.ddp_sync import INT8, OURS, Config
from compiled_hooks import graph_contract

DEQUANTIZE = "dequantize op"
CAT = "bucket cat"
MATMUL = "matmuls"
WAITS = "collective waits"
KERNELS = "generated kernels"
REST = "the rest"
# the categories an event's own name puts it in, outermost first when nested
OPS = {
    graph_contract.DEQUANTIZE_PACKED.name(): DEQUANTIZE,
    "aten::cat": CAT,
    "_c10d_functional::wait_tensor": WAITS,
    **{name: MATMUL for name in MATMULS},
}
CATEGORIES = [DEQUANTIZE, CAT, KERNELS, MATMUL, WAITS, REST]


def category(name: str) -> str | None:
    """The category an event's name alone puts it in; None when only its ancestors can."""
    if name in OPS:
        return OPS[name]
    return KERNELS if "_cpp_fused_" in name else None


def by_category(events: Iterable, steps: int) -> dict[str, float]:
    """ms of self CPU time per step in each of :data:`CATEGORIES`: an event counts for its
    outermost ancestor (itself included) that has a category, else for :data:`REST`."""
    ms = dict.fromkeys(CATEGORIES, 0.0)
    for e in events:
        found, node = None, e
        while node is not None:
            found = category(node.name) or found
            node = node.cpu_parent
        ms[found or REST] += e.self_cpu_time_total / 1e3 / steps
    return ms


def _worker(rank: int, world_size: int, args: argparse.Namespace) -> bool:
    torch._inductor.config.cpp.enable_kernel_profile = True
    configs = [Config(name, args.model, i, {}) for i, name in enumerate([OURS[0], INT8])]
    for c in configs:
        c.step()  # compile
        c.step()  # compiled autograd may build one more graph on the second step
    mine = {c.name: by_category(profiled_steps(c.step, args.steps), args.steps) for c in configs}
    every: list[dict] = [{}] * world_size
    dist.all_gather_object(every, mine)
    if rank != 0:
        return True
    median = {(n, k): statistics.median(r[n][k] for r in every) for n in mine for k in CATEGORIES}
    print(
        f"{args.model}, 2 gloo ranks over loopback, 1 thread each, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}: self CPU ms per step, median of the ranks, "
        f"{args.steps} profiled steps\n"
    )
    print(f"| category | {OURS[0]} | {INT8} |\n|---|---:|---:|")
    for k in CATEGORIES:
        print(f"| {k} | {median[(OURS[0], k)]:.1f} | {median[(INT8, k)]:.1f} |")
    ops = sum(median[(INT8, k)] for k in (DEQUANTIZE, CAT))
    kernels, bf16_kernels = median[(INT8, KERNELS)], median[(OURS[0], KERNELS)]
    print(
        f"\nint8 work per step: {ops + kernels:.1f} ms with all its generated kernels, "
        f"{ops + kernels - bf16_kernels:.1f} ms with those beyond the bf16 configuration's "
        f"({ops:.1f} ms of dequantize and cat)"
    )
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp-8x1024", choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=5)
    add_smoke_argument(parser)
    parser.set_defaults(world_size=2, device="cpu", backend="gloo")
    launch(_worker, apply_smoke(parser.parse_args(), model=SMOKE_MODEL))


if __name__ == "__main__":
    main()
