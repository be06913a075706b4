"""compiled_hooks.bucket_copies: a bucket's copy-in and copy-out, their layout, their checks, and
that Inductor calls them rather than compiling kernels for them."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from compiled_hooks.bucket_copies import BUCKET_PACK, BUCKET_UNPACK, bucket_pack, bucket_unpack


def test_pack_lays_rows_side_by_side_and_unpack_reverses_a_gather():
    a, b = torch.tensor([0.0, 1.0]), torch.tensor([[10.0, 11.0], [12.0, 13.0]])
    assert bucket_pack([a, b], 1).tolist() == [0, 1, 10, 11, 12, 13]
    assert bucket_pack([a, b], 2).tolist() == [0, 10, 11, 1, 12, 13]  # rank r's rows together
    # an all-gather of 2 ranks' packs of [a_r, b_r] (widths 2 and 4): each piece's ranks in order
    ranks = [(a + 100 * r, b + 100 * r) for r in range(2)]
    gathered = torch.cat([bucket_pack(list(pieces), 1) for pieces in ranks])
    got_a, got_b = bucket_unpack(gathered, 2, [2, 4])
    assert torch.equal(got_a, torch.cat([p[0] for p in ranks]))
    assert torch.equal(got_b, torch.cat([p[1].reshape(-1) for p in ranks]))
    assert got_a.is_contiguous() and got_b.is_contiguous()
    assert got_a.untyped_storage().data_ptr() != gathered.untyped_storage().data_ptr()


def test_unpack_to_shapes_gives_each_piece_its_rows_and_leaves_padding_out():
    # two ranks' shards of a (3, 2) parameter padded to 2 rows each, and of a 1-D one of 4
    w, b = torch.arange(6.0).view(3, 2), torch.arange(10.0, 14.0)
    shards = [(F.pad(w, [0, 0, 0, 1])[2 * r : 2 * r + 2], b[2 * r : 2 * r + 2]) for r in range(2)]
    gathered = torch.cat([bucket_pack(list(pieces), 1) for pieces in shards])
    got_w, got_b = bucket_unpack(gathered, 2, [4, 2], [2, 3, 2, 1, 4])
    assert torch.equal(got_w, w) and torch.equal(got_b, b)
    # the sizes of the shapes only, none of the values, are what a fake call reads
    with FakeTensorMode() as mode:
        fake = bucket_unpack(mode.from_tensor(gathered), 2, [4, 2], [2, 3, 2, 1, 4])
    assert [tuple(t.shape) for t in fake] == [(3, 2), (4,)]


def test_fake_kernels_agree_with_the_real_ones():
    pieces = [torch.randn(4, 3), torch.randn(6)]
    torch.library.opcheck(BUCKET_PACK, (pieces, 2))
    torch.library.opcheck(BUCKET_UNPACK, (torch.randn(2 * 9), 2, [6, 3]))
    torch.library.opcheck(BUCKET_UNPACK, (torch.randn(2 * 9), 2, [6, 3], [2, 5, 2, 1, 6]))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: bucket_pack([], 1), "no pieces"),
        (lambda: bucket_pack([torch.ones(2), torch.ones(2, dtype=torch.bfloat16)], 1), "dtypes"),
        (lambda: bucket_pack([torch.ones(3)], 2), r"shapes \[\(3,\)\] do not split into 2 rows"),
        (lambda: bucket_unpack(torch.ones(10), 2, [2, 2]), "is not 2 rows of widths"),
        (lambda: bucket_unpack(torch.ones(8), 2, [2, 2], [1, 4]), "are not 2 shapes"),
        (lambda: bucket_unpack(torch.ones(8), 2, [2, 2], [1, 4, 1, 5]), r"at most \[4, 4\] values"),
        (lambda: bucket_unpack(torch.ones(8), 2, [2, 2], [1, 4, 3, 1]), "are not 2 shapes"),
        (lambda: bucket_unpack(torch.ones(8), 2, [2, 2], [1, 4, 1, 4, 0]), "are not 2 shapes"),
        (lambda: bucket_unpack(torch.ones(8), 2, [2, 2], [1, 4, -1, 4]), "are not 2 shapes"),
    ],
)
def test_bad_input_names_the_problem(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_inductor_calls_the_copies_and_compiles_no_kernel_for_them():
    from torch._inductor.graph import GraphLowering

    def copies(a, b):
        pieces = BUCKET_UNPACK(BUCKET_PACK([a, b], 1), 1, [a.numel(), b.numel()])
        return pieces[0].view(a.shape), pieces[1].view(b.shape)

    a, b = torch.randn(4, 3), torch.randn(5)
    generated: list[str] = []
    torch._dynamo.reset()
    with (
        torch._inductor.config.patch(fx_graph_cache=False),  # so the code is generated here
        mock.patch.object(GraphLowering, "save_output_code", generated.append),
    ):
        out = torch.compile(copies, fullgraph=True)(a, b)
    assert torch.equal(out[0], a) and torch.equal(out[1], b)
    (code,) = generated
    assert "compiled_hooks.bucket_pack.default(" in code, code
    assert "compiled_hooks.bucket_unpack.default(" in code, code
    assert "async_compile.cpp" not in code, code  # no kernel
