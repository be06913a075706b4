"""Gradient accumulation with ``set_requires_gradient_sync(False)`` / ``no_sync()``: the
unsharded gradients accumulate locally and the synced backward reduces their sum once, against
FSDP2 accumulating the same way (fp32, 3 steps of 3 micro-batches)."""

import re
from unittest import mock

import pytest
import torch
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from compiled_hooks.fsdp import data_parallel
from tests.fsdp.llama import LAYERS, batches, llama
from tests.fsdp.test_data_parallel import make_mesh, rel
from tests.ranks import run_ranks

MICRO_BATCHES = 3


def fsdp2_llama(mesh):
    net = llama()
    for layer in net.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(net, mesh=mesh)


class CountReductions(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.reduce_scatter_tensor.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def accumulate(ref, model, rank, backward, context_manager=False):
    """3 SGD steps of ``MICRO_BATCHES`` micro-batches, synced on the last: ``backward(step,
    micro_batch, tokens)`` runs ``model``'s. Returns the largest relative parameter difference
    to ``ref`` and, per micro-batch, whether ``model``'s shard gradients were still empty (None,
    or zero) and the bytes it held accumulated."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
    seen = []
    for step, micro_batches in enumerate(batches(rank, steps=3, micro_batches=MICRO_BATCHES)):
        for i, tokens in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            ref.set_requires_gradient_sync(last)
            ref(tokens).square().mean().backward()
            if context_manager and not last:
                with model.no_sync():
                    backward(step, i, tokens)
            else:
                model.set_requires_gradient_sync(last)
                backward(step, i, tokens)
            # torch 2.11's DTensor gives a shard a zero gradient where the gather gives it none
            no_grads = all(
                p.grad is None or not p.grad.to_local().any() for p in model.parameters()
            )
            seen.append((no_grads, model.accumulated_gradient_bytes()))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    diff = max(
        rel(b.full_tensor(), a.full_tensor()) for a, b in zip(ref.parameters(), model.parameters())
    )
    return diff, seen


def eager_worker(rank, world_size, context_manager):
    mesh = make_mesh("fully_shard", world_size)
    ref, model = fsdp2_llama(mesh), data_parallel(llama(), mesh)
    counts = []

    def backward(step, i, tokens):
        with CountReductions() as counter:
            model(tokens).square().mean().backward()
        counts.append(counter.count)

    diff, seen = accumulate(ref, model, rank, backward, context_manager)
    unsharded = sum(4 * p.numel() for p in model.parameters())  # fp32, the full shapes
    return diff, seen, counts, unsharded, len(list(model.parameters()))


@pytest.mark.parametrize("context_manager", [False, True], ids=["switch", "no_sync"])
def test_eager_accumulation_matches_fsdp2_and_reduces_once(context_manager):
    """Eager: the no-sync backwards leave the shard gradients empty and reduce nothing, holding
    every unsharded gradient; the synced one reduces each parameter once and holds nothing."""
    for diff, seen, counts, unsharded, params in run_ranks(eager_worker, 2, context_manager):
        assert diff <= 1e-5, diff
        no_sync = [(True, unsharded), (True, unsharded), (False, 0)]
        assert seen == no_sync * 3, seen
        assert counts == [0, 0, params] * 3, counts


def compiled_worker(rank, world_size):
    from torch._inductor.graph import GraphLowering

    import passes

    torch._inductor.config.fx_graph_cache = False
    mesh = make_mesh("fully_shard", world_size)
    ref, model = fsdp2_llama(mesh), data_parallel(llama(), mesh)
    run = torch.compile(model, fullgraph=True)
    generated: list[str] = []  # the code of every graph Inductor compiles
    codes: list[list[str]] = []  # per micro-batch, the code compiled in it

    def backward(step, i, tokens):
        before = len(generated)
        run(tokens).square().mean().backward()
        codes.append(generated[before:])

    # reduce-scatters left as such (not gloo's all-to-alls), to count them
    with (
        mock.patch.object(GraphLowering, "save_output_code", generated.append),
        passes.install(options={"reduce_scatter_backends": ()}),
    ):
        diff, _ = accumulate(ref, model, rank, backward)
    rs = r"_c10d_functional\.reduce_scatter_tensor\.default\("
    return diff, [[len(re.findall(rs, code)) for code in step] for step in codes]


@pytest.mark.slow
def test_compiled_accumulation_matches_fsdp2_one_reduce_scatter_per_block():
    """Whole model compiled with the passes: within 1e-5 of FSDP2. The first no-sync micro-batch
    compiles a forward and a backward that send no reduce-scatter, the first synced one a pair
    whose backward sends one per block (the layers and the root); nothing compiles after."""
    for diff, counts in run_ranks(compiled_worker, 2, timeout=900):
        assert diff <= 1e-5, diff
        assert counts == [[0, 0], [], [0, LAYERS + 1]] + [[]] * 6, counts


def modes_worker(rank, world_size, mode):
    """Compiled (aot_eager) against eager ``data_parallel``, both accumulating."""
    mesh = make_mesh(mode, world_size)
    ref, model = data_parallel(llama(), mesh, mode=mode), data_parallel(llama(), mesh, mode=mode)
    run = torch.compile(model, backend="aot_eager", fullgraph=True)

    def backward(step, i, tokens):
        run(tokens).square().mean().backward()

    return accumulate(ref, model, rank, backward)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["replicate", "hybrid_shard"])
def test_compiled_accumulation_in_the_other_modes_matches_eager(mode):
    """``replicate`` (2 ranks) and ``hybrid_shard`` (2 x 2) accumulate compiled as eager does."""
    for diff, seen in run_ranks(modes_worker, 4 if mode == "hybrid_shard" else 2, mode):
        assert diff <= 1e-5, diff
        assert [held > 0 for _, held in seen] == [True, True, False] * 3, seen
