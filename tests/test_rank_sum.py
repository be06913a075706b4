"""compiled_hooks.rank_sum: the local sum of a reduce-scatter sent as an all-to-all, its
accumulation order and dtype, the senders' division it takes over, its checks, and that Inductor
calls it rather than compiling a kernel for it."""

from unittest import mock

import pytest
import torch

from compiled_hooks.rank_sum import RANK_SUM, rank_sum


def test_the_blocks_summed_in_rank_order_then_divided():
    received = torch.tensor([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0]])
    assert rank_sum(received, 3, 1).tolist() == [[111.0, 222.0]]
    assert rank_sum(received, 3, 3).tolist() == [[37.0, 74.0]]
    x = torch.randn(4 * 6, 5, dtype=torch.float64)
    blocks = x.view(4, 6, 5)
    expected = ((blocks[0] + blocks[1]) + blocks[2]) + blocks[3]  # rank order, bit for bit
    assert torch.equal(rank_sum(x, 4, 1), expected)
    assert torch.equal(rank_sum(x, 4, 4), expected / 4)
    assert rank_sum(x, 1, 1).data_ptr() != x.data_ptr()  # a new tensor, never a view


def test_narrow_dtypes_add_up_in_fp32():
    # in bf16, 256 + 1 + 1 rounds to 256 step by step; in fp32 it is 258, which bf16 holds
    received = torch.tensor([256.0, 1.0, 1.0], dtype=torch.bfloat16)
    out = rank_sum(received, 3, 1)
    assert out.dtype == torch.bfloat16 and out.tolist() == [258.0]
    expected = (received.float().view(3, 1).sum(0) / 2).to(torch.bfloat16)
    assert torch.equal(rank_sum(received, 3, 2), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_predivisor_gives_what_the_senders_division_gave_bit_for_bit(dtype):
    """Each block divided in the wire dtype before the sum, as a sender's division before the
    all-to-all would have: subnormal quotients and narrow dtypes included."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3 * 64, generator=g, dtype=torch.float64)
    x[::2] *= 4 * torch.finfo(dtype).tiny  # quotients below the normal range lose bits
    x = x.to(dtype)
    for predivisor in (2, 4, 1024):
        sent = x / predivisor  # what a division before the all-to-all sends
        assert torch.equal(rank_sum(x, 3, 1, predivisor), rank_sum(sent, 3, 1))
        assert torch.equal(rank_sum(x, 3, 3, predivisor), rank_sum(sent, 3, 3))


def test_fake_kernel_agrees_with_the_real_one():
    torch.library.opcheck(RANK_SUM, (torch.randn(6, 4), 2, 2))
    torch.library.opcheck(RANK_SUM, (torch.randn(8, dtype=torch.bfloat16), 4, 1))
    torch.library.opcheck(RANK_SUM, (torch.randn(6, 4), 2, 1, 2))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: rank_sum(torch.ones(5, 2), 2, 1), r"\(5, 2\) is not 2 blocks"),
        (lambda: rank_sum(torch.tensor(1.0), 1, 1), r"\(\) is not 1 blocks"),
        (lambda: rank_sum(torch.ones(4), 0, 1), "must be positive"),
        (lambda: rank_sum(torch.ones(4), 2, 0), "must be positive"),
        (lambda: rank_sum(torch.ones(4), 2, 1, 3), "predivisor 3 is not a power of two"),
        (lambda: rank_sum(torch.ones(4), 2, 1, 0), "predivisor 0 is not a power of two"),
    ],
)
def test_bad_input_names_the_problem(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_inductor_calls_the_sum_and_compiles_no_kernel_for_it():
    from torch._inductor.graph import GraphLowering

    received = torch.randn(8, 3)
    generated: list[str] = []
    torch._dynamo.reset()
    with (
        torch._inductor.config.patch(fx_graph_cache=False),  # so the code is generated here
        mock.patch.object(GraphLowering, "save_output_code", generated.append),
    ):
        out = torch.compile(lambda x: RANK_SUM(x, 2, 2), fullgraph=True)(received)
    assert torch.equal(out, (received[:4] + received[4:]) / 2)
    (code,) = generated
    assert "compiled_hooks.rank_sum.default(" in code, code
    assert "async_compile.cpp" not in code, code  # no kernel
