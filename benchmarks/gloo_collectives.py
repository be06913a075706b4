"""What one collective costs on gloo, against the time its bytes need on the link.

    python -m benchmarks.gloo_collectives --link 2gbit  # 2 ranks, a 2 Gbit/s link (root, ip, tc)

For tensors of ``--sizes-mb`` (default 8 and 16) MB of bf16 (the full size: an all-gather's
output, every other collective's input): all_reduce, the functional reduce_scatter_tensor,
all_gather_into_tensor and all_to_all_single as traced graphs issue them, the all_to_all also
in pieces of at most ``--chunk-kib`` per destination (default ``ALL_TO_ALL_CHUNK_BYTES``; one
row per size given), all in flight at once (as the passes' gloo rewrites send it), and
``dist.all_gather_into_tensor`` / ``dist.reduce_scatter_tensor`` as FSDP2 does.
Medians of ``--reps`` back-to-back runs, each after a barrier. The ideal is each rank sending
``(N - 1) / N`` of the full size at the link's rate (twice that for a ring all_reduce). The
passes' gloo rules (``all_gather_as_all_to_all``, ``reduce_scatter_as_all_to_all``, their
pieces, ``shard_weight_update``'s backends) rest on this table.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fcol

from benchmarks.common.launch import (
    add_link_argument,
    describe_link,
    launch,
    link_bytes_per_s,
    median_ms,
)
from passes.core.groups import ALL_TO_ALL_CHUNK_BYTES, chunk_bounds


def _all_to_all_in_pieces(full: torch.Tensor, world: int, group, chunk_bytes: int) -> None:
    rows = full.view(world, -1)
    pieces = [
        rows[:, lo:hi].contiguous()
        for lo, hi in chunk_bounds(rows.shape[1], full.element_size(), chunk_bytes)
    ]
    for handle in [fcol.all_to_all_single(p, None, None, group) for p in pieces]:
        fcol.wait_tensor(handle)


def _cases(
    numel: int, world: int, group: dist.ProcessGroup, chunk_kib: list[int]
) -> dict[str, tuple[Callable[[], object], int]]:
    """Each collective over ``numel`` bf16 elements: a call, and how many times its bytes cross
    the link."""
    full, part = (
        torch.ones(numel, dtype=torch.bfloat16),
        torch.ones(numel // world, dtype=torch.bfloat16),
    )
    pieces = {
        f"all_to_all_single (functional), pieces of {kib} KiB per destination": (
            lambda kib=kib: _all_to_all_in_pieces(full, world, group, kib << 10),
            1,
        )
        for kib in chunk_kib
    }
    return {
        "all_reduce": (lambda: dist.all_reduce(full), 2),
        "reduce_scatter_tensor (functional)": (
            lambda: fcol.wait_tensor(fcol.reduce_scatter_tensor(full, "sum", 0, group)),
            1,
        ),
        "all_to_all_single (functional)": (
            lambda: fcol.wait_tensor(fcol.all_to_all_single(full, None, None, group)),
            1,
        ),
        **pieces,
        "all_gather_into_tensor (functional)": (
            lambda: fcol.wait_tensor(fcol.all_gather_tensor(part, 0, group)),
            1,
        ),
        "dist.reduce_scatter_tensor": (
            lambda: dist.reduce_scatter_tensor(torch.empty_like(part), full),
            1,
        ),
        "dist.all_gather_into_tensor": (
            lambda: dist.all_gather_into_tensor(torch.empty_like(full), part),
            1,
        ),
    }


def _worker(rank: int, world: int, args: argparse.Namespace) -> bool:
    group = dist.group.WORLD
    rate = link_bytes_per_s(args.link)
    rows = []
    for mb in args.sizes_mb:
        numel = int(mb * 2**20) // 2 // world * world
        cases = _cases(numel, world, group, args.chunk_kib)
        for name, (fn, passes_over) in cases.items():
            ms = median_ms(fn, args.reps)
            ideal = passes_over * numel * 2 * (world - 1) / world / rate * 1e3 if rate else None
            rows.append((f"{name}, {mb:g} MB bf16", ms, ideal))
    if rank == 0:
        print(
            f"{describe_link()}, gloo, 1 thread each; medians of {args.reps}; torch "
            f"{torch.__version__}, {time.strftime('%Y-%m-%d')}\n"
        )
        print("| collective | time (ms) | its bytes at the link rate (ms) | ratio |")
        print("|---|---:|---:|---:|")
        for name, ms, ideal in rows:
            ratio = f"{ms / ideal:.2f}x" if ideal else "-"
            print(f"| {name} | {ms:.1f} | {'-' if ideal is None else f'{ideal:.1f}'} | {ratio} |")
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[8, 16])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument(
        "--chunk-kib",
        type=int,
        nargs="+",
        default=[ALL_TO_ALL_CHUNK_BYTES >> 10],
        help="piece sizes (KiB per destination) of the chunked all_to_all rows",
    )
    add_link_argument(parser)
    parser.set_defaults(world_size=2)
    launch(_worker, parser.parse_args())


if __name__ == "__main__":
    main()
