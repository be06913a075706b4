"""The fake values ``passes.core.values`` computes without the fake kernel are the kernel's: the
same shape, strides, storage and offset, so Inductor sees the aliasing the op would give."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from passes.core.values import split_values, view_value


def _same(got, want):
    assert isinstance(got, FakeTensor) and got.fake_mode is want.fake_mode
    assert (got.shape, got.stride(), got.storage_offset(), got.dtype, got.device) == (
        want.shape,
        want.stride(),
        want.storage_offset(),
        want.dtype,
        want.device,
    )
    assert got.untyped_storage() is want.untyped_storage() or (
        got.untyped_storage()._cdata == want.untyped_storage()._cdata
    )


@pytest.fixture
def mode():
    return FakeTensorMode()


@pytest.mark.parametrize(
    "shape,to", [((6, 4), [-1]), ((6, 4), [3, 8]), ((24,), [2, 3, 4]), ((2, 3, 4), [6, -1])]
)
def test_view_value_is_the_kernels(mode, shape, to):
    with mode:
        base = torch.empty(100)
        x = base[4 : 4 + torch.Size(shape).numel()].view(shape)  # an offset into a storage
        for op in (torch.ops.aten.view.default, torch.ops.aten.reshape.default):
            _same(view_value(x, to), op(x, to))


def test_view_value_leaves_what_it_cannot_tell_to_the_kernel(mode):
    with mode:
        transposed = torch.empty(4, 6).t()  # reshape would copy
    assert view_value(transposed, [-1]) is None
    assert view_value(torch.empty(4), [-1]) is None  # a real tensor
    assert view_value(torch.empty(4, device="meta"), [-1]) is None  # not fake


def test_split_values_are_the_kernels(mode):
    with mode:
        flat = torch.empty(50)[5:]
        sizes = [10, 1, 34]
        for got, want in zip(
            split_values(flat, sizes), torch.ops.aten.split_with_sizes.default(flat, sizes)
        ):
            _same(got, want)
        assert split_values(flat, [10, 10]) is None  # the sizes do not cover it
        assert split_values(torch.empty(4, 5), [2, 2]) is None  # not 1-D
