"""compiled_hooks.fsdp.data_parallel (compile-native FSDP) against FSDP2 on gloo ranks: every
mode, reshard_after_forward True and False, fp32 and bf16 parameters, eager and compiled, a
model with tied embeddings and shards of uneven size; the comm hooks and their registration
rules; checkpoints; the grad scaler."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import compiled_hooks as ch
from compiled_hooks.fsdp import ALREADY, ROOT_ONLY, data_parallel, get_comm_hook, register_comm_hook
from compiled_hooks.int8.codec import BLOCK_SIZE as INT8_BLOCK_SIZE
from compiled_hooks.int8.codec import dequantize, quantize
from passes.testing import fake_process_group, gathered_bytes_alive
from tests.fsdp.test_fsdp import _raises
from tests.graphs import data_parallel_graphs
from tests.ranks import run_ranks

VOCAB, DIM, HIDDEN = 10, 8, 13  # rows 10 and 13: shards of uneven size on 2 and 4 ranks
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    """Embedding, two blocks, and an output layer tied to the embedding."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_mesh(mode, world_size):
    if mode == "hybrid_shard":
        return init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world_size,))


def fsdp2(mesh, mode, reshard, mp, net=None):
    """The same model (or ``net``) under FSDP2: each block, then the root (which holds the tied
    weight)."""
    net, mp = net or Net(), mp or MixedPrecisionPolicy()
    wrap = (
        (lambda m: replicate(m, mesh=mesh, mp_policy=mp))
        if mode == "replicate"
        else (lambda m: fully_shard(m, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp))
    )
    for block in net.blocks:
        wrap(block)
    return wrap(net)


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def train_both(rank, ref, model, run, steps=5):
    """AdamW steps on both; the largest relative gradient and parameter differences."""
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1 + rank)
    grad_diff = 0.0
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (4, 6), generator=g)
        ref(tokens).float().square().mean().backward()
        run(tokens).float().square().mean().backward()
        for a, b in zip(ref.parameters(), model.parameters()):
            grad_diff = max(grad_diff, rel(b.grad.full_tensor(), a.grad.full_tensor()))
        for opt_ in (opt_ref, opt):
            opt_.step()
            opt_.zero_grad()
    param_diff = max(
        rel(b.full_tensor(), a.full_tensor()) for a, b in zip(ref.parameters(), model.parameters())
    )
    return grad_diff, param_diff


def numerics_worker(rank, world_size, mode, configs, compiled):
    mesh = make_mesh(mode, world_size)
    out = {}
    for reshard, mp in configs:
        torch._dynamo.reset()
        ref, model = (
            fsdp2(mesh, mode, reshard, mp),
            data_parallel(Net(), mesh, mode=mode, reshard_after_forward=reshard, mp_policy=mp),
        )
        assert len(list(model.parameters())) == len(list(ref.parameters())) == 9  # the tie is kept
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        key = (reshard, None if mp is None else mp.param_dtype)
        out[key] = train_both(rank, ref, model, run) + (
            [p.to_local().clone() for p in model.parameters()],
        )
    return out


