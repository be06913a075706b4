"""The differential verifier: catches wrong rewrites, names them, passes the real ones."""

import pytest
import torch
from torch._dynamo.utils import counters

import passes
from passes import PassVerificationError, Pipeline
from passes.core.chains import is_scale
from passes.core.ops import ALL_REDUCE
from passes.testing import trace
from tests.graphs import ddp_args, ddp_fn, hook_args, hook_fn


def drop_a_division(graph):
    """A wrong pass: removes the last constant division of the graph."""
    for n in reversed(graph.nodes):
        if is_scale(n) and n.target is torch.ops.aten.div.Tensor:
            n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)
            return True
    return False


def sum_to_avg_without_removing_factors(graph):
    """A wrong pass: makes the collective average but keeps the hook's divisions."""
    for n in graph.nodes:
        if n.op == "call_function" and n.target is ALL_REDUCE and n.args[1] == "sum":
            n.args = (n.args[0], "avg", n.args[2])
            return True
    return False


def _hook_graph(kind="bf16", world_size=8):
    trace(lambda: None, world_size=world_size)
    return trace(hook_fn(kind, sharded=False), *hook_args(False, world_size))


@pytest.mark.parametrize("wrong", [drop_a_division, sum_to_avg_without_removing_factors])
def test_wrong_pass_is_caught_and_named(wrong):
    gm = _hook_graph()
    with pytest.raises(PassVerificationError) as info:
        Pipeline([wrong], verify=True).run(gm.graph)
    message = str(info.value)
    assert f"pass {wrong.__name__} changed the graph's values" in message
    assert "output 0 (" in message and "max abs diff" in message
    assert "First node whose value differs:" in message and "none found" not in message
    assert "--- before" in message and "--- after" in message and "c10d.all_reduce" in message


def test_wrong_pass_in_a_ddp_graph_is_caught():
    trace(lambda: None, world_size=4)
    gm = trace(ddp_fn("fp16"), *ddp_args([(8,), (3, 3), (5,)]), world_size=4)
    with pytest.raises(PassVerificationError, match="pass drop_a_division"):
        Pipeline(
            [passes.fold_collective_scaling, passes.bucket_compressed_collectives, drop_a_division],
            verify=True,
        ).run(gm.graph)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("world_size", [2, 6, 8])
def test_real_passes_verify_clean(kind, world_size):
    counters["passes"].clear()
    trace(lambda: None, world_size=world_size)
    for sharded in (False, True):
        gm = trace(hook_fn(kind, sharded), *hook_args(sharded, world_size), world_size=world_size)
        passes.default_pipeline(verify=True).run(gm.graph)
    gm = trace(ddp_fn(kind), *ddp_args([(4, 3), (7,), (2, 2, 2)]), world_size=world_size)
    passes.default_pipeline(verify=True).run(gm.graph)
    verified = sum(v for k, v in counters["passes"].items() if k.endswith(": verified"))
    assert verified >= (1 if kind == "fp16" else 3)  # fp16 folds nothing, but it buckets


def test_verify_mode_bypasses_the_cache_and_reads_the_environment(monkeypatch):
    assert Pipeline([passes.fold_collective_scaling], verify=True).uuid() is None
    monkeypatch.setenv("PASSES_VERIFY", "1")
    assert passes.default_pipeline().verify
    with passes.install() as pipeline:
        assert pipeline.verify
    monkeypatch.setenv("PASSES_VERIFY", "0")
    assert not passes.default_pipeline().verify
    with pytest.raises(ValueError, match="pass verify= to the Pipeline"):
        passes.install(passes.default_pipeline(), verify=True)


def test_nan_in_the_same_places_is_no_mismatch():
    """Random inputs make NaNs (sqrt of a negative): the same NaNs before and after are equal,
    a NaN that appears only after the rewrite is not."""
    from passes.core.verify import check_rewrite, copy_graph

    gm = trace(lambda x: torch.sqrt(x) * 2, torch.ones(64), world_size=2)
    assert check_rewrite("identity", copy_graph(gm.graph), gm.graph)
    after = copy_graph(gm.graph)
    (mul,) = [n for n in after.nodes if n.target is torch.ops.aten.mul.Tensor]
    mul.args = (mul.args[0], float("nan"))
    with pytest.raises(PassVerificationError, match="non-finite values differ"):
        check_rewrite("nan_maker", gm.graph, after)
