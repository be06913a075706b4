"""The hooks under torch.compile: one graph, no breaks, the same values as eager."""

import pytest
import torch
import torch.distributed as dist

import compiled_hooks as ch
from tests.ranks import run_ranks

CASES = {
    "allreduce_hook": (ch.allreduce_hook, False, False, "all_reduce"),
    "reduce_scatter_hook": (ch.reduce_scatter_hook, False, True, "reduce_scatter_tensor"),
    "fp16_compress_hook": (ch.fp16_compress_hook, True, False, "all_reduce"),
    "fp16_compress_hook+output": (ch.fp16_compress_hook, True, True, "reduce_scatter_tensor"),
    "bf16_compress_hook": (ch.bf16_compress_hook, True, False, "all_reduce"),
    "bf16_compress_hook+output": (ch.bf16_compress_hook, True, True, "reduce_scatter_tensor"),
}


def _call(hook, low_precision, sharded, group):
    state = (ch.LowPrecisionState if low_precision else ch.DefaultState)(group)
    grad = torch.randn(4 * dist.get_world_size(group), 3)
    out = torch.empty(4, 3) if sharded else None

    def step(grad, out):
        if out is None:
            hook(state, grad)
            return grad
        hook(state, grad, out)
        return out

    return step, (grad, out)


@pytest.mark.parametrize("name", CASES)
def test_traced_whole_with_no_graph_break(fake_pg, name):
    hook, low_precision, sharded, collective = CASES[name]
    step, args = _call(hook, low_precision, sharded, fake_pg)
    explained = torch._dynamo.explain(step)(*args)
    # explain reports 0 breaks for a function Dynamo skipped entirely: also demand the graph.
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    code = explained.graphs[0].code
    assert f"_c10d_functional.{collective}" in code and "wait_tensor" in code, code
    torch.compile(step, fullgraph=True, backend="aot_eager")(*args)


def compiled_worker(rank, world_size):
    group = dist.group.WORLD
    state, lp = ch.DefaultState(group), ch.LowPrecisionState(group)

    def all_hooks(g, flat, shard, bf, fp, bf_shard):
        ch.allreduce_hook(state, g)
        ch.reduce_scatter_hook(state, flat, shard)
        ch.bf16_compress_hook(lp, bf)
        ch.fp16_compress_hook(lp, fp)
        ch.bf16_compress_hook(lp, flat, bf_shard)
        return g, shard, bf, fp, bf_shard

    torch.manual_seed(rank)
    n = 16 * world_size
    inputs = [
        torch.randn(5, 7),
        torch.randn(n) * 100,
        torch.empty(16),
        torch.randn(33),
        torch.randn(8, 8),
        torch.empty(16),
    ]
    eager_out = all_hooks(*[t.clone() for t in inputs])
    compiled = torch.compile(all_hooks, fullgraph=True)
    compiled_out = compiled(*[t.clone() for t in inputs])
    return eager_out, compiled_out


@pytest.mark.slow
def test_compiled_equals_eager_on_two_ranks():
    for rank, (eager_out, compiled_out) in enumerate(run_ranks(compiled_worker, 2)):
        for i, (e, c) in enumerate(zip(eager_out, compiled_out)):
            assert torch.equal(e, c), f"rank {rank} output {i}: max diff {(e - c).abs().max()}"
