"""Quick start: compiled DDP with bf16 gradient compression and the graph passes.

python examples/quickstart.py                       # spawns 2 ranks
torchrun --nproc-per-node 2 examples/quickstart.py
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import compiled_hooks as ch
import passes


def train(rank: int, world_size: int, port: int | None = None) -> None:
    cuda = torch.cuda.device_count() >= world_size  # one GPU per rank, else CPU
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        rank=rank,
        world_size=world_size,
        init_method=f"tcp://127.0.0.1:{port}" if port else None,  # None: torchrun's env://
    )
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    torch.manual_seed(0)  # the same initial weights on every rank
    net = torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)
    ).to(device)

    # DDP in python-reducer mode, the hook registered, the forward compiled
    ddp, model = ch.compile_ddp(net, ch.LowPrecisionState(dist.group.WORLD), ch.bf16_compress_hook)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    passes.install()  # Inductor runs the graph passes from now on

    data = torch.Generator().manual_seed(rank)  # each rank its own batches
    losses = []
    for step in range(30):
        x = torch.randn(64, 32, generator=data).to(device)
        y = x[:, :8].sum(1, keepdim=True)  # a target the net can learn
        with ch.compiled_autograd():  # backward, bf16 all_reduces and casts: one compiled graph
            loss = F.mse_loss(model(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if rank == 0 and (step == 0 or step % 10 == 9):
            print(f"step {step + 1}: loss {losses[-1]:.4f}", flush=True)
    if rank == 0:
        ok = losses[-1] < losses[0] / 4
        print(
            f"final loss: {losses[-1]:.4f} ({'OK' if ok else 'FAIL'}: under a quarter of the first)"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:  # torchrun
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(train, args=(2, port), nprocs=2)
