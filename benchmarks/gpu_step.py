"""What a lent GPU is asked, in one run: the int8 codec's rates, compiled DDP against torch's
bucketing, ``data_parallel`` against FSDP2 on a Llama of about 1B parameters, and whether the
machine can shape a link for two ranks.

    python -m benchmarks.gpu_step                  # CUDA where visible (full sizes), else CPU
    python -m benchmarks.gpu_step --device cpu     # CI's run: CPU, gloo, the smallest sizes
    python -m benchmarks.gpu_step --parts codec link   # some of the parts

One process, world size 1 (NCCL on CUDA, gloo on CPU), four parts:

1. **codec**: ``quantize_cost.py`` on the device at 8,392,704 and 100,000,000 values (CPU:
   65,536): the send quantize (with and without error feedback) and the receive dequantize,
   beside the bf16 cast and sum, each compiled alone; here each row's values per second (the
   projection's input, ``projection.py --send-ns/--receive-ns/--bf16-ns``).
2. **compiled DDP**: ``mlp-8x1024`` (CPU: ``mlp-2x64``) compiled with ``bf16_compress_hook``
   and the passes, against the same hook with torch's Inductor bucketing
   (``bucket_all_reduces_fx="all"``): median step (forward + backward) and the kernels Inductor
   generated for it (``torch._inductor.metrics.generated_kernel_count``).
3. **data_parallel against FSDP2 eager**: :mod:`benchmarks.common.llama` at about 1B parameters
   in bf16 (dim 2048, 18 layers, vocabulary 32000; batch 4 x 512 tokens; CPU: 1 layer of
   width 64), each layer a block: ``data_parallel`` compiled whole with the passes against
   FSDP2 eager (``fully_shard`` per layer and the root), forward + backward + SGD, one after the
   other (each alone on the device): median step and peak memory
   (``torch.cuda.max_memory_allocated``; "-" on CPU).
4. **link**: whether ``ip netns`` and ``tc`` work here (``launch.link_problem``); if they do
   and ``--link-run`` is given, ``ddp_sync.py --link 2gbit --models mlp-8x1024`` on this
   machine's CPU cores (two gloo ranks on CPU tensors: gloo's GPU path has no all-to-all, which
   the int8 rows need).

Medians of ``--steps`` steps after two warm-up steps; on CUDA the device is synchronized around
each step. A part that fails prints its error and the run goes on; the exit code is 1 if any
failed.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import compiled_hooks as ch
import passes
from benchmarks.common.launch import ROOT, link_problem, module_command
from benchmarks.common.llama import LLAMA_1B, Config, LlamaForCausalLM
from benchmarks.common.models import loss_of, make_model, synchronize
from compiled_hooks.fsdp import data_parallel

FULL = {
    "codec": [8_392_704, 100_000_000],
    "ddp": "mlp-8x1024",
    "llama": LLAMA_1B,
    "tokens": (4, 512),
}
SMALL = {
    "codec": [65_536],
    "ddp": "mlp-2x64",
    "llama": Config(vocab=256, dim=64, heads=4, kv_heads=2, hidden=176, layers=1),
    "tokens": (2, 32),
}
PARTS = ["codec", "compiled DDP", "data_parallel against FSDP2", "link"]


def median_step_ms(step: Callable[[], object], device: torch.device, steps: int) -> float:
    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        synchronize(device)
        t0 = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def codec(device: torch.device, sizes: list[int]) -> None:
    """Part 1: ``quantize_cost.py`` at each size, its send and receive rows as values per
    second."""
    print("\n## codec\n\n| values | row | median ms | ns per value | values per second |")
    print("|---:|---|---:|---:|---:|")
    for numel in sizes:
        cmd = module_command("quantize_cost", "--device", device.type)
        out = subprocess.run(
            [*cmd, "--numel", str(numel), "--reps", "5"],
            capture_output=True,
            text=True,
            check=True,
            timeout=900,
            cwd=ROOT,
        ).stdout
        for line in out.splitlines():
            cells = [c.strip() for c in line.strip("|").split("|")]
            codec = cells[0].startswith(("send: ", "receive: "))  # the bf16 rows too
            if codec and len(cells) > 1 and re.fullmatch(r"[\d.]+", cells[1]):
                ms = float(cells[1])
                print(
                    f"| {numel:,} | {cells[0]} | {ms:.3f} | {ms * 1e6 / numel:.4f} | "
                    f"{numel / ms * 1e3:.3g} |"
                )


def compiled_ddp(device: torch.device, model: str, steps: int) -> None:
    """Part 2: bf16 hook + passes against bf16 hook + torch's bucketing, world size 1."""
    print(f"\n## compiled DDP, {model}, world size 1\n")
    print("| configuration | median step (ms) | kernels generated |\n|---|---:|---:|")
    for i, (name, passes_on, inductor) in enumerate(
        [
            ("bf16 hook + passes", True, {}),
            ("bf16 hook + torch bucketing", False, {"bucket_all_reduces_fx": "all"}),
        ]
    ):
        torch._dynamo.reset()  # compiled autograd's cache too: each configuration compiles
        net, inputs, target = make_model(model, i + 1)
        net, inputs, target = net.to(device), tuple(x.to(device) for x in inputs), target.to(device)
        _, run = ch.compile_ddp(net, ch.LowPrecisionState(dist.group.WORLD), ch.bf16_compress_hook)
        step = _ddp_step(run, net, inputs, target, passes_on, inductor)
        before = torch._inductor.metrics.generated_kernel_count
        ms = median_step_ms(step, device, steps)
        kernels = torch._inductor.metrics.generated_kernel_count - before
        print(f"| {name} | {ms:.2f} | {kernels} |")


