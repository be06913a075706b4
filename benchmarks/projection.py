"""A model, not a measurement: bf16 against int8 gradients per step on a cluster of your own.

    python -m benchmarks.projection --params 1.1e9 --world-size 8 --link 100gbit \
        --send-ns 0.0185 --receive-ns 0.0091 [--bf16-ns 0.0092] [--overlapped]

From three inputs, the time per step that the gradients' communication takes:

- ``--send-ns`` and ``--receive-ns``: the int8 codec's nanoseconds per value on the device, as
  ``quantize_cost.py`` measures them there (its "int8 + error feedback" send row and its int8
  receive row, each over ``--numel``), and ``--bf16-ns`` the bf16 cast's (its send row);
- ``--params``: the model's parameter count;
- ``--link``: each rank's link rate (``--world-size`` ranks, ring collectives).

What it counts, per rank and step, for the all-reduce of ``P`` gradient values on ``N`` ranks::

    bf16 wire   = 2 (N-1)/N * P * 2 bytes / link                       reduce-scatter + all-gather
    bf16 codec  = 2 P bf16_ns                                  the cast down and the cast back
    bf16        = wire + codec
    int8 wire   = 2 (N-1)/N * P * (1 + SCALE_BYTES / BLOCK_SIZE) / link    the same, int8 rows
    int8 codec  = P * ((1 + 1/N) send_ns + 2 receive_ns)     quantize all and the shard (with
                                                  error feedback), dequantize and sum the rows
                                                  received, dequantize the gathered
    int8        = wire + codec (serialized, as the hook runs today), or max(wire, codec) with
                  ``--overlapped`` (each bucket's codec hidden behind another's wire)

int8 pays where its time is under bf16's: serialized, below the link rate at which the wire
time it saves equals its codec time (:func:`break_even_link`). Compute, and its overlap with
the collectives, is not modelled: the step is at least the larger of this and the backward.
ZeRO++'s published figures sit beside it in docs/quantized.md.
"""

from __future__ import annotations

import argparse
import dataclasses

from benchmarks.common.launch import link_bytes_per_s, link_rate
from compiled_hooks.int8.codec import BLOCK_SIZE, SCALE_BYTES

BF16_BYTES = 2
INT8_BYTES = 1 + SCALE_BYTES / BLOCK_SIZE  # a value and its share of its block's scale


@dataclasses.dataclass(frozen=True)
class Projection:
    """Seconds per step and rank."""

    bf16_wire: float
    bf16_codec: float
    int8_wire: float
    int8_codec: float
    int8: float

    @property
    def bf16(self) -> float:
        return self.bf16_wire + self.bf16_codec

    @property
    def int8_over_bf16(self) -> float:
        return self.int8 / self.bf16


def _ring(world_size: int) -> float:
    """What one value's share of an all-reduce crosses a rank's link: ``2 (N-1)/N``."""
    if world_size < 2:
        raise ValueError(f"projection: world_size must be at least 2, got {world_size}")
    return 2 * (world_size - 1) / world_size


def _codec_ns(world_size: int, send_ns: float, receive_ns: float) -> float:
    """The codec's nanoseconds per gradient value of an all-reduce."""
    if send_ns < 0 or receive_ns < 0:
        raise ValueError(
            f"projection: codec times must not be negative, got {send_ns}, {receive_ns}"
        )
    return (1 + 1 / world_size) * send_ns + 2 * receive_ns


def project(
    params: float,
    world_size: int,
    link_bytes_per_s: float,
    send_ns: float,
    receive_ns: float,
    overlapped: bool,
    bf16_ns: float = 0.0,
) -> Projection:
    """The model of the module docstring for ``params`` values on ``world_size`` ranks."""
    if params <= 0 or link_bytes_per_s <= 0 or bf16_ns < 0:
        raise ValueError(
            f"projection: params and the link rate must be positive and bf16_ns not negative, "
            f"got {params}, {link_bytes_per_s}, {bf16_ns}"
        )
    ring = _ring(world_size)
    bf16_wire = ring * params * BF16_BYTES / link_bytes_per_s
    int8_wire = ring * params * INT8_BYTES / link_bytes_per_s
    codec = params * _codec_ns(world_size, send_ns, receive_ns) * 1e-9
    int8 = max(int8_wire, codec) if overlapped else int8_wire + codec
    return Projection(bf16_wire, 2 * params * bf16_ns * 1e-9, int8_wire, codec, int8)


def break_even_link(
    world_size: int, send_ns: float, receive_ns: float, bf16_ns: float = 0.0
) -> float:
    """The link rate, in bytes per second, below which serialized int8 takes less time than bf16
    (``inf``: at any rate, where int8's codec costs no more than bf16's casts)."""
    codec_ns = _codec_ns(world_size, send_ns, receive_ns) - 2 * bf16_ns
    if codec_ns <= 0:
        return float("inf")
    saved = _ring(world_size) * (BF16_BYTES - INT8_BYTES)  # bytes a value saves on the wire
    return saved / (codec_ns * 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, required=True, help="the model's parameters")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument(
        "--link", type=link_rate, default="100gbit", help="each rank's link, e.g. 500mbit"
    )
    parser.add_argument(
        "--send-ns", type=float, required=True, help="ns per value: quantize, error feedback"
    )
    parser.add_argument(
        "--receive-ns", type=float, required=True, help="ns per value: dequantize and sum"
    )
    parser.add_argument("--bf16-ns", type=float, default=0.0, help="ns per value: bf16 cast")
    parser.add_argument("--overlapped", action="store_true", help="codec hidden behind the wire")
    args = parser.parse_args()
    link = link_bytes_per_s(args.link)
    assert link is not None, "link_rate accepts only rates"
    p = project(
        args.params,
        args.world_size,
        link,
        args.send_ns,
        args.receive_ns,
        args.overlapped,
        args.bf16_ns,
    )
    form = "overlapped" if args.overlapped else "serialized"
    even = break_even_link(args.world_size, args.send_ns, args.receive_ns, args.bf16_ns) * 8 / 1e9
    print(
        f"A model (benchmarks/projection.py), not a measurement: {args.params:.3g} parameters, "
        f"{args.world_size} ranks, {args.link} links, codec {args.send_ns:g} ns a value to send "
        f"and {args.receive_ns:g} to receive, int8 {form}.\n"
        f"  bf16: wire {p.bf16_wire * 1e3:.1f} ms + casts {p.bf16_codec * 1e3:.1f} ms -> "
        f"{p.bf16 * 1e3:.1f} ms\n"
        f"  int8: wire {p.int8_wire * 1e3:.1f} ms + codec {p.int8_codec * 1e3:.1f} ms -> "
        f"{p.int8 * 1e3:.1f} ms ({p.int8_over_bf16:.2f}x bf16)\n"
        f"  serialized int8 pays below {even:.3g} Gbit/s"
    )


if __name__ == "__main__":
    main()
