"""A compiled ``data_parallel`` forward gathers from each parameter's plain leaf
(``compiled_hooks.fsdp.leaves``): no DTensor is a graph input, the gradients land on the DTensor
parameters as ``to_local()``'s backward would put them there, and a parameter changed past the
leaf is followed (through the module) or refused (around it) by name."""

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import compiled_hooks as ch
import passes
from benchmarks.common.llama import Config, LlamaForCausalLM
from compiled_hooks.fsdp import data_parallel, data_parallel_state, register_comm_hook
from passes.testing import fake_process_group
from tests.ranks import run_ranks


def _inputs_of_traced_root(model, tokens):
    seen = []

    def backend(gm, example_inputs):
        seen.extend(n.meta["example_value"] for n in gm.graph.find_nodes(op="placeholder"))
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    with passes.install():
        torch.compile(model, backend=backend, fullgraph=True)(tokens).sum().backward()
    return seen


@pytest.mark.parametrize("blocks", [None, []], ids=["blocks", "root only"])
def test_the_traced_root_reads_no_dtensor(blocks):
    fake_process_group(2)
    config = Config(layers=2)
    model = data_parallel(LlamaForCausalLM(config), init_device_mesh("cpu", (2,)), blocks=blocks)
    inputs = _inputs_of_traced_root(model, torch.randint(0, config.vocab, (2, 8)))
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    # the tokens and one shard per parameter (2 x 9 in the layers, embedding, norm, head)
    assert len(tensors) == 1 + 2 * 9 + 3
    assert not any(isinstance(t, DTensor) for t in tensors)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def _grads_match(model, ref):
    """Each DTensor parameter's gradient, gathered, against ``ref``'s."""
    for p, r in zip(model.parameters(), ref.parameters()):
        assert isinstance(p.grad, DTensor) and p.grad.placements == (Shard(0),)
        torch.testing.assert_close(p.grad.full_tensor(), r.grad)


def leaves_worker(rank, world_size):
    ref = _net()
    model = data_parallel(copy.deepcopy(ref), init_device_mesh("cpu", (world_size,)))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))  # alike on every rank
    outcome = {}

    def step(run):
        with passes.install():
            run(x).square().sum().backward()

    # two backwards accumulate, and a hook on a DTensor parameter runs once per backward
    fired = []
    model[0].weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad is not None))
    for _ in range(2):
        step(compiled)
        step(ref)
    _grads_match(model, ref)
    outcome["hook"] = list(fired)
    # an optimizer step in place reaches what the compiled forward reads
    for net in (model, ref):
        torch.optim.SGD(net.parameters(), lr=0.1).step()
        net.zero_grad()
    torch.testing.assert_close(compiled(x), ref(x))
    # frozen through the module, and unfrozen: no gradient, then gradients again
    model[0].requires_grad_(False)
    step(compiled)
    outcome["frozen"] = [p.grad is None for p in model.parameters()]
    model.zero_grad()
    model[0].requires_grad_(True)
    step(compiled)
    step(ref)
    _grads_match(model, ref)
    model.zero_grad()
    # frozen around the module: the gradient is dropped; unfrozen around it: refused by name
    model[2].bias.requires_grad_(False)
    step(compiled)
    outcome["dropped"] = model[2].bias.grad is None
    model[2].bias.requires_grad_(True)
    with pytest.raises(RuntimeError, match="'2.bias' was set to require grad after"):
        step(compiled)
    model[2].requires_grad_(True)
    model.zero_grad()
    # loaded by assignment (a parameter assigned through the module): followed
    torch.manual_seed(2)
    ref.load_state_dict(_net().state_dict())
    shards = {
        k: distribute_tensor(v, model[0].weight.device_mesh, [Shard(0)])
        for k, v in ref.state_dict().items()
    }
    model.load_state_dict(shards, assign=True)
    torch.testing.assert_close(compiled(x), ref(x))
    # a parameter that is no shard, assigned: refused by name, the module unchanged
    with pytest.raises(TypeError, match="Linear.bias is sharded, and a Parameter is no DTensor"):
        model[2].bias = nn.Parameter(torch.zeros(8))
    assert isinstance(model[2].bias, DTensor)
    model[2].bias = nn.Parameter(shards["2.bias"])  # a shard, assigned: followed
    torch.testing.assert_close(compiled(x), ref(x))
    # a parameter replaced around the module: refused by name
    model[0]._parameters["weight"] = nn.Parameter(model[0].weight.detach().clone())
    with pytest.raises(RuntimeError, match="'0.weight' no longer holds the shard"):
        step(compiled)
    return outcome


@pytest.mark.slow  # two rank processes, a compile each and several recompiles
def test_gradients_move_to_the_parameters_and_changes_are_followed_or_refused():
    for outcome in run_ranks(leaves_worker, 2, timeout=300):
        assert outcome == {
            "hook": [True, True],
            "frozen": [True, True, False, False],
            "dropped": True,
        }


def test_the_gather_ops_key_names_the_groups_its_collectives_run_in():
    """The graph's inputs are plain shards, which name no group: the gather op's ``code``
    argument does, so two pipeline ranks' ``"dp"`` groups of one layout never share a cached
    graph, nor do two hooks' groups."""
    fake_process_group(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "dp"))
    model = data_parallel(LlamaForCausalLM(Config(layers=1)), mesh["dp"])
    gathers = data_parallel_state(model).gathers
    assert mesh["dp"].get_group().group_name in gathers.key.split(":")
    before = gathers.key
    register_comm_hook(model, ch.DefaultState(mesh.get_group("rep")), ch.reduce_scatter_hook)
    assert gathers.key != before
    assert mesh.get_group("rep").group_name in gathers.key.split(":")
