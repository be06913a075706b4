"""Compiled DDP with a ZeRO-1 optimizer step inside backward, checked against unsharded AdamW.

    python examples/train_zero.py              # spawns 2 ranks (CPU + gloo without a GPU)
    python examples/train_zero.py --schedule after_backward --shard-buckets
    torchrun --nproc-per-node 2 examples/train_zero.py

Each rank trains the main example's tiny transformer twice from the same seed: once with eager
DDP and ``torch.optim.AdamW`` (the reference: every rank holds all optimizer state), once with
compiled DDP whose comm hook is ``hook_with_zero_step_interleaved`` (or ``hook_with_zero_step``
with ``--schedule after_backward``) over a ``ZeroOptimizer(AdamW)``; both with two parameter
groups (no weight decay on biases and norms) and a warmup-then-cosine ``LambdaLR``, which changes
tensors the compiled step reads, so it never recompiles. Backward, the sharded
AdamW step and the parameter broadcasts run as one compiled graph, scheduled by this project's
passes (``--shard-buckets`` also shards every parameter across ranks and turns the
all_reduce + broadcasts into reduce_scatter + all_gather). Rank 0 prints the losses, the
optimizer-state bytes per rank of both, what the passes did, the relative difference of the final
losses and of the parameters. Exits non-zero when the final losses differ by more than
``--tolerance`` (relative) or the ranks' parameters are not bitwise identical. (The parameter
difference is not a criterion: compiled and eager gradients round differently, and Adam turns a
rounding difference in a near-zero gradient into a difference of up to ``lr`` per step.)
"""

from __future__ import annotations

import warnings

# torch warns at import when numpy is missing (numpy is not a dependency).
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import math
import time

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel
from train_ddp import (
    TinyTransformer,
    batch,
    example_parser,
    launch,
    loss_fn,
    report_rank_guard,
    synchronize,
)

import compiled_hooks as ch
import passes
from compiled_hooks.zero import ZeroOptimizer, hook_with_zero_step, hook_with_zero_step_interleaved

LR = 1e-3


def param_groups(net: torch.nn.Module) -> list[dict]:
    """The usual recipe: weight decay on matrices, none on biases and norms."""
    params = list(net.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def lr_schedule(opt: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup over 5 steps, then cosine decay."""
    warmup = 5
    return torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            (s + 1) / warmup
            if s < warmup
            else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))
        ),
    )


def reference(
    rank: int, steps: int, device: torch.device
) -> tuple[list[float], torch.nn.Module, int]:
    torch.manual_seed(0)
    net = TinyTransformer().to(device)
    model = DistributedDataParallel(net)
    opt = torch.optim.AdamW(param_groups(net), lr=LR, foreach=False)
    sched = lr_schedule(opt, steps)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = loss_fn(model, *batch(rank, step, device=device))
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    return losses, net, state


def zero_run(
    rank: int, steps: int, schedule: str, shard_buckets: bool, log: bool, device: torch.device
):
    torch.manual_seed(0)
    net = TinyTransformer().to(device)
    zero = ZeroOptimizer(param_groups(net), torch.optim.AdamW, shard_buckets=shard_buckets, lr=LR)
    sched = lr_schedule(zero, steps)  # it changes tensors the compiled step reads: no recompile
    ddp, model = ch.compile_ddp(net)
    make_hook = (
        hook_with_zero_step_interleaved if schedule == "interleaved" else hook_with_zero_step
    )
    ddp.register_comm_hook(
        ch.DefaultState(dist.group.WORLD), make_hook(ch.allreduce_hook, ddp, zero, shard_buckets)
    )
    for p in net.parameters():  # gradients exist from step 0: one backward graph for every step
        p.grad = torch.zeros_like(p)
    losses = []
    # shard_weight_update leaves gloo graphs alone by default (its reduce_scatter costs more than
    # its all_reduce there); asked for here to show the rewrite and check it on every step
    pipeline = passes.default_pipeline(
        **(
            {"shard_weight_update": True, "shard_backends": ("gloo", "nccl")}
            if shard_buckets
            else {}
        )
    )
    for step in range(steps):
        tokens, targets = batch(rank, step, device=device)
        synchronize(device)
        t0 = time.perf_counter()
        zero.zero_grad(set_to_none=False)
        with passes.install(pipeline), ch.compiled_autograd():
            loss = loss_fn(model, tokens, targets)
            loss.backward()  # the optimizer step runs inside
        sched.step()
        synchronize(device)
        losses.append(loss.item())
        if log:
            note = " (includes compilation)" if step == 0 else ""
            print(
                f"step {step:3d}  loss {loss.item():.4f}  {(time.perf_counter() - t0) * 1e3:8.1f} "
                f"ms{note}",
                flush=True,
            )
    return losses, net, zero.state_bytes()


def run(rank: int, world_size: int, args) -> bool:
    log = rank == 0
    ref_losses, ref_net, ref_state = reference(rank, args.steps, args.device)
    if log:
        print(
            "--- compiled DDP + ZeroOptimizer(AdamW, two parameter groups, LambdaLR), schedule "
            f"{args.schedule}, shard_buckets={args.shard_buckets} ---",
            flush=True,
        )
    losses, net, state = zero_run(
        rank, args.steps, args.schedule, args.shard_buckets, log, args.device
    )
    diff = max(
        ((a - b).abs().max() / b.abs().max()).item()
        for a, b in zip(net.parameters(), ref_net.parameters())
    )
    # every rank must hold the same parameters
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    identical = all(torch.equal(g, gathered[0]) for g in gathered)
    rel = abs(losses[-1] - ref_losses[-1]) / abs(ref_losses[-1])
    ok = rel <= args.tolerance and identical
    if log:
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
        print(
            f"final loss: ZeRO {losses[-1]:.4f}  unsharded AdamW {ref_losses[-1]:.4f}  relative "
            f"difference {rel:.2e} ({'OK' if rel <= args.tolerance else 'FAIL'}: tolerance "
            f"{args.tolerance:g})",
            flush=True,
        )
        print(
            f"optimizer state per rank: ZeRO {state / 1e6:.3f} MB, unsharded "
            f"{ref_state / 1e6:.3f} MB ({state / ref_state:.1%}, {world_size} ranks)",
            flush=True,
        )
        print(
            f"parameters: max relative difference to the reference {diff:.2e}; identical on all "
            f"ranks: {identical}",
            flush=True,
        )
        report_rank_guard()
    return ok


def main() -> None:
    parser = example_parser(__doc__.split("\n\n")[0])
    parser.set_defaults(steps=20, tolerance=1e-3)
    parser.add_argument(
        "--schedule", choices=["interleaved", "after_backward"], default="interleaved"
    )
    parser.add_argument(
        "--shard-buckets", action="store_true", help="split every parameter evenly across ranks"
    )
    launch(run, parser.parse_args())


if __name__ == "__main__":
    main()
