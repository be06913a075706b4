"""data_parallel with gradient accumulation and with regional compilation (each decoder layer
compiled on its own, the rest eager), against FSDP2 doing the same."""

import re

import pytest
import torch
from torch.distributed.fsdp import fully_shard

from compiled_hooks.fsdp import data_parallel
from tests.fsdp.llama import (
    LAYERS,
    batches,
    capturing_first,
    llama,
    loss_backward,
    train_side_by_side,
)
from tests.fsdp.test_data_parallel import make_mesh
from tests.ranks import run_ranks


def fsdp2_llama(mesh):
    net = llama()
    for layer in net.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def accumulation_worker(rank, world_size):
    """Two micro-batches per step, 3 steps, compiled: the largest relative parameter difference
    to FSDP2 accumulating the same way."""
    mesh = make_mesh("fully_shard", world_size)
    ref, model = fsdp2_llama(mesh), data_parallel(llama(), mesh)
    run = torch.compile(model, backend="aot_eager", fullgraph=True)
    steps = batches(rank, micro_batches=2)
    return train_side_by_side(ref, model, steps, lambda _, t: loss_backward(run, t))


@pytest.mark.slow
def test_gradient_accumulation_matches_fsdp2():
    for diff in run_ranks(accumulation_worker, 2, timeout=600):
        assert diff <= 1e-4, diff


def regional_worker(rank, world_size):
    import passes

    torch._inductor.config.fx_graph_cache = False
    mesh = make_mesh("fully_shard", world_size)
    ref, model = fsdp2_llama(mesh), data_parallel(llama(), mesh)
    for layer in model.model.layers:
        layer.compile(fullgraph=True)
    codes: list[str] = []
    with passes.install():
        diff = train_side_by_side(ref, model, batches(rank), capturing_first(model, codes))
    a2a = r"_c10d_functional\.all_to_all_single\.default\("
    return diff, sorted(len(re.findall(a2a, code)) for code in codes)


@pytest.mark.slow
def test_regional_compilation_one_all_gather_and_one_reduce_scatter_per_block():
    """Each layer compiled on its own with the passes: within 1e-4 of FSDP2; each layer's
    forward code sends one all-gather (gloo: an all-to-all), its backward code one re-gather
    and one reduce-scatter."""
    for diff, counts in run_ranks(regional_worker, 2, timeout=900):
        assert diff <= 1e-4, diff
        forwards = len(counts) // 2
        assert forwards in (1, LAYERS) and counts == [1] * forwards + [2] * forwards, counts
