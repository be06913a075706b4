"""recompute_gathers: the forward nodes of a gather marked with its reshard policy get the
checkpoint tags that policy means, backward nodes none, above every other checkpoint region;
and under ``passes.install()`` Dynamo traces no checkpoint around a ``data_parallel`` gather,
while the backward still gathers every block again (fake process group)."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.fx import Graph
from torch.utils.checkpoint import CheckpointPolicy

import passes
from benchmarks.common.llama import Config, LlamaForCausalLM
from compiled_hooks import compat
from compiled_hooks.fsdp import data_parallel
from compiled_hooks.graph_contract import RESHARD
from passes.recompute_gathers import recompute_gathers
from passes.testing import fake_process_group
from tests.graphs import data_parallel_graphs

aten = torch.ops.aten
TAG_CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint
ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default


def joint_graph(reshard):
    """``w = primal * 2`` (the gather, marked), ``y = w * x`` (a user's checkpoint region, id 3)
    and ``g = tangent * w`` (the backward, marked as the gather's backward is)."""
    graph = Graph()
    primal, x, tangent = (graph.placeholder(n) for n in ("primals_1", "primals_2", "tangents_1"))
    w = graph.call_function(aten.mul.Tensor, (primal, 2))
    y = graph.call_function(aten.mul.Tensor, (w, x))
    g = graph.call_function(aten.mul.Tensor, (tangent, w))
    graph.output((y, g))
    w.meta["custom"] = g.meta["custom"] = {RESHARD: reshard}
    y.meta.update(recompute=CheckpointPolicy.PREFER_RECOMPUTE, ac_graph_id=3)
    return graph, w, y, g


@pytest.mark.parametrize(
    "reshard,policy",
    [(True, CheckpointPolicy.MUST_RECOMPUTE), (False, CheckpointPolicy.MUST_SAVE)],
    ids=["reshard", "keep"],
)
def test_the_forward_of_a_marked_gather_is_tagged(reshard, policy):
    graph, w, y, g = joint_graph(reshard)
    assert recompute_gathers(graph)
    assert (w.meta["recompute"], w.meta["ac_graph_id"]) == (policy, 4)
    assert "recompute" not in g.meta  # the backward's nodes are the partitioner's to place
    assert (y.meta["recompute"], y.meta["ac_graph_id"]) == (CheckpointPolicy.PREFER_RECOMPUTE, 3)
    assert recompute_gathers(graph) and w.meta["ac_graph_id"] == 4  # idempotent


def test_a_graph_with_no_mark_is_left_alone():
    graph, w, _, g = joint_graph(True)
    del w.meta["custom"], g.meta["custom"]
    assert not recompute_gathers(graph)
    assert "recompute" not in w.meta


def _llama(reshard):
    fake_process_group(4)
    config = Config(layers=2)
    model = data_parallel(
        LlamaForCausalLM(config), init_device_mesh("cpu", (4,)), reshard_after_forward=reshard
    )
    return model, torch.randint(0, config.vocab, (2, 8))


def _checkpoints(model, tokens):
    """The checkpoint regions in the graph Dynamo hands the backend for one forward."""
    found = []

    def backend(gm, example_inputs):
        graphs = [m.graph for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]
        found.extend(n for g in graphs for n in g.nodes if n.target is TAG_CHECKPOINT)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, fullgraph=True, backend=backend)(tokens)
    return len(found)


def test_installed_a_gather_is_traced_with_no_checkpoint():
    """Without the passes, each parameter's gather is a checkpoint region; installed, none is."""
    model, tokens = _llama(True)
    assert _checkpoints(model, tokens) == len(list(model.parameters()))
    with passes.install():
        assert _checkpoints(model, tokens) == 0


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_installed_the_backward_gathers_again_only_when_resharding(reshard):
    """Installed, the backward gathers every block and root parameter again when resharding
    (but the embedding, whose backward does not read its weight), and nothing when keeping. A
    block is one all-gather where ``block_gather`` fits (not on torch 2.11: one per parameter)."""
    model, tokens = _llama(reshard)
    torch._dynamo.reset()
    with passes.install():
        graphs = data_parallel_graphs(model, tokens)
    forward, backward = (sum(n.target is ALL_GATHER for n in gm.graph.nodes) for _, gm in graphs)
    assert forward == (5 if compat.to_local_keeps_none_gradients() else 2 * 9 + 3)
    assert backward == (forward - 1 if reshard else 0)
