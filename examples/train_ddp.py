"""Compiled DDP with bf16 gradient compression, checked against eager fp32 DDP.

    python examples/train_ddp.py                     # spawns 2 ranks (CPU + gloo without a GPU)
    torchrun --nproc-per-node 2 examples/train_ddp.py
    python examples/train_ddp.py --device cpu --backend gloo

``--device`` / ``--backend`` default to CUDA + NCCL when a GPU is visible (one GPU per rank),
CPU + gloo otherwise; step times are measured after synchronizing the device.

Each rank trains a tiny transformer on a synthetic next-token task twice from the same
seed: once with eager fp32 DDP (the reference), once with compiled DDP (python reducer +
compiled autograd), ``bf16_compress_hook`` and this project's graph passes (``--no-passes`` leaves
them out). ``--hook int8`` sends int8 gradients instead (``int8_compress_hook``, error feedback
on). ``--hook powersgd`` uses PowerSGD at rank 4 from step 5 instead, and SGD with momentum in
both runs, for 40 steps; it passes when the compressed run's final loss is at most
``--tolerance`` (10%) above the reference's (``--no-error-feedback`` to see what error
feedback is for, with PowerSGD or int8). Rank 0 prints the loss and step time of every step,
what the passes did, and how far the compiled run's final loss is from the reference's.
Exits non-zero if the runs disagree by more than ``--tolerance``. ``PASSES_VERIFY=1`` checks
every rewrite; ``PASSES_CHECK_RANKS=1`` turns on the rank-divergence guard.
"""

from __future__ import annotations

import warnings

# What a newcomer should not see: torch warns at import when numpy is missing (numpy is not a
# dependency), and Dynamo says once per rank that it ignores DDP's own profiler annotation.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import argparse
import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel

import compiled_hooks as ch
import passes

CPU = torch.device("cpu")

logging.getLogger("torch._dynamo.variables.ctx_manager").addFilter(
    lambda record: "Profiler record function" not in record.getMessage()
)

