"""benchmarks/projection.py: the model's arithmetic against hand-computed figures, the break-even
link rate where serialized int8 and bf16 take the same time, and its refusals."""

import argparse
import math

import pytest

from benchmarks.common.launch import link_bytes_per_s, link_rate
from benchmarks.projection import INT8_BYTES, break_even_link, project
from compiled_hooks.int8.codec import BLOCK_SIZE, SCALE_BYTES  # noqa: E402

MLP_8X1024 = 8_392_704


def test_two_ranks_at_half_a_gigabit():
    """mlp-8x1024 on 2 ranks at 0.5 Gbit/s: 16.8 MB of bf16 (2 bytes a value, every value
    crossing once each way over the ring's two halves) take 268.6 ms; int8 sends 1 + 4/256
    bytes a value; the codec quantizes every value and the shard (1.5 sends a value) and
    dequantizes what it receives twice."""
    p = project(MLP_8X1024, 2, link_bytes_per_s("500mbit"), 2.0, 1.0, overlapped=False)
    assert p.bf16_wire == pytest.approx(MLP_8X1024 * 2 / 62.5e6)
    assert p.bf16_wire == pytest.approx(0.2686, abs=1e-4)
    assert INT8_BYTES == 1 + SCALE_BYTES / BLOCK_SIZE
    assert p.int8_wire == pytest.approx(p.bf16_wire * INT8_BYTES / 2)
    assert p.int8_codec == pytest.approx(MLP_8X1024 * (1.5 * 2.0 + 2 * 1.0) * 1e-9)
    assert p.int8 == pytest.approx(p.int8_wire + p.int8_codec)
    assert p.bf16 == p.bf16_wire  # no cast cost given
    cast = project(MLP_8X1024, 2, link_bytes_per_s("500mbit"), 2.0, 1.0, False, bf16_ns=0.5)
    assert cast.bf16 == pytest.approx(p.bf16_wire + 2 * MLP_8X1024 * 0.5e-9)
    overlapped = project(MLP_8X1024, 2, link_bytes_per_s("500mbit"), 2.0, 1.0, overlapped=True)
    assert overlapped.int8 == pytest.approx(max(p.int8_wire, p.int8_codec))


@pytest.mark.parametrize("world_size", [2, 8, 384])
def test_at_the_break_even_link_both_take_the_same_time(world_size):
    link = break_even_link(world_size, 0.5, 0.25, 0.1)
    even = project(1e9, world_size, link, 0.5, 0.25, overlapped=False, bf16_ns=0.1)
    assert even.int8 == pytest.approx(even.bf16)
    slower = project(1e9, world_size, link / 2, 0.5, 0.25, overlapped=False, bf16_ns=0.1)
    faster = project(1e9, world_size, link * 2, 0.5, 0.25, overlapped=False, bf16_ns=0.1)
    assert slower.int8_over_bf16 < 1 < faster.int8_over_bf16
    assert math.isinf(break_even_link(world_size, 0.0, 0.0))
    assert math.isinf(break_even_link(world_size, 0.1, 0.1, bf16_ns=1.0))  # int8's codec cheaper


def test_refusals():
    with pytest.raises(ValueError, match="world_size"):
        project(1e9, 1, 1e9, 1.0, 1.0, overlapped=False)
    with pytest.raises(ValueError, match="positive"):
        project(-1, 2, 1e9, 1.0, 1.0, overlapped=False)
    with pytest.raises(ValueError, match="negative"):
        project(1e9, 2, 1e9, -1.0, 1.0, overlapped=False)
    with pytest.raises(argparse.ArgumentTypeError, match="expected a rate"):
        link_rate("fast")
    assert link_bytes_per_s("2gbit") == 2e9 / 8