def _ddp_step(run, net, inputs, target, pipeline: bool, inductor: dict) -> Callable[[], None]:
    def step() -> None:
        net.zero_grad(set_to_none=True)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch._inductor.config.patch(inductor))
            if pipeline:
                stack.enter_context(passes.install())
            stack.enter_context(ch.compiled_autograd())
            loss_of(run(*inputs), target).backward()

    return step


def _train_step(run, opt, x, y, compiled: bool) -> Callable[[], None]:
    def step() -> None:
        with passes.install() if compiled else contextlib.nullcontext():
            logits = run(x)
            F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def llama_steps(device: torch.device, config: Config, tokens: tuple[int, int], steps: int) -> None:
    """Part 3: data_parallel compiled + passes against FSDP2 eager, bf16, world size 1."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (1,))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, config.vocab, tokens, generator=g).to(device)
    y = torch.randint(0, config.vocab, tokens, generator=g).to(device)
    params = 0
    print(f"\n## data_parallel against FSDP2 eager, {config.layers} layers, world size 1\n")
    print("| configuration | median step (ms) | peak memory (GiB) |\n|---|---:|---:|")
    for name in ("FSDP2 eager", "data_parallel compiled + passes"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        net = LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)
        params = sum(p.numel() for p in net.parameters())
        blocks = list(net.model.layers)
        if name.startswith("FSDP2"):
            for block in blocks:
                fully_shard(block, mesh=mesh)
            run: Callable = fully_shard(net, mesh=mesh)
        else:
            run = torch.compile(data_parallel(net, mesh, blocks=blocks), fullgraph=True)
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        step = _train_step(run, opt, x, y, compiled=not name.startswith("FSDP2"))
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        ms = median_step_ms(step, device, steps)
        peak = (
            f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f}"
            if device.type == "cuda"
            else "-"
        )
        print(f"| {name} | {ms:.1f} | {peak} |")
        del net, run, opt, step
    print(f"\nLlama: {params / 1e6:.1f}M parameters, bf16, batch {tokens[0]} x {tokens[1]} tokens")


def link(run: bool) -> None:
    """Part 4: can this machine shape a link; with ``run``, ddp_sync on it."""
    problem = link_problem()
    print(f"\n## link\n\nip netns and tc: {'work' if problem is None else problem}")
    if problem is None and run:
        cmd = module_command("ddp_sync", "--link", "2gbit", "--models", "mlp-8x1024")
        subprocess.run([*cmd, "--steps", "10"], check=True, timeout=900, cwd=ROOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--small", action="store_true", help="the smallest sizes (the default on CPU)"
    )
    parser.add_argument(
        "--link-run", action="store_true", help="run ddp_sync.py on a 2 Gbit/s link if possible"
    )
    parser.add_argument(
        "--parts", nargs="+", choices=PARTS, default=PARTS, help="the parts to run (default: all)"
    )
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sizes = SMALL if args.small or device.type == "cpu" else FULL
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"gpu_step on {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())  # set_device needs an index
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    # every graph compiled here, its kernels counted: no cache serves one
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    parts = {  # in PARTS' order
        "codec": lambda: codec(device, sizes["codec"]),
        "compiled DDP": lambda: compiled_ddp(device, sizes["ddp"], args.steps),
        "data_parallel against FSDP2": lambda: llama_steps(
            device, sizes["llama"], sizes["tokens"], args.steps
        ),
        "link": lambda: link(args.link_run),
    }
    failed = []
    for part, fn in parts.items():
        if part not in args.parts:
            continue
        t0 = time.perf_counter()
        try:
            fn()
        except Exception:  # report and go on: one lease, every part's figures
            traceback.print_exc()
            failed.append(part)
        print(f"\n({part}: {time.perf_counter() - t0:.0f} s)", flush=True)
    dist.destroy_process_group()
    ran = len(args.parts) - len(failed)
    print(f"\ngpu_step: {ran} parts ran, failed: {', '.join(failed) or 'none'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
