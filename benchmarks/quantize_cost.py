"""What the int8 hooks' quantization costs beside a bf16 cast, compiled, on one device.

    python -m benchmarks.quantize_cost [--device cpu|cuda] [--numel 8392704] [--rows 2]

One gradient of ``--numel`` fp32 elements, as ``--rows`` destination rows (the world size), goes
through what each hook's compiled step computes around its collective, each function compiled
on its own:

- send: the bf16 cast; int8 ``quantize`` + ``pack`` (blocks of 256, fp32 scales; ``pack`` is a
  ``cat`` on CPU, pads and an add elsewhere); the same bytes written the other way; ``quantize``
  + ``pack`` with error feedback (the kept residual added first, the new residual written, as
  the hook computes it);
- receive: the bf16 rows summed in fp32; the int8 rows dequantized and summed
  (``sum_received``: on CPU the ATen op, elsewhere Inductor's loop), and the same the
  other way.

Each row prints its median time over ``--reps`` rounds of one call of each configuration, the
order rotated every round (after two warm-up rounds; on CUDA the device synchronized around
each call), the bytes it must read and write at least, and its ratio to those bytes' time at
the rate of a compiled fp32 copy into an allocated buffer, measured in the same run (a
memory-bound row is near 1x). A row that allocates an output above the allocator's cached
sizes (on glibc, fp32 outputs above 32 MiB come fresh from the system on every call) also pays
its page faults.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.common import results
from benchmarks.common.models import synchronize
from compiled_hooks.int8 import ops
from compiled_hooks.int8.codec import (
    dequantize_packed,
    pack,
    pack_by_cat,
    pack_by_pads,
    quantize,
    to_blocks,
)
from compiled_hooks.int8.collectives import sum_received

BLOCK = 256


def _send_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16)


def _send_int8(x: torch.Tensor) -> torch.Tensor:
    return pack(*quantize(x, BLOCK))


def _send_int8_other(x: torch.Tensor) -> torch.Tensor:
    """``pack``'s bytes written the way ``pack`` does not on this device: by pads and an add on
    CPU, by a cat elsewhere."""
    other = pack_by_pads if x.device.type == "cpu" else pack_by_cat
    return other(*quantize(x, BLOCK))


def _send_int8_feedback(x: torch.Tensor, error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # as the hook computes it: the residual in the block layout, where each scale is its block's
    y = x + error
    q, scales = quantize(y, BLOCK)
    return pack(q, scales), to_blocks(y, BLOCK) - q.float() * scales.unsqueeze(2)


def _receive_bf16(rows: torch.Tensor) -> torch.Tensor:
    return rows.float().sum(0)


def _receive_int8(packed: torch.Tensor, n: int) -> torch.Tensor:
    return sum_received(packed, BLOCK, n)


def _receive_int8_other(packed: torch.Tensor, n: int) -> torch.Tensor:
    """``sum_received``'s sum with the values computed the way it does not on this device: by
    Inductor's loop on CPU, by the ATen op elsewhere."""
    cpu = packed.device.type == "cpu"
    values = dequantize_packed(packed, BLOCK) if cpu else ops.dequantize_packed(packed, BLOCK)
    return values.sum(0).view(-1)[:n]


def _copy(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return out.copy_(x)


def _medians_ms(calls: list[Callable[[], object]], reps: int, device: torch.device) -> list[float]:
    """Median time of each call over ``reps`` rounds, one call of each per round in an order
    rotated every round (after two warm-up rounds), the device synchronized around each."""
    times: list[list[float]] = [[] for _ in calls]
    for r in range(reps + 2):
        for i in [(r + k) % len(calls) for k in range(len(calls))]:
            synchronize(device)
            t0 = time.perf_counter()
            calls[i]()
            synchronize(device)
            if r >= 2:
                times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) * 1e3 for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--numel", type=int, default=8392704, help="mlp-8x1024's parameters")
    parser.add_argument("--rows", type=int, default=2, help="destination rows (world size)")
    parser.add_argument("--reps", type=int, default=20)
    results.add_output_arguments(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    cpu = device.type == "cpu"
    n = args.numel // args.rows
    x = torch.randn(args.rows, n, device=device)
    error = torch.randn(args.rows, n, device=device) * 1e-3
    packed = _send_int8(x)
    assert torch.equal(_send_int8_other(x), packed)
    wire = packed.numel()  # int8 bytes on the wire, scales included
    compiled = {
        f: torch.compile(f, fullgraph=True)
        for f in (
            _send_bf16,
            _send_int8,
            _send_int8_other,
            _send_int8_feedback,
            _receive_bf16,
            _receive_int8,
            _receive_int8_other,
        )
    }
    out = torch.empty_like(x)
    copy = torch.compile(_copy, fullgraph=True)
    elements = x.numel()
    rows_in = _send_bf16(x)
    # (config, call, bytes read and written at least)
    runs: list[tuple[str, Callable[[], object], int]] = [
        ("copy: fp32 into an allocated buffer", lambda: copy(out, x), 8 * elements),
        ("send: bf16 cast", lambda: compiled[_send_bf16](x), 6 * elements),
        (
            f"send: int8 quantize + pack ({'a cat' if cpu else 'pads and an add'})",
            lambda: compiled[_send_int8](x),
            4 * elements + wire,
        ),
        (
            f"send: int8 quantize, packed by {'pads and an add' if cpu else 'a cat'}",
            lambda: compiled[_send_int8_other](x),
            4 * elements + wire,
        ),
        (
            "send: int8 + error feedback",
            lambda: compiled[_send_int8_feedback](x, error),
            12 * elements + wire,
        ),
        ("receive: bf16 sum", lambda: compiled[_receive_bf16](rows_in), 2 * elements + 4 * n),
        (
            f"receive: int8 dequantize + sum ({'the ATen op' if cpu else 'a loop'})",
            lambda: compiled[_receive_int8](packed, n),
            wire + 4 * n,
        ),
        (
            "receive: int8 dequantized by " + ("Inductor's loop" if cpu else "the ATen op"),
            lambda: compiled[_receive_int8_other](packed, n),
            wire + 4 * n,
        ),
    ]
    medians = _medians_ms([call for _, call, _ in runs], args.reps, device)
    gb_per_ms = runs[0][2] / medians[0] / 1e6
    rows = []
    for (config, _, nbytes), ms in zip(runs, medians):
        at_copy_rate = nbytes / gb_per_ms / 1e6
        rows.append(
            {
                "config": config,
                "median_ms": round(ms, 3),
                "MB": round(nbytes / 1e6, 1),
                "GB_per_s": round(nbytes / ms / 1e6, 1),
                "vs_copy_rate": f"{ms / at_copy_rate:.2f}x",
            }
        )
    where = f"{device.type}, {args.rows} rows of {n} fp32 elements"
    print(
        f"quantize cost on {results.machine()} ({where}); median of {args.reps} interleaved "
        f"calls; copy rate {gb_per_ms:.1f} GB/s"
    )
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for r in rows:
        print("| " + " | ".join(str(v) for v in r.values()) + " |")
    table = results.table("quantize cost", rows, note=f"copy {gb_per_ms:.1f} GB/s")
    results.write(args, "quantize_cost", where, [table])


if __name__ == "__main__":
    main()
