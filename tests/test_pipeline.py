"""Pipeline, default_pipeline and install: options, uuid, Inductor registration, FX graph cache."""

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

import passes
from passes import Pipeline, default_pipeline, fold_collective_scaling, fuse_collective_casts, install
from passes.testing import fake_process_group
from tests.graphs import hook_fn


def test_options_reach_the_passes_that_take_them():
    p = default_pipeline(bucket_cap_mb=3.0, avg_backends=("nccl",))
    assert p.options == {"bucket_cap_mb": 3.0, "avg_backends": ("nccl",)}
    with pytest.raises(ValueError, match=r"no pass takes option\(s\) \['bucket_cap'\]"):
        default_pipeline(bucket_cap=3.0)
    with pytest.raises(TypeError, match="a pass must be callable"):
        Pipeline([fold_collective_scaling, "fuse"])


def test_uuid_follows_passes_and_options():
    assert default_pipeline().uuid() == default_pipeline().uuid()
    assert default_pipeline().uuid() != default_pipeline(bucket_cap_mb=10.0).uuid()
    assert default_pipeline().uuid() != Pipeline([fold_collective_scaling]).uuid()
    assert Pipeline([fold_collective_scaling, fuse_collective_casts]).uuid() != Pipeline(
        [fuse_collective_casts, fold_collective_scaling]).uuid()


def test_install_restores_previous_config():
    assert inductor_config.post_grad_custom_post_pass is None
    with install() as pipeline:
        assert inductor_config.post_grad_custom_post_pass is pipeline
        with install(Pipeline([fold_collective_scaling])) as inner:  # a pipeline may replace a pipeline
            assert inductor_config.post_grad_custom_post_pass is inner
        assert inductor_config.post_grad_custom_post_pass is pipeline
    assert inductor_config.post_grad_custom_post_pass is None
    handle = install()  # a plain call stays installed
    try:
        assert isinstance(inductor_config.post_grad_custom_post_pass, Pipeline)
    finally:
        handle.restore()
    assert inductor_config.post_grad_custom_post_pass is None


def test_install_refuses_to_replace_a_foreign_pass():
    inductor_config.post_grad_custom_post_pass = lambda graph: None
    try:
        with pytest.raises(RuntimeError, match="already set"):
            install()
        with pytest.raises(TypeError, match="expected a passes.Pipeline"):
            install(fold_collective_scaling)
    finally:
        inductor_config.post_grad_custom_post_pass = None


def test_fx_graph_cache_entries_follow_pipeline_options():
    fake_process_group(8)
    fn = hook_fn("bf16", sharded=False)
    grad = torch.randn(64)

    def compile_once(pipeline):
        torch._dynamo.reset()
        counters["inductor"].clear()
        with install(pipeline):
            torch.compile(fn, fullgraph=True)(grad.clone())
        return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]

    with fresh_cache(), inductor_config.patch(fx_graph_cache=True, fx_graph_remote_cache=False):
        assert compile_once(default_pipeline()) == (0, 1)
        assert compile_once(default_pipeline()) == (1, 0)  # same options: same entry
        assert compile_once(default_pipeline(bucket_cap_mb=5.0)) == (0, 1)  # other options: new entry
        assert compile_once(Pipeline([fold_collective_scaling])) == (0, 1)  # other passes: new entry


def test_package_exports():
    assert set(passes.__all__) >= {"fold_collective_scaling", "fuse_collective_casts", "Pipeline",
                                   "default_pipeline", "install", "testing"}


def test_an_unsorted_graph_is_sorted_before_the_passes():
    """Inductor's schedule_comm_wait can hand the custom pass nodes out of topological order
    (it sorts only afterwards); the pipeline sorts first, so its rewrites lint clean."""
    from passes.testing import trace
    from tests.graphs import ddp_args, ddp_fn

    fake_process_group(4)  # the hook's state reads the group
    gm = trace(ddp_fn("bf16"), *ddp_args([(8,), (4, 2), (3,)]), world_size=4)
    nodes = list(gm.graph.nodes)
    first_wait = next(n for n in nodes if "wait_tensor" in str(n.target))
    first_user = next(iter(first_wait.users))
    first_wait.append(first_user)  # valid: right after its input ...
    last = [n for n in gm.graph.nodes if n.op != "output"][-1]
    last.append(first_wait)        # ... now the wait comes after its user
    with pytest.raises(RuntimeError, match="used before it has been defined"):
        gm.graph.lint()
    assert default_pipeline().run(gm.graph)
    gm.graph.lint()


def test_install_keeps_the_communication_schedule_unless_the_process_set_its_own():
    assert not inductor_config.reorder_for_compute_comm_overlap
    assert inductor_config.reorder_for_peak_memory
    with install():
        assert inductor_config.reorder_for_compute_comm_overlap
        assert inductor_config.reorder_for_compute_comm_overlap_passes == ["sink_waits"]
        assert not inductor_config.reorder_for_peak_memory
        with install(Pipeline([fold_collective_scaling])):
            assert inductor_config.reorder_for_compute_comm_overlap_passes == ["sink_waits"]
        assert inductor_config.reorder_for_compute_comm_overlap
    assert not inductor_config.reorder_for_compute_comm_overlap
    assert inductor_config.reorder_for_compute_comm_overlap_passes == []
    assert inductor_config.reorder_for_peak_memory
    own = ["sink_waits_iterative"]
    with inductor_config.patch(reorder_for_compute_comm_overlap=True, reorder_for_compute_comm_overlap_passes=own):
        with install():
            assert inductor_config.reorder_for_compute_comm_overlap_passes == own


def test_run_reports_pass_times():
    from passes.testing import trace
    from tests.graphs import ddp_args, ddp_fn

    fake_process_group(2)
    gm = trace(ddp_fn("bf16"), *ddp_args([(8,), (4, 2)]), world_size=2)
    counters["passes"].clear()
    pipeline = default_pipeline()
    assert pipeline.run(gm.graph)
    times = {k: v for k, v in counters["passes"].items() if k.endswith(": us")}
    assert set(times) == {f"{p.__name__}: us" for p in pipeline.passes} | {"pipeline: us"}
    assert 0 < sum(v for k, v in times.items() if k != "pipeline: us") <= times["pipeline: us"]
