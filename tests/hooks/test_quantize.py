"""compiled_hooks.int8.codec: block-wise int8 round trips within absmax / 254 per element (round to
nearest), on random and adversarial blocks (all zeros, one outlier, inf and nan), blocks that
never span two rows, and a trace without data-dependent control flow."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from compiled_hooks.int8 import ops
from compiled_hooks.int8.codec import (
    QMAX,
    check_block_size,
    dequantize,
    dequantize_packed,
    pack,
    quantize,
    unpack,
)


def round_trip(x, block_size):
    q, scales = quantize(x, block_size)
    return q, scales, dequantize(q, scales, x.shape[1])


def bound(absmax):
    """The round-trip bound: absmax / 254 (round to nearest), plus fp32's rounding of the
    division and the product (a few units in the last place of absmax)."""
    return absmax / (2 * QMAX) + absmax * 2**-22


def block_absmax(x, block_size):
    """Each element's block's absolute maximum, ``x``'s shape."""
    rows, n = x.shape
    padded = torch.nn.functional.pad(x.float().abs(), (0, -n % block_size))
    amax = padded.view(rows, -1, block_size).amax(2, keepdim=True).expand(-1, -1, block_size)
    return amax.reshape(rows, -1)[:, :n]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape, block_size", [((1, 1000), 256), ((4, 300), 64), ((3, 7), 256)])
def test_random_round_trip_within_absmax_over_254(dtype, shape, block_size):
    g = torch.Generator().manual_seed(0)
    # magnitudes spread over six decades, so blocks differ in scale
    x = (torch.randn(shape, generator=g) * 10 ** torch.randint(-3, 3, shape, generator=g)).to(dtype)
    q, scales, back = round_trip(x, block_size)
    blocks = -(-shape[1] // block_size)
    assert q.dtype == torch.int8 and q.shape == (shape[0], blocks, block_size)
    assert scales.dtype == torch.float32 and scales.shape == (shape[0], blocks)
    assert back.dtype == torch.float32 and back.shape == shape
    err = (x.float() - back).abs()
    limit = bound(block_absmax(x, block_size))
    assert (err <= limit).all(), (err / limit).max()
    assert int(q.abs().max()) == QMAX  # each block's largest element uses the full range


def test_round_to_nearest_is_exact_on_the_grid_and_halfway_within_the_bound():
    scale = 0.5
    grid = torch.arange(-QMAX, QMAX + 1, dtype=torch.float32) * scale
    _, _, back = round_trip(grid[None], grid.numel())
    assert torch.equal(back[0], grid)
    # a quarter step off the grid rounds back to it: truncation would not for the negatives
    off = (grid + scale / 4).clamp(max=QMAX * scale)
    _, _, back = round_trip(off[None], off.numel())
    assert torch.equal(back[0], grid)


def test_all_zero_block_is_zero_with_scale_zero():
    x = torch.zeros(2, 10)
    x[1, :5] = 3.0  # the second row's block is not zero
    q, scales, back = round_trip(x, 10)
    assert scales[0].tolist() == [0.0] and torch.equal(q[0], torch.zeros_like(q[0]))
    assert torch.equal(back[0], torch.zeros(10)) and torch.equal(back[1], x[1])


def test_one_outlier_costs_only_its_own_block():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 512, generator=g) * 1e-3
    x[0, 3] = 1e4  # in block 0 of 2
    _, _, back = round_trip(x, 256)
    err = (x - back).abs()
    assert (err[0, :256] <= bound(1e4)).all()
    # block 1 keeps its own, fine scale
    assert (err[0, 256:] <= bound(x[0, 256:].abs().max())).all()
    assert err[0, 256:].max() < 1e-4  # against 40 in the outlier's block


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_inf_and_nan_make_their_block_non_finite_and_leave_the_others(bad):
    x = torch.linspace(-1, 1, 40).view(2, 20)
    x[0, 5] = bad  # row 0, block 0 of [0:10], [10:20]
    _, _, back = round_trip(x, 10)
    assert not torch.isfinite(back[0, :10]).any()  # never finite garbage
    assert torch.isfinite(back[0, 10:]).all() and torch.isfinite(back[1]).all()
    assert ((x[1] - back[1]).abs() <= bound(1.0)).all()


