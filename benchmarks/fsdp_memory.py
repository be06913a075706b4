"""What an FSDP step keeps for backward, with and without activation checkpointing:
compile-native ``data_parallel`` (eager and compiled) beside FSDP2 (eager) doing the same.

    python -m benchmarks.fsdp_memory                  # world size 2, mlp-blocks
    python -m benchmarks.fsdp_memory --world-size 8

One process on the fake process group (every rank's graph and tensors are the same; no
collective moves data), so the bytes are exact and the run takes seconds. The model,
``mlp-blocks``: 4 blocks of ``Linear(1024, 4096)``, GELU, ``Linear(4096, 1024)`` with a
residual, batch 64, fp32, each block an FSDP block; full activation checkpointing wraps each
block with ``checkpoint_wrapper`` before sharding, as torchtitan does. Rows: FSDP2 and
``data_parallel`` eager, and ``data_parallel`` compiled, each resharding after forward and
keeping, each with and without checkpointing. Columns:

- ``activations_mb``: the bytes held for backward after the forward that are neither a
  parameter's shard nor a gathered parameter. Eager, every storage autograd packs during the
  forward (``saved_tensors_hooks``), at its size once the forward returned; compiled, the
  values the partitioned forward graph returns for backward
  (``passes.testing.saved_for_backward``).
- ``gathered_mb``: gathered (unsharded) parameters held after the forward: saved for
  backward, kept for a recompute (``data_parallel`` keeping, eager), or held by FSDP2 itself
  (keeping).
- ``peak_gathered_mb`` (compiled): the most bytes of gathered parameters alive at once in the
  forward or the backward graph, after the block passes (``passes.testing.gathered_bytes_alive``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import results
from compiled_hooks.fsdp import data_parallel, data_parallel_state
from passes import bucket_block_all_gathers, bucket_block_reduce_scatters
from passes.testing import (
    fake_process_group,
    gathered_bytes_alive,
    partitioned_graphs,
    saved_for_backward,
)

MB = 2**20
GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default


class Block(nn.Module):
    def __init__(self, dim: int = 1024, hidden: int = 4096):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


def make_model(ac: bool) -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    blocks = [Block() for _ in range(4)]
    if ac:
        blocks = [checkpoint_wrapper(b) for b in blocks]
    return nn.Sequential(*blocks), torch.randn(64, 1024)


class _Gathers(TorchDispatchMode):
    """The storages of the all-gathers dispatched while active (data_parallel's, eager)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, torch.Tensor] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func is GATHER:
            self.storages[_storage(out)] = out
        return out


def _storage(t: torch.Tensor) -> int:
    """An identity of ``t``'s storage that a freed and reallocated buffer does not reuse while
    ``t`` is alive (a data pointer would be reused)."""
    return t.untyped_storage()._cdata


def eager_step(
    model: nn.Module,
    x: torch.Tensor,
    gathered: dict[int, torch.Tensor],
    kept: Callable[[], list[torch.Tensor]],
) -> tuple[float, float]:
    """One forward and backward; (activations, gathered parameters) in MB held for backward
    once the forward returned: the storages autograd packed, at their size then (FSDP2 frees
    a resharded parameter's storage after forward), and the tensors ``kept()`` gives then.
    ``gathered`` holds the storages of gathered parameters once the forward has run."""
    shards = {_storage(p.to_local()) for p in model.parameters()}
    packed: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.setdefault(_storage(t), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).square().mean()
    held = {**packed, **{_storage(t): t for t in kept()}}
    activations = params = 0
    for key, t in held.items():
        nbytes = t.untyped_storage().nbytes()
        if key in gathered:
            params += nbytes
        elif key not in shards:
            activations += nbytes
    loss.backward()
    return activations / MB, params / MB


def fsdp2_row(mesh, ac: bool, reshard: bool) -> dict:
    model, x = make_model(ac)
    unsharded: dict[int, torch.Tensor] = {}

    def record(module: nn.Module, args: object) -> None:  # runs after FSDP2 unshards
        unsharded.update((_storage(p), p) for p in module.parameters())

    for block in model:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        block.register_forward_pre_hook(record)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    # FSDP2 holds its unsharded parameters itself (keep mode), saved for backward or not
    activations, params = eager_step(model, x, unsharded, lambda: list(unsharded.values()))
    return {"activations_mb": activations, "gathered_mb": params, "peak_gathered_mb": None}


def data_parallel_eager_row(mesh, ac: bool, reshard: bool) -> dict:
    model, x = make_model(ac)
    data_parallel(model, mesh, reshard_after_forward=reshard, blocks=list(model))
    kept = data_parallel_state(model).kept  # keep mode's gathered parameters, for a recompute
    with _Gathers() as gathers:
        activations, params = eager_step(model, x, gathers.storages, lambda: list(kept.values()))
    return {"activations_mb": activations, "gathered_mb": params, "peak_gathered_mb": None}


def data_parallel_compiled_row(mesh, ac: bool, reshard: bool) -> dict:
    torch._dynamo.reset()
    model, x = make_model(ac)
    data_parallel(model, mesh, reshard_after_forward=reshard, blocks=list(model))
    graphs = dict(
        partitioned_graphs(
            lambda compile: compile(model, fullgraph=True)(x).square().mean().backward()
        )
    )
    params, activations = saved_for_backward(graphs["forward"].graph)
    peak = 0
    for gm in graphs.values():
        bucket_block_all_gathers(gm.graph)
        bucket_block_reduce_scatters(gm.graph)
        peak = max(peak, max(gathered_bytes_alive(gm.graph), default=0))
    return {
        "activations_mb": activations / MB,
        "gathered_mb": params / MB,
        "peak_gathered_mb": peak / MB,
    }


def checks(rows: list[dict]) -> list[str]:
    """The claims the table supports, each with OK or FAIL: with full AC, ``data_parallel``
    holds no more activations than FSDP2 with full AC; a resharding compiled step with full AC
    has at most one block's gathered parameters alive at a time beyond the one in flight."""
    by = {r["config"]: r for r in rows}
    out = []
    fsdp2 = max(by[f"FSDP2 eager, {m}, full AC"]["activations_mb"] for m in ("reshard", "keep"))
    for name in ("data_parallel eager", "data_parallel compiled"):
        ours = max(by[f"{name}, {m}, full AC"]["activations_mb"] for m in ("reshard", "keep"))
        verdict = "OK" if ours <= fsdp2 else "FAIL"
        out.append(
            f"{verdict}: {name} + full AC holds {ours:.1f} MB of activations, FSDP2 + full AC "
            f"{fsdp2:.1f} MB"
        )
    block = sum(p.numel() * p.element_size() for p in Block().parameters()) / MB
    peak = by["data_parallel compiled, reshard, full AC"]["peak_gathered_mb"]
    verdict = "OK" if peak <= 2 * block else "FAIL"
    out.append(
        f"{verdict}: data_parallel compiled, reshard + full AC: at most {peak:.1f} MB gathered "
        f"at once; one block is {block:.1f} MB (bound: two, the one computing and the next)"
    )
    return out


ROWS = {
    "FSDP2 eager": fsdp2_row,
    "data_parallel eager": data_parallel_eager_row,
    "data_parallel compiled": data_parallel_compiled_row,
}


def measure(mesh) -> list[dict]:
    """Every row: FSDP2 and data_parallel (eager, compiled), reshard and keep, without and with
    full AC."""
    rows = []
    for reshard in (True, False):
        for ac in (False, True):
            for name, row in ROWS.items():
                mode = "reshard" if reshard else "keep"
                config = f"{name}, {mode}, {'full AC' if ac else 'no AC'}"
                rows.append({"config": config, **row(mesh, ac, reshard)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    results.add_output_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    fake_process_group(args.world_size)
    mesh = init_device_mesh("cpu", (args.world_size,))
    rows = measure(mesh)
    print(
        f"mlp-blocks (4 x Linear(1024, 4096) + Linear(4096, 1024), batch 64, fp32), "
        f"{args.world_size} ranks (fake process group); torch {torch.__version__}"
    )
    print("| config | activations held (MB) | gathered held (MB) | peak gathered (MB) |")
    print("|---|---:|---:|---:|")
    for r in rows:
        peak = "-" if r["peak_gathered_mb"] is None else f"{r['peak_gathered_mb']:.1f}"
        print(f"| {r['config']} | {r['activations_mb']:.1f} | {r['gathered_mb']:.1f} | {peak} |")
    print(*checks(rows), sep="\n")
    table = results.table("held for backward after the forward", rows, value="activations_mb")
    results.write(args, "fsdp_memory", f"{args.world_size} fake ranks", [table])


if __name__ == "__main__":
    main()