TOLERANCE = {None: 1e-6, torch.bfloat16: 1e-2}
BOTH = [(True, None), (False, None), (True, BF16), (False, BF16)]
RUNS = [
    pytest.param(2, "fully_shard", [(True, None), (False, BF16)], False, id="2-fully_shard-eager"),
    pytest.param(
        2,
        "fully_shard",
        [(False, None), (True, BF16)],
        False,
        id="2-fully_shard-eager-b",
        marks=pytest.mark.slow,
    ),
    pytest.param(2, "replicate", [(True, None), (True, BF16)], False, id="2-replicate-eager"),
    pytest.param(
        2, "fully_shard", [(True, None), (False, BF16)], True, id="2-fully_shard-compiled"
    ),
    pytest.param(
        2,
        "fully_shard",
        [(False, None), (True, BF16)],
        True,
        id="2-fully_shard-compiled-b",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        2,
        "replicate",
        [(True, None), (True, BF16)],
        True,
        id="2-replicate-compiled",
        marks=pytest.mark.slow,
    ),
    pytest.param(4, "fully_shard", BOTH, False, id="4-fully_shard-eager", marks=pytest.mark.slow),
    pytest.param(4, "hybrid_shard", BOTH, False, id="4-hybrid_shard-eager", marks=pytest.mark.slow),
    pytest.param(
        4,
        "hybrid_shard",
        [(True, None), (False, BF16)],
        True,
        id="4-hybrid_shard-compiled",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize("world_size,mode,configs,compiled", RUNS)
def test_matches_fsdp2(world_size, mode, configs, compiled):
    results = run_ranks(numerics_worker, world_size, mode, configs, compiled, timeout=600)
    for key in results[0]:
        tol = TOLERANCE[key[1]]
        for rank, res in enumerate(results):
            grad_diff, param_diff, _ = res[key]
            assert grad_diff <= tol and param_diff <= tol, (key, rank, grad_diff, param_diff)
        # the ranks holding the same shard coordinate hold the same values, bit for bit
        shard = 1 if mode == "replicate" else world_size // (2 if mode == "hybrid_shard" else 1)
        for rank in range(shard, world_size):
            twin = results[rank % shard][key][2]
            assert all(torch.equal(a, b) for a, b in zip(results[rank][key][2], twin)), (key, rank)


# --- comm hooks -------------------------------------------------------------------------------


def hooks_worker(rank, world_size, mode):
    mesh = make_mesh(mode, world_size)
    shard_group = mesh.get_group(mesh.ndim - 1)
    replicated = mode == "replicate"
    out = {}
    # the bf16 hook against FSDP2's reduce_dtype=bf16
    ref = fsdp2(mesh, mode, True, MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))
    model = data_parallel(Net(), mesh, mode=mode)
    state = ch.LowPrecisionState(shard_group)
    register_comm_hook(model, state, ch.bf16_compress_hook)
    out["registered"] = (
        get_comm_hook(model) == (ch.bf16_compress_hook, state) == get_comm_hook(model.blocks[0])
    )
    out["bf16"] = train_both(rank, ref, model, model)
    # int8 with error feedback, residuals kept per parameter name, against FSDP2 in fp32
    ref = fsdp2(mesh, mode, True, None)
    model = data_parallel(Net(), mesh, mode=mode)
    quantized = ch.QuantizedState(shard_group, block_size=32)
    register_comm_hook(model, quantized, ch.int8_compress_hook)
    out["int8"] = train_both(rank, ref, model, model, steps=1)
    out["int8 keys"] = sorted({key for key, _ in quantized._errors}) == sorted(
        n for n, _ in model.named_parameters()
    )
    # a hook that sums instead of averaging is visible in the gradients
    ref = fsdp2(mesh, mode, True, None)
    model = data_parallel(Net(), mesh, mode=mode)

    def summing_hook(state, grad, output=None):
        ch.allreduce_hook(state, grad) if output is None else ch.reduce_scatter_hook(
            state, grad, output
        )
        (grad if output is None else output).mul_(state.world_size)

    register_comm_hook(model, ch.DefaultState(shard_group), summing_hook)
    out["sum"] = train_both(rank, ref, model, model, steps=1)[0]
    # registration rules
    model = data_parallel(Net(), mesh, mode=mode)
    plain = ch.allreduce_hook if replicated else ch.reduce_scatter_hook
    out["non-root"] = _raises(
        lambda: register_comm_hook(model.blocks[0], ch.DefaultState(shard_group), plain)
    )
    register_comm_hook(model, ch.DefaultState(shard_group), plain)
    out["twice"] = _raises(lambda: register_comm_hook(model, ch.DefaultState(shard_group), plain))
    model = data_parallel(Net(), mesh, mode=mode)
    model(torch.zeros(1, 1, dtype=torch.long))
    out["after forward"] = _raises(
        lambda: register_comm_hook(model, ch.DefaultState(shard_group), plain)
    )
    model = data_parallel(
        Net(), mesh, mode=mode, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    )
    out["hook and reduce_dtype"] = _raises(
        lambda: register_comm_hook(model, ch.LowPrecisionState(shard_group), ch.bf16_compress_hook)
    )
    model = data_parallel(Net(), mesh, mode=mode)
    out["wrong group"] = _raises(
        lambda: register_comm_hook(model, ch.DefaultState(dist.new_group([rank])), plain)
    )
    return out


HOOK_RUNS = [
    pytest.param(2, "fully_shard", id="2-fully_shard"),
    pytest.param(2, "replicate", id="2-replicate"),
    pytest.param(4, "hybrid_shard", id="4-hybrid_shard", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("world_size,mode", HOOK_RUNS)
def test_comm_hooks(world_size, mode):
    for rank, out in enumerate(run_ranks(hooks_worker, world_size, mode, timeout=300)):
        assert out["registered"]
        assert max(out["bf16"]) <= 2e-2, (rank, out["bf16"])
        # one step: the gradients within int8's rounding of FSDP2's
        assert out["int8"][0] <= 2e-2 and out["int8 keys"], (rank, out["int8"])
        assert out["sum"] > 0.5, (rank, out["sum"])  # a hook that does not average is caught
        assert out["non-root"] == (AssertionError, ROOT_ONLY)
        assert out["twice"] == (AssertionError, ALREADY)
        assert (
            out["after forward"][0] is RuntimeError
            and "before the first forward" in out["after forward"][1]
        )
        assert (
            out["hook and reduce_dtype"][0] is ValueError
            and "leave reduce_dtype unset" in out["hook and reduce_dtype"][1]
        )
        assert (
            out["wrong group"][0] is ValueError
            and "the state's group has 1 ranks" in out["wrong group"][1]
        )


# --- int8 weight gathers ----------------------------------------------------------------------


def int8_gathered(world_size):
    """``Net()`` with the weights an int8 gather gives: each padded shard quantized as one row."""
    net = Net()
    with torch.no_grad():
        for p in net.parameters():
            rows = p.reshape(p.shape[0], -1)
            padded = torch.nn.functional.pad(rows, (0, 0, 0, -rows.shape[0] % world_size))
            shards = [s.reshape(1, -1) for s in padded.chunk(world_size)]
            values = [dequantize(*quantize(s, INT8_BLOCK_SIZE), s.numel()) for s in shards]
            p.copy_(torch.cat(values).reshape(-1, *p.shape[1:])[: p.shape[0]])
    return net


def int8_gathers_worker(rank, world_size, compiled):
    mesh = make_mesh("fully_shard", world_size)
    out = {}
    for reshard, mp in [(True, None), (False, None), (True, BF16), (False, BF16)]:
        torch._dynamo.reset()
        ref = fsdp2(mesh, "fully_shard", reshard, mp, int8_gathered(world_size))
        model = data_parallel(
            Net(), mesh, reshard_after_forward=reshard, mp_policy=mp, gather_dtype=torch.int8
        )
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        out[reshard, mp is None] = train_both(rank, ref, model, run, steps=1)[0]
    # what a block's forward reads: the gathered weight
    model = data_parallel(Net(), mesh, gather_dtype=torch.int8)
    seen = []
    model.blocks[0].register_forward_hook(lambda m, args, y: seen.append(m.up.weight.detach()))
    model(torch.zeros(1, 1, dtype=torch.long))
    out["seen"] = (seen[0], model.blocks[0].up.weight.full_tensor())
    return out


@pytest.mark.parametrize(
    "compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"]
)
def test_int8_gathers(compiled):
    """gather_dtype=torch.int8, fp32 and bf16 parameters, reshard and keep: one step's gradients
    are FSDP2's at the weights the int8 gather gives (the gradient reaches the shard as is);
    every rank reads the same gathered weight, bit for bit, each shard's values within
    ``absmax / 254`` of the shard's."""
    ranks = run_ranks(int8_gathers_worker, 2, compiled, timeout=600)
    for rank, out in enumerate(ranks):
        for reshard in (True, False):
            assert out[reshard, True] <= 1e-6, (rank, reshard, out[reshard, True])
            assert out[reshard, False] <= 1e-2, (rank, reshard, out[reshard, False])
    (seen, weight), (seen1, _) = ranks[0]["seen"], ranks[1]["seen"]
    assert torch.equal(seen, seen1)
    for got, want in zip(seen.chunk(2), weight.chunk(2)):  # one block per shard here
        bound = want.abs().max() / 254 * (1 + 1e-5)
        assert 0 < (got - want).abs().max() <= bound, ((got - want).abs().max(), bound)


# --- checkpoint and grad scaler ---------------------------------------------------------------


def checkpoint_worker(rank, world_size, path):
    mesh = make_mesh("fully_shard", world_size)
    g = torch.Generator().manual_seed(1 + rank)
    batches = [torch.randint(0, VOCAB, (4, 6), generator=g) for _ in range(6)]

    def run(model, opt, tokens):
        model(tokens).square().mean().backward()
        opt.step()
        opt.zero_grad()

    def fresh():
        model = data_parallel(Net(), mesh, mp_policy=BF16)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = fresh()
    for tokens in batches[:3]:
        run(model, opt, tokens)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
    for tokens in batches[3:]:
        run(model, opt, tokens)
    resumed, ropt = fresh()
    run(resumed, ropt, batches[0])  # creates the optimizer state that the load overwrites
    state = {"model": resumed.state_dict(), "optim": ropt.state_dict()}
    dcp.load(state, checkpoint_id=path)
    resumed.load_state_dict(state["model"])
    ropt.load_state_dict(state["optim"])
    for tokens in batches[3:]:
        run(resumed, ropt, tokens)
    return all(
        torch.equal(a.to_local(), b.to_local())
        for a, b in zip(model.parameters(), resumed.parameters())
    )


def test_checkpoint_resume_is_bitwise():
    with tempfile.TemporaryDirectory() as path:
        assert run_ranks(checkpoint_worker, 2, os.path.join(path, "ckpt")) == [True, True]


def scaler_worker(rank, world_size):
    mesh = make_mesh("fully_shard", world_size)
    model = data_parallel(Net(), mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = ch.ShardedGradScaler(device="cpu", init_scale=2.0**10)
    tokens = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(rank))
    out = []
    for step in range(2):
        before = [p.to_local().clone() for p in model.parameters()]
        scaler.scale(model(tokens).float().square().mean()).backward()
        if step == 0 and rank == 1:
            next(model.parameters()).grad.to_local()[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        moved = any(not torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))
        out.append((moved, scaler.get_scale()))
    return out


def test_grad_scaler_skips_on_every_rank():
    for out in run_ranks(scaler_worker, 2):
        assert out == [(False, 2.0**9), (True, 2.0**9)]


# --- the compiled graphs (fake process group of 4 ranks, one process) -------------------------

GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default


def _ops(gm, op):
    return [n for n in gm.graph.nodes if n.target is op]


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_one_graph_and_what_the_backward_keeps(reshard):
    fake_process_group(4)
    model = data_parallel(
        Net(), init_device_mesh("cpu", (4,)), reshard_after_forward=reshard, mp_policy=BF16
    )
    graphs = data_parallel_graphs(model, torch.randint(0, VOCAB, (4, 6)))
    assert [kind for kind, _ in graphs] == ["forward", "backward"]  # no graph break
    (_, fw), (_, bw) = graphs
    params = 9  # the tied embedding / output weight is one parameter: gathered once, reduced once
    assert len(_ops(fw, GATHER)) == params and len(_ops(bw, REDUCE_SCATTER)) == params
    # cast, then gather
    assert all(n.args[0].meta["val"].dtype == torch.bfloat16 for n in _ops(fw, GATHER))
    fw_alive, bw_alive = gathered_bytes_alive(fw.graph), gathered_bytes_alive(bw.graph)
    padded = {
        name: -(-rows // 4) * 4 * cols * 2
        for name, rows, cols in [
            ("emb", VOCAB, DIM),
            ("up.weight", HIDDEN, DIM),
            ("up.bias", HIDDEN, 1),
            ("down.weight", DIM, HIDDEN),
            ("down.bias", DIM, 1),
        ]
    }
    root, block = padded["emb"], sum(v for k, v in padded.items() if k != "emb")
    if reshard:
        assert fw_alive[-1] == 0  # no gathered parameter is saved for backward ...
        assert len(_ops(bw, GATHER)) > 0  # ... the backward gathers again
        assert max(fw_alive) <= root + 2 * block and max(bw_alive) <= root + 2 * block
    else:
        assert len(_ops(bw, GATHER)) == 0
        # the matmuls' weights
        assert fw_alive[-1] >= root + 2 * (padded["up.weight"] + padded["down.weight"])


def test_identical_blocks_compiled_on_their_own_share_one_graph():
    """Regional compilation (each layer ``.compile()``d, the root eager): Dynamo traces the
    first layer and serves its graph to the other three, whose gathers read no name of theirs.
    (On the fake process group the values are not communicated: the numerics of regional
    compilation are ``test_composition.py``'s, on gloo ranks.)"""
    from torch._dynamo.utils import counters

    from benchmarks.common.llama import Config, LlamaForCausalLM

    fake_process_group(4)
    config = Config(layers=4)
    model = data_parallel(LlamaForCausalLM(config), init_device_mesh("cpu", (4,)))
    for layer in model.model.layers:
        layer.compile(backend="aot_eager", fullgraph=True)
    counters.clear()
    model(torch.randint(0, config.vocab, (2, 8))).square().mean().backward()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["recompiles"], dict(counters["recompiles"])


# --- Inductor with the passes: one collective per block, in the generated code ---------------


def inductor_worker(rank, world_size, mode, reshard):
    import re

    from torch._inductor.utils import run_and_get_code

    import passes

    torch._inductor.config.fx_graph_cache = False
    mesh = make_mesh(mode, world_size)
    ref = fsdp2(mesh, mode, reshard, None)
    model = data_parallel(Net(), mesh, mode=mode, reshard_after_forward=reshard)
    run = torch.compile(model, fullgraph=True)
    tokens = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(rank))
    with passes.install():
        _, codes = run_and_get_code(lambda: run(tokens).float().square().mean().backward())
        model.zero_grad()
        diffs = train_both(rank, ref, model, run)
    forward, backward = codes

    def count(op, code):
        return len(re.findall(rf"_c10d_functional\.{op}\.default\(", code))

    # gloo: all-gathers and reduce-scatters go out as all_to_all_single (all_gather_as_all_to_all,
    # reduce_scatter_as_all_to_all)
    return diffs, [
        count("all_to_all_single", forward),
        count("all_to_all_single", backward),
        count("reduce_scatter_tensor", forward + backward),
        count("all_gather_into_tensor", forward + backward),
        count("all_reduce_?", backward),  # Inductor writes it in place: all_reduce_
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "world_size,mode,reshard",
    [(2, "fully_shard", True), (2, "fully_shard", False), (4, "hybrid_shard", False)],
    ids=["reshard", "keep", "hybrid_shard-keep"],
)
def test_inductor_with_passes_one_collective_per_block(world_size, mode, reshard):
    """One all-gather per block in forward (and in backward when resharding), one
    reduce-scatter per block in backward, and with hybrid_shard one replica all-reduce per
    block after it; the parameters as FSDP2's."""
    blocks = 3  # the root (embedding / tied output layer), blocks.0, blocks.1
    replicas = blocks if mode == "hybrid_shard" else 0
    for diffs, counts in run_ranks(inductor_worker, world_size, mode, reshard, timeout=600):
        assert max(diffs) <= 1e-6, diffs
        assert counts == [blocks, blocks * (2 if reshard else 1), 0, 0, replicas], counts
