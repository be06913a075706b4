"""compiled_hooks.int8.collectives on gloo ranks: the reduce-scatter within the sum of the ranks'
block bounds of the exact sum, the all-reduce the same on every rank bit for bit and within one
more bound, non-finite values kept non-finite; and one traced graph (fake process group)."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from compiled_hooks.graph_contract import DEQUANTIZE_PACKED
from compiled_hooks.int8.codec import quantize
from compiled_hooks.int8.collectives import (
    ATEN_DEQUANTIZE_MIN_BYTES,
    all_gather_quantized,
    reduce_scatter_quantized,
)
from passes.core.ops import ALL_GATHER, ALL_TO_ALL
from passes.testing import trace
from tests.hooks.test_quantize import block_absmax, bound
from tests.ranks import run_ranks

BLOCK = 16


def int8_reduce_scatter(x, world_size, group, block_size):
    """This rank's shard (fp32, ``x.numel() // world_size`` elements) of the sum over the ranks
    of ``x``, rank-major, through the library's quantized reduce-scatter."""
    rows = x.reshape(world_size, -1)
    q, scales = quantize(rows, block_size)
    return reduce_scatter_quantized(q, scales, rows.shape[1], group)


def int8_all_reduce(x, world_size, group, block_size, post=1.0):
    """The sum over the ranks of ``x`` divided by ``post``, fp32 in ``x``'s shape: the
    reduce-scatter, the shard quantized again and all-gathered (the hook's all-reduce form
    without error feedback). ``x`` of any size: padded to whole shards."""
    n = x.numel()
    shard = math.ceil(n / world_size)
    flat = F.pad(x.reshape(-1), (0, shard * world_size - n))
    mine = int8_reduce_scatter(flat, world_size, group, block_size)
    if post != 1.0:
        mine = mine / post
    q, scales = quantize(mine.unsqueeze(0), block_size)
    return all_gather_quantized(q, scales, shard, group)[:n].view(x.shape)


def local(rank, n, dtype=torch.float32):
    """Rank ``rank``'s tensor: magnitudes over four decades, different on every rank."""
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(n, generator=g) * 10 ** torch.randint(-2, 2, (n,), generator=g)).to(dtype)


def block_bound(x, block_size):
    """Each element's round-trip bound (:func:`tests.hooks.test_quantize.bound` of its block's
    absmax) for a 1-D ``x``."""
    return bound(block_absmax(x[None], block_size))[0]


def row_bound(x, world_size, block_size):
    """:func:`block_bound` of each destination row of ``x`` (the reduce-scatter's blocks)."""
    return torch.cat([block_bound(row, block_size) for row in x.view(world_size, -1)])


def worker(rank, world_size, n, dtype):
    group = dist.group.WORLD
    x = local(rank, n, dtype)
    shard = int8_reduce_scatter(x, world_size, group, BLOCK)
    average = int8_all_reduce(x, world_size, group, BLOCK, post=world_size)
    return shard, average


@pytest.mark.parametrize("world_size, n", [(2, 96), (4, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sums_within_the_block_bounds_and_the_same_on_every_rank(world_size, n, dtype):
    results = run_ranks(worker, world_size, n, dtype)
    xs = [local(r, n, dtype).float() for r in range(world_size)]
    exact = sum(xs)
    padded = [torch.nn.functional.pad(x, (0, -n % world_size)) for x in xs]
    s = padded[0].numel() // world_size
    rs_bound = sum(row_bound(x, world_size, BLOCK) for x in padded)
    for rank, (shard, _) in enumerate(results):
        if n % world_size == 0:
            assert shard.dtype == torch.float32 and shard.shape == (s,)
            err = (shard - exact[rank * s : (rank + 1) * s]).abs()
            assert (err <= rs_bound[rank * s : (rank + 1) * s]).all()
    averages = [average for _, average in results]
    assert all(torch.equal(a, averages[0]) for a in averages)  # bit for bit
    assert averages[0].dtype == torch.float32 and averages[0].shape == (n,)
    # the reduce-scatter's bound, then the second quantization's, of the summed shards
    summed = sum(padded)
    second = torch.cat(
        [block_bound(row, BLOCK) for row in (summed / world_size).view(world_size, -1)]
    )
    limit = (rs_bound / world_size + second * (1 + 2**-20))[:n]
    err = (averages[0] - exact / world_size).abs()
    assert (err <= limit).all(), (err / limit).max()


def nonfinite_worker(rank, world_size, bad):
    x = torch.linspace(-1, 1, 64)
    if rank == 1:
        x[3] = bad
    return int8_all_reduce(x, world_size, dist.group.WORLD, BLOCK)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_stays_non_finite(bad):
    for out in run_ranks(nonfinite_worker, 2, bad):
        assert not torch.isfinite(out[:BLOCK]).any()  # the block that held it, never finite garbage
        assert torch.isfinite(out[BLOCK:]).all()


def test_traces_as_one_all_to_all_and_one_all_gather_of_int8():
    gm = trace(
        lambda x: int8_all_reduce(x, 4, dist.group.WORLD, BLOCK, post=4),
        torch.randn(100),
        world_size=4,
    )
    ops = [n.target for n in gm.graph.nodes if n.target in (ALL_TO_ALL, ALL_GATHER)]
    assert ops == [ALL_TO_ALL, ALL_GATHER]  # payload and scales in one buffer
    collectives = [n for n in gm.graph.nodes if n.target in (ALL_TO_ALL, ALL_GATHER)]
    assert all(n.args[0].meta["val"].dtype == torch.int8 for n in collectives)


@pytest.mark.parametrize("n, by_op", [(100, False), (ATEN_DEQUANTIZE_MIN_BYTES, True)])
def test_received_rows_from_the_threshold_up_are_dequantized_by_the_op_on_cpu(n, by_op):
    """On CPU received int8 rows of at least ``ATEN_DEQUANTIZE_MIN_BYTES`` go to the ATen op
    (both the all-to-all's and the all-gather's, ``n`` values of them in all); smaller ones are
    dequantized in the traced graph, where the op's fixed cost per call is more than it
    saves."""
    gm = trace(
        lambda x: int8_all_reduce(x, 2, dist.group.WORLD, 256),
        torch.randn(n),
        world_size=2,
    )
    ops = [n for n in gm.graph.nodes if n.target is DEQUANTIZE_PACKED]
    assert len(ops) == (2 if by_op else 0)
