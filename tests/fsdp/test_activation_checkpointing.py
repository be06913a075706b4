"""data_parallel with activation checkpointing, against FSDP2 with the same checkpointing, on a
tiny Llama in HuggingFace's layout (:mod:`tests.fsdp.llama`): full checkpointing
(``checkpoint_wrapper``), torchtitan's op-list selective checkpointing, reentrant
checkpointing, ``torch.utils.checkpoint`` inside a layer's forward, and HuggingFace's
checkpointed layers; fully_shard and hybrid_shard, reshard_after_forward True and False,
eager and compiled.

What a recompute does with the parameters is pinned by counting collectives: eager, in the
ops a step dispatches; compiled, in the partitioned graphs after the block passes and in
Inductor's generated code."""

import re

import pytest
import torch
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from compiled_hooks.fsdp import data_parallel
from passes import bucket_block_all_gathers, bucket_block_reduce_scatters
from passes.testing import fake_process_group, gathered_bytes_alive
from tests.fsdp.llama import (
    LAYERS,
    VOCAB,
    batches,
    capturing_first,
    llama,
    loss_backward,
    train_side_by_side,
)
from tests.fsdp.test_data_parallel import make_mesh
from tests.graphs import data_parallel_graphs, gather_reduce_counts
from tests.ranks import run_ranks

KINDS = ["full", "sac", "reentrant", "inner", "hf"]
PARAMS_PER_LAYER = 9  # q, k, v, o, gate, up, down and the two norms
ROOT_PARAMS = 3  # embedding, final norm, output layer
GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default


