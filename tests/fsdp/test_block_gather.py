"""A traced root under ``passes.install()`` gathers each block's parameters in one all-gather and
reduces their gradients in one hook call (``compiled_hooks.fsdp.block_gather``), with the
gradients a gather and a hook call per parameter give (eager ``data_parallel``), on 2 gloo ranks
with shards of uneven size; and where the packed form would change a value, it is not used."""

import dataclasses

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import compiled_hooks as ch
import passes
from compiled_hooks import compat
from compiled_hooks.fsdp import data_parallel, register_comm_hook
from compiled_hooks.fsdp.accumulation import NOTHING, Accumulate
from compiled_hooks.fsdp.block_gather import fits
from compiled_hooks.fsdp.layout import Layout
from compiled_hooks.fsdp.reduction import Reduction
from passes.testing import partitioned_graphs
from tests.fsdp.test_data_parallel import DIM, VOCAB, Net
from tests.graphs import gather_reduce_counts
from tests.ranks import run_ranks

PACKED = compat.to_local_keeps_none_gradients()
BF16_PARAMS = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
CASES = {  # name: (reshard, mp_policy, bf16 hook, a parameter the forward never reads)
    "fp32": (True, None, False, False),
    "fp32-keep": (False, None, False, False),
    "bf16 params": (True, BF16_PARAMS, False, False),
    "bf16 hook": (True, None, True, False),
    "unused": (True, None, False, True),
}


def _net(unused):
    net = Net()
    if unused:
        for block in net.blocks:
            block.spare = nn.Linear(DIM, 3)  # in the block's bucket, never read
    return net


def worker(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    tokens = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(rank))
    out = {}
    for name, (reshard, mp, bf16_hook, unused) in CASES.items():
        torch._dynamo.reset()
        eager, model = (
            data_parallel(_net(unused), mesh, reshard_after_forward=reshard, mp_policy=mp)
            for _ in range(2)
        )
        if bf16_hook:
            for m in (eager, model):
                register_comm_hook(m, ch.LowPrecisionState(mesh.get_group()), ch.bf16_compress_hook)
        eager(tokens).float().square().mean().backward()
        with passes.install():
            graphs = partitioned_graphs(
                lambda compile, model=model: (
                    compile(model, fullgraph=True)(tokens).float().square().mean().backward()
                )
            )
        diffs = [
            None
            if a.grad is None or b.grad is None
            else (a.grad.to_local() - b.grad.to_local()).abs().max().item()
            for a, b in zip(eager.parameters(), model.parameters())
        ]
        nones = [
            (a.grad is None, b.grad is None) for a, b in zip(eager.parameters(), model.parameters())
        ]
        out[name] = diffs, nones, [gather_reduce_counts(gm) for _, gm in graphs]
    return out


@pytest.mark.slow
def test_a_block_is_one_collective_each_way_with_the_gradients_of_one_per_parameter():
    for rank, out in enumerate(run_ranks(worker, 2, timeout=600)):
        for name, (diffs, nones, counts) in out.items():
            reshard, mp, bf16_hook, unused = CASES[name]
            tol = 2e-2 if mp or bf16_hook else 1e-6
            assert all(a == b for a, b in nones), (name, rank, nones)
            assert sum(a for a, _ in nones) == (4 if unused else 0), (name, rank, nones)
            assert all(d is None or d <= tol for d in diffs), (name, rank, diffs)
            # the root's one parameter (the tied embedding) and each of the 2 blocks: 3 gathers
            # in forward, 3 reduce-scatters in backward, and 3 gathers again when resharding;
            # on torch 2.11 (fits) one gather per parameter, one reduce-scatter per used one
            if PACKED:
                assert counts == [[3, 0], [3 if reshard else 0, 3]], (name, rank, counts)
            else:
                gathers = 1 + 2 * (6 if unused else 4)
                assert counts[0] == [gathers, 0] and counts[1][1] == 9, (name, rank, counts)


def _layout(rows=4, **changes):
    return dataclasses.replace(Layout("w", torch.Size((8, 2)), rows, rows, "blocks.0"), **changes)


def _reduction(**changes):
    base = Reduction(object(), None, None, ch.reduce_scatter_hook, None)  # type: ignore[arg-type]
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize(
    "why,shards,reduction,accumulate,fitting",
    [
        ("two fp32 shards", [torch.zeros(4, 2)] * 2, _reduction(), [NOTHING] * 2, True),
        ("one parameter: nothing to pack", [torch.zeros(4, 2)], _reduction(), [NOTHING], False),
        (
            "gathered in two dtypes",
            [torch.zeros(4, 2), torch.zeros(4, 2, dtype=torch.bfloat16)],
            _reduction(),
            [NOTHING] * 2,
            False,
        ),
        (
            "two dtypes, gathered in param_dtype",
            [torch.zeros(4, 2), torch.zeros(4, 2, dtype=torch.bfloat16)],
            _reduction(param_dtype=torch.bfloat16),
            [NOTHING] * 2,
            True,
        ),
        (
            "int8 gathers",
            [torch.zeros(4, 2)] * 2,
            _reduction(gather_dtype=torch.int8),
            [NOTHING] * 2,
            False,
        ),
        (
            "accumulating (sync off)",
            [torch.zeros(4, 2)] * 2,
            _reduction(),
            [NOTHING, Accumulate(leaf=torch.zeros(8, 2))],
            False,
        ),
        ("replicated", [torch.zeros(4, 2)] * 2, _reduction(shard_group=None), [NOTHING] * 2, False),
    ],
)
def test_fits_only_where_packing_keeps_every_value(
    monkeypatch, why, shards, reduction, accumulate, fitting
):
    layouts = [_layout()] * len(shards)
    monkeypatch.setattr(compat, "to_local_keeps_none_gradients", lambda: True)
    assert fits(shards, layouts, reduction, accumulate) is fitting, why
    # where to_local()'s backward makes a None gradient zeros (torch 2.11), never
    monkeypatch.setattr(compat, "to_local_keeps_none_gradients", lambda: False)
    assert not fits(shards, layouts, reduction, accumulate), why