VOCAB, SEQ, BATCH = 64, 32, 16


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (
            self.qkv(self.norm1(x))
            .view(b, t, 3, self.heads, d // self.heads)
            .permute(2, 0, 3, 1, 4)
        )
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Decoder-only transformer: 12 parameter tensors per block plus 4."""

    def __init__(
        self, dim: int = 64, layers: int = 2, heads: int = 4, vocab: int = VOCAB, seq: int = SEQ
    ):
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens) + self.pos[: tokens.shape[1]]))


def batch(
    rank: int,
    step: int,
    batch_size: int = BATCH,
    seq_len: int = SEQ,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of t -> (5 t + 3) mod VOCAB from random starts: learnable, different per rank."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, VOCAB, (batch_size, 1), generator=g)
    seq = [start]
    for _ in range(seq_len):
        seq.append((5 * seq[-1] + 3) % VOCAB)
    seq = torch.cat(seq, dim=1).to(device)
    return seq[:, :-1], seq[:, 1:]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a host timer measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def loss_fn(model, tokens, targets):
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def comm_hook(hook: str, error_feedback: bool = True) -> tuple[object, Callable]:
    """(state, hook) for ``--hook``: bf16 or int8 compression, or PowerSGD at rank 4 from
    step 5."""
    if hook == "int8":
        state = ch.QuantizedState(dist.group.WORLD, error_feedback=error_feedback)
        return state, ch.int8_compress_hook
    if hook == "powersgd":
        state = ch.powersgd.PowerSGDState(
            dist.group.WORLD,
            matrix_approximation_rank=4,
            start_powerSGD_iter=5,
            use_error_feedback=error_feedback,
        )
        return state, ch.powersgd.powerSGD_hook
    return ch.LowPrecisionState(dist.group.WORLD), ch.bf16_compress_hook


def train(
    rank: int,
    steps: int,
    compiled: bool,
    log: bool,
    use_passes: bool = True,
    hook: str = "bf16",
    error_feedback: bool = True,
    device: torch.device = CPU,
) -> float:
    torch.manual_seed(0)
    net = TinyTransformer().to(device)
    if compiled:
        _, model = ch.compile_ddp(net, *comm_hook(hook, error_feedback))
    else:
        model = DistributedDataParallel(net)
    # PowerSGD is an algorithm for SGD with momentum (the paper's setting): with AdamW, which
    # rescales every coordinate, its approximation costs far more loss (docs/powersgd.md).
    opt = (
        torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        if hook == "powersgd"
        else torch.optim.AdamW(net.parameters(), lr=1e-3)
    )
    for p in net.parameters():  # gradients exist from step 0: one backward graph for every step
        p.grad = torch.zeros_like(p)
    no_feedback = "" if error_feedback else ", no error feedback"
    hook_name = {
        "bf16": "bf16_compress_hook",
        "int8": f"int8_compress_hook{f' ({no_feedback[2:]})' if no_feedback else ''}",
        "powersgd": f"powerSGD_hook (rank 4{no_feedback})",
    }[hook]
    label = (
        f"compiled DDP + {hook_name}" + (" + passes" if use_passes else "")
        if compiled
        else "eager DDP fp32"
    )
    label += ", SGD with momentum" if hook == "powersgd" else ""
    if log:
        print(f"--- {label} ---", flush=True)
    for step in range(steps):
        tokens, targets = batch(rank, step, device=device)
        synchronize(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        if compiled:
            with (
                passes.install() if use_passes else contextlib.nullcontext(),
                ch.compiled_autograd(),
            ):
                loss = loss_fn(model, tokens, targets)
                loss.backward()
        else:
            loss = loss_fn(model, tokens, targets)
            loss.backward()
        opt.step()
        synchronize(device)
        elapsed = time.perf_counter() - t0
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        if log:
            note = " (includes compilation)" if compiled and step == 0 else ""
            print(
                f"step {step:3d}  loss {mean_loss.item():.4f}  {elapsed * 1e3:8.1f} ms{note}",
                flush=True,
            )
    if log and compiled and use_passes:
        done = {
            k: v
            for k, v in counters["passes"].items()
            if "skipped" not in k and not k.endswith(": us")
        }
        print(
            "passes: "
            + (
                "; ".join(f"{k} (x{v})" for k, v in done.items())
                or "nothing to do (or the compiled graph came from the FX graph cache)"
            ),
            flush=True,
        )
    return mean_loss.item()


def report_rank_guard() -> None:
    """With ``PASSES_CHECK_RANKS=1``: how many compiled graphs the guard checked across ranks."""
    checked = counters["rank_guard"]["graphs checked"]
    if checked:
        print(
            f"rank guard: {checked} compiled graph(s) checked against every rank's, no divergence "
            f"({counters['rank_guard']['check us'] / 1e3:.0f} ms in first-run exchanges)",
            flush=True,
        )


def run(
    rank: int,
    world_size: int,
    steps: int,
    tolerance: float,
    use_passes: bool = True,
    hook: str = "bf16",
    error_feedback: bool = True,
    device: torch.device = CPU,
) -> bool:
    log = rank == 0
    # Eager DDP first: compile_ddp switches the process to DDP's python reducer.
    reference = train(rank, steps, compiled=False, log=log, hook=hook, device=device)
    result = train(
        rank,
        steps,
        compiled=True,
        log=log,
        use_passes=use_passes,
        hook=hook,
        error_feedback=error_feedback,
        device=device,
    )
    rel = (result - reference) / abs(reference)
    # bf16 must match fp32; PowerSGD, another algorithm, must not end worse (a lower loss passes)
    ok = rel <= tolerance if hook == "powersgd" else abs(rel) <= tolerance
    if log:
        print(
            f"final loss: compiled {hook} {result:.4f}  eager fp32 {reference:.4f}  relative "
            f"difference {rel:+.2e} ({'OK' if ok else 'FAIL'}: tolerance "
            f"{tolerance:.0%}{' (worse only)' if hook == 'powersgd' else ''}, {world_size} ranks, "
            f"{device.type})",
            flush=True,
        )
        report_rank_guard()
    return ok


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(args: argparse.Namespace, local_rank: int) -> tuple[torch.device, str]:
    """This rank's device (one GPU per rank on CUDA) and the backend: ``args.device`` /
    ``args.backend`` where given (the benchmarks give neither: CPU + gloo)."""
    kind = getattr(args, "device", None) or "cpu"
    backend = getattr(args, "backend", None) or ("nccl" if kind == "cuda" else "gloo")
    if kind == "cpu":
        return torch.device("cpu"), backend
    if kind != "cuda":
        raise ValueError(f"--device {kind!r}: expected cpu or cuda")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is visible")
    if backend == "nccl" and local_rank >= torch.cuda.device_count():
        raise RuntimeError(
            f"--backend nccl needs a GPU per rank: local rank {local_rank} of "
            f"{torch.cuda.device_count()} visible GPU(s); use fewer ranks or --backend gloo"
        )
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device, backend


def _in_group(
    rank: int,
    world_size: int,
    port: int | None,
    run_fn: Callable[..., bool],
    args: argparse.Namespace,
) -> None:
    """``run_fn(rank, world_size, args)`` inside a process group on ``args.device`` (set here to
    this rank's ``torch.device``); exit code 1 when it returns False."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if port is None else rank
    args.device, backend = resolve_device(args, local_rank)
    if port is None:  # torchrun: rank, world size and rendezvous come from the environment
        dist.init_process_group(backend)
    else:
        torch.set_num_threads(1)  # the spawned ranks share this machine's cores
        # as torchrun says it: every rank on this host (the passes' gloo defaults read it)
        os.environ.update(WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
    try:
        ok = run_fn(dist.get_rank(), dist.get_world_size(), args)
        dist.barrier()  # gloo aborts a process whose peer tore the group down first
    finally:
        dist.destroy_process_group()
    if not ok:
        sys.exit(1)


def launch(run_fn: Callable[..., bool], args: argparse.Namespace) -> None:
    """Under torchrun run this rank; otherwise spawn ``args.world_size`` ranks."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _in_group(-1, -1, None, run_fn, args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world_size = args.world_size or default_world_size(args)
    mp.spawn(_in_group, args=(world_size, port, run_fn, args), nprocs=world_size)


def default_world_size(args: argparse.Namespace) -> int:
    """2 ranks, or one per GPU on fewer than 2 GPUs with NCCL (which needs a GPU per rank)."""
    if args.device == "cuda" and (args.backend or "nccl") == "nccl":
        return max(1, min(2, torch.cuda.device_count()))
    return 2


def example_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--world-size",
        type=int,
        help="ranks to spawn (ignored under torchrun); default 2, or 1 on one GPU with NCCL",
    )
    parser.add_argument(
        "--tolerance", type=float, default=0.05, help="max relative final-loss difference"
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=default_device(),
        help="default: cuda when a GPU is visible (one per rank), else cpu",
    )
    parser.add_argument(
        "--backend",
        choices=["gloo", "nccl"],
        help="default: nccl with --device cuda, gloo with cpu",
    )
    return parser


def _run_args(rank: int, world_size: int, args: argparse.Namespace) -> bool:
    steps = args.steps or (40 if args.hook == "powersgd" else 30)
    tolerance = args.tolerance or (0.10 if args.hook == "powersgd" else 0.05)
    return run(
        rank,
        world_size,
        steps,
        tolerance,
        not args.no_passes,
        args.hook,
        not args.no_error_feedback,
        args.device,
    )


def main() -> None:
    parser = example_parser(__doc__.split("\n\n")[0])
    parser.add_argument(
        "--no-passes", action="store_true", help="compile without this project's graph passes"
    )
    parser.add_argument(
        "--hook",
        choices=["bf16", "int8", "powersgd"],
        default="bf16",
        help="bf16_compress_hook, int8_compress_hook, or PowerSGD at rank 4 from step 5 "
        "(compiled_hooks.powersgd)",
    )
    parser.add_argument(
        "--no-error-feedback", action="store_true", help="PowerSGD or int8 without error feedback"
    )
    # 30 steps and 5% (bf16), 40 steps and 10% (powersgd)
    parser.set_defaults(steps=None, tolerance=None)
    launch(_run_args, parser.parse_args())


if __name__ == "__main__":
    main()