class Collectives(TorchDispatchMode):
    """Counts the all-gathers and reduce-scatters dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.gathers = self.reduce_scatters = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.gathers += func is GATHER
        self.reduce_scatters += func is REDUCE_SCATTER
        return func(*args, **(kwargs or {}))


def fsdp2_llama(ac, mesh, reshard):
    net = llama(ac)
    for layer in net.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    return fully_shard(net, mesh=mesh, reshard_after_forward=reshard)


def ac_worker(rank, world_size, mode, compiled, kinds):
    """For each checkpointing kind and reshard mode: the largest relative parameter difference
    to FSDP2 after 3 fp32 SGD steps, and (eager) the collectives of the first step."""
    mesh = make_mesh(mode, world_size)
    out = {}
    for ac in kinds:
        for reshard in (True, False):
            torch._dynamo.reset()
            ref = fsdp2_llama(ac, mesh, reshard)
            model = data_parallel(llama(ac), mesh, mode=mode, reshard_after_forward=reshard)
            run = torch.compile(model, backend=compiled, fullgraph=True) if compiled else model
            counts = []

            def backward(step, tokens, run=run, counts=counts):
                # the first eager step counted (compiled, a dispatch mode would keep Dynamo out)
                if compiled or step:
                    return loss_backward(run, tokens)
                fw, bw = Collectives(), Collectives()
                with fw:
                    loss = run(tokens).square().mean()
                with bw:
                    loss.backward()
                counts.append([fw.gathers, bw.gathers, bw.reduce_scatters])

            diff = train_side_by_side(ref, model, batches(rank), backward)
            out[ac, reshard] = diff, counts
    return out


# Compiled hybrid_shard: the kinds whose checkpoint region differs in the traced graph (the
# in-forward and reentrant forms trace as full checkpointing does; 2-rank runs cover them).
RUNS = [
    pytest.param(2, "fully_shard", None, KINDS, id="2-fully_shard-eager"),
    pytest.param(2, "fully_shard", "aot_eager", KINDS, id="2-fully_shard-compiled"),
    pytest.param(4, "hybrid_shard", None, KINDS, id="4-hybrid_shard-eager"),
    pytest.param(4, "hybrid_shard", "aot_eager", ["full", "sac"], id="4-hybrid_shard-compiled"),
]


@pytest.mark.slow
@pytest.mark.parametrize("world_size,mode,compiled,kinds", RUNS)
def test_matches_fsdp2_with_the_same_checkpointing(world_size, mode, compiled, kinds):
    """Every checkpointing kind, reshard True and False: parameters within 1e-4 of FSDP2's
    after 3 steps. Eager, each parameter is gathered once in forward; in backward the
    recompute gathers each of a layer's parameters again when resharding (the reentrant
    forward, which runs without autograd, keeps nothing) and none when keeping, and each
    gradient is reduced once."""
    results = run_ranks(ac_worker, world_size, mode, compiled, kinds, timeout=900)
    params = ROOT_PARAMS + LAYERS * PARAMS_PER_LAYER
    for rank, out in enumerate(results):
        for (ac, reshard), (diff, counts) in out.items():
            assert diff <= 1e-4, (rank, ac, reshard, diff)
            if compiled:
                continue  # the compiled graphs are counted below
            regathers = LAYERS * PARAMS_PER_LAYER if reshard or ac == "reentrant" else 0
            assert counts == [[params, regathers, params]], (rank, ac, reshard, counts)


@pytest.mark.slow
@pytest.mark.parametrize("ac", KINDS)
def test_compiled_recompute_gathers_per_block_only_when_resharding(ac):
    """The partitioned graphs (4 fake ranks) after the block passes: one all-gather per block
    in forward; in backward one re-gather per block when resharding and none when keeping,
    and one reduce-scatter per block. A resharding step holds the root's and at most two
    blocks' gathered parameters at a time."""
    fake_process_group(4)
    blocks = 1 + LAYERS  # the root (embedding, final norm, output layer) and each layer
    gathered = {}  # block -> bytes of its gathered (padded) parameters
    for name, p in llama().named_parameters():
        block = "root" if ".layers." not in f".{name}" else name.split(".")[2]
        gathered[block] = gathered.get(block, 0) + -(-p.shape[0] // 4) * 4 * p[0].numel() * 4
    bound = gathered["root"] + 2 * max(v for k, v in gathered.items() if k != "root")
    for reshard in (True, False):
        torch._dynamo.reset()
        model = data_parallel(llama(ac), make_mesh("fully_shard", 4), reshard_after_forward=reshard)
        counts = {}
        for kind, gm in data_parallel_graphs(model, torch.randint(0, VOCAB, (2, 8))):
            bucket_block_all_gathers(gm.graph)
            bucket_block_reduce_scatters(gm.graph)
            counts[kind] = gather_reduce_counts(gm)
            if reshard:  # the root, the block computing and the one in flight
                assert max(gathered_bytes_alive(gm.graph)) <= bound, kind
        assert counts == {"forward": [blocks, 0], "backward": [blocks if reshard else 0, blocks]}


@pytest.mark.slow
def test_hybrid_shard_recompute_gathers_per_block_after_the_passes():
    """hybrid_shard on a 2 x 2 (replicate, shard) fake mesh with full checkpointing: after the
    block passes one all-gather per block in forward, and in backward one re-gather per block
    when resharding, none when keeping, and one reduce-scatter per block."""
    fake_process_group(4)
    blocks = 1 + LAYERS
    for reshard in (True, False):
        torch._dynamo.reset()
        mesh = make_mesh("hybrid_shard", 4)
        model = data_parallel(
            llama("full"), mesh, mode="hybrid_shard", reshard_after_forward=reshard
        )
        counts = {}
        for kind, gm in data_parallel_graphs(model, torch.randint(0, VOCAB, (2, 8))):
            bucket_block_all_gathers(gm.graph)
            bucket_block_reduce_scatters(gm.graph)
            counts[kind] = gather_reduce_counts(gm)
        assert counts == {"forward": [blocks, 0], "backward": [blocks if reshard else 0, blocks]}


def inductor_worker(rank, world_size, ac, reshard):
    import passes

    torch._inductor.config.fx_graph_cache = False
    mesh = make_mesh("fully_shard", world_size)
    ref = fsdp2_llama(ac, mesh, reshard)
    model = data_parallel(llama(ac), mesh, reshard_after_forward=reshard)
    run = torch.compile(model, fullgraph=True)
    codes: list[str] = []
    with passes.install():
        diff = train_side_by_side(ref, model, batches(rank), capturing_first(run, codes))
    # gloo: the block passes' all-gathers and reduce-scatters go out as all-to-alls
    return diff, [
        len(re.findall(r"_c10d_functional\.all_to_all_single\.default\(", c)) for c in codes
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "ac,reshard", [("full", True), ("sac", False)], ids=["full-reshard", "sac-keep"]
)
def test_inductor_with_passes(ac, reshard):
    """Inductor with the passes: within 1e-4 of FSDP2 with the same checkpointing; the forward
    sends one all-gather per block, the backward one re-gather per block when resharding and
    one reduce-scatter per block."""
    blocks = 1 + LAYERS
    for diff, (forward, backward) in run_ranks(inductor_worker, 2, ac, reshard, timeout=900):
        assert diff <= 1e-4, diff
        assert [forward, backward] == [blocks, blocks * (2 if reshard else 1)]


@pytest.mark.slow
def test_compiled_full_checkpointing_around_sdpa(monkeypatch):
    """Full checkpointing around ``scaled_dot_product_attention``, compiled (4 fake ranks): the
    step runs and the recompute gathers each block again. (torch 2.13's partitioner misorders
    the saved values where a DeviceMesh is saved beside a recomputed random op, 'expected all
    tensors_saved_with_vc_check to be Tensors': the graph reads no DTensor, so it saves none.)"""
    import benchmarks.common.llama

    monkeypatch.setattr(benchmarks.common.llama, "ATTENTION", "sdpa")
    fake_process_group(4)
    model = data_parallel(llama("full"), make_mesh("fully_shard", 4))
    graphs = data_parallel_graphs(model, torch.randint(0, VOCAB, (2, 8)))
    counts = [gather_reduce_counts(gm) for _, gm in graphs]
    assert counts[1][0] == LAYERS * PARAMS_PER_LAYER + 2  # all but the embedding, gathered again