def test_rows_never_share_a_block():
    x = torch.stack([torch.full((5,), 1e-3), torch.full((5,), 1e3)])
    q, scales, back = round_trip(x, 4)  # 5 elements a row: two blocks each, the second padded
    assert q.shape == (2, 2, 4)
    assert torch.allclose(back, x, rtol=1e-6)


def test_traces_without_data_dependent_control_flow():
    x = torch.randn(3, 50)
    gm = make_fx(lambda t: dequantize(*quantize(t, 16), 50))(x)
    y = torch.randn(3, 50) * 100  # other values, the same graph
    assert torch.equal(gm(y), round_trip(y, 16)[2])


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-4, ValueError), (2.0, TypeError)])
def test_block_size_checked(bad, error):
    with pytest.raises(error, match="QuantizedState: block_size"):
        check_block_size("QuantizedState", bad)
    assert check_block_size("QuantizedState", 256) == 256


@pytest.mark.parametrize("rows, n, block_size", [(1, 7, 3), (3, 40, 16), (4, 5, 256)])
def test_pack_round_trip(rows, n, block_size):
    """A row's scales and payload in one int8 row and back, bit for bit (nan and inf scales
    included), whatever the block size does to the alignment."""
    x = torch.randn(rows, n)
    x[0, 0] = float("nan")
    q, scales = quantize(x, block_size)
    packed = pack(q, scales)
    assert packed.dtype == torch.int8 and packed.shape == (rows, scales.shape[1] * (4 + block_size))
    q2, scales2 = unpack(packed, block_size)
    assert torch.equal(q2, q) and torch.equal(scales2.view(torch.int32), scales.view(torch.int32))


@pytest.mark.parametrize("rows, n, block_size", [(1, 5, 256), (2, 7, 3)])
def test_pack_round_trip_compiled(rows, n, block_size):
    """The same through Inductor, where a view to a narrower dtype needs a unit last stride it
    does not promise for a size-1 dimension (one block: torch 2.11 refused it)."""

    def round_trip(x):
        q, scales = quantize(x, block_size)
        return (q, scales), unpack(pack(q, scales), block_size)

    x = torch.randn(rows, n)
    x[0, 0] = float("inf")
    (q, scales), (q2, scales2) = torch.compile(round_trip, fullgraph=True)(x)
    assert torch.equal(q2, q) and torch.equal(scales2.view(torch.int32), scales.view(torch.int32))


@pytest.mark.parametrize("rows, n, block_size", [(1, 7, 3), (2, 600, 256)])
def test_dequantize_packed_op_gives_the_traced_forms_values_on_a_buckets_columns(
    rows, n, block_size
):
    """The op the int8 collectives dequantize with on CPU (ATen's conversion, the scales read
    through an int32 view of their bytes) gives the traceable form's values bit for bit, read
    from a member's columns of a wider bucket (an odd offset, a row stride that is not the
    row's width), non-finite blocks included; its schema and fake pass torch's op check (on
    finite values: it compares with nan unequal)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, n, generator=g) * 10 ** torch.randint(-3, 3, (rows, n), generator=g)
    x[0, 0], x[-1, -1] = float("inf"), float("nan")
    packed = pack(*quantize(x, block_size))
    width = packed.shape[1]
    bucket = torch.zeros(rows, width + 9, dtype=torch.int8)
    bucket[:, 5 : 5 + width] = packed
    columns = bucket[:, 5 : 5 + width]
    got = ops.dequantize_packed(columns, block_size)
    want = dequantize_packed(packed, block_size)
    assert got.shape == (rows, -(-n // block_size), block_size) and got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    finite = bucket.clone()
    finite[:, 5 : 5 + width] = pack(*quantize(x.nan_to_num(0, 1, -1), block_size))
    torch.library.opcheck(ops.dequantize_packed, (finite[:, 5 : 5 + width], block_size))
