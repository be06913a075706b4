"""Pipeline, default_pipeline and install: options, uuid, Inductor registration, FX graph cache."""

import pathlib
import re

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

import passes
from compiled_hooks import compat
from passes import (
    Pipeline,
    bucket_compressed_collectives,
    default_pipeline,
    fold_collective_scaling,
    install,
)
from passes.registration import sink_waits_outside_blocks
from passes.testing import fake_process_group
from tests.graphs import hook_fn


def test_options_reach_the_passes_that_take_them():
    p = default_pipeline(bucket_cap_mb=3.0, avg_backends=("nccl",))
    assert p.options == {"bucket_cap_mb": 3.0, "avg_backends": ("nccl",)}
    with pytest.raises(ValueError, match=r"no pass takes option\(s\) \['bucket_cap'\]"):
        default_pipeline(bucket_cap=3.0)
    with pytest.raises(TypeError, match="a pass must be callable"):
        Pipeline([fold_collective_scaling, "fuse"])


def test_a_pipeline_in_a_declared_wrong_order_is_refused_by_name():
    with pytest.raises(
        passes.PassOrderError,
        match=r"fuse_cat_prologue must run after bucket_compressed_collectives",
    ):
        Pipeline([fold_collective_scaling, passes.fuse_cat_prologue, bucket_compressed_collectives])
    with pytest.raises(
        passes.PassOrderError, match=r"insert_rank_guard must run after schedule_collectives"
    ):
        Pipeline([passes.insert_rank_guard, passes.schedule_collectives])
    Pipeline([passes.fuse_cat_prologue])  # an order constrains only the passes a pipeline holds
    default_pipeline(shard_weight_update=True)  # the default order keeps every declaration


def test_every_pass_declares_its_interface():
    from passes.core.interface import interface_of

    for name in passes.__all__:
        fn = getattr(passes, name)
        if callable(fn) and name.islower() and name not in ("default_pipeline", "install"):
            interface = fn.interface
            assert interface.name == name and interface_of(fn) is interface
            assert set(interface.after) <= set(passes.__all__), interface.after
    assert passes.bucket_compressed_collectives.interface.option_names == {
        "bucket_cap_mb",
        "first_bucket_cap_mb",
    }


def test_a_declaration_that_disagrees_with_its_function_is_refused():
    import dataclasses

    from passes.core.interface import graph_pass

    @dataclasses.dataclass(frozen=True)
    class Options:
        cap: int = 2

    with pytest.raises(
        TypeError,
        match=r"my_pass's keyword parameters \{'cap': 3\} differ from its options \{'cap': 2\}",
    ):

        @graph_pass(options=Options)
        def my_pass(graph, cap=3):
            return False


def test_install_takes_options_for_the_default_pipeline():
    with install(options={"bucket_cap_mb": 3.0}) as pipeline:
        assert pipeline.options == {"bucket_cap_mb": 3.0}
    assert inductor_config.post_grad_custom_post_pass is None
    with pytest.raises(ValueError, match=r"no pass takes option\(s\) \['bucket_cap'\]"):
        install(options={"bucket_cap": 3.0})
    # refused before anything was installed
    assert inductor_config.post_grad_custom_post_pass is None
    with pytest.raises(ValueError, match="pass options= to the Pipeline you give"):
        install(Pipeline([fold_collective_scaling]), options={"avg_backends": ("nccl",)})


def test_uuid_follows_passes_and_options():
    assert default_pipeline().uuid() == default_pipeline().uuid()
    assert default_pipeline().uuid() != default_pipeline(bucket_cap_mb=10.0).uuid()
    assert default_pipeline().uuid() != Pipeline([fold_collective_scaling]).uuid()
    assert (
        Pipeline([fold_collective_scaling, passes.bucket_block_all_gathers]).uuid()
        != Pipeline([passes.bucket_block_all_gathers, fold_collective_scaling]).uuid()
    )


def test_uuid_follows_every_source_of_the_package(monkeypatch):
    """A change to a helper the passes share (passes/core/) or to a pass module outside the
    pass function keys another graph."""
    import passes.core.cache_key as cache_key

    key = default_pipeline().uuid()
    sources = sorted(cache_key._PACKAGE_DIR.rglob("*.py"))
    assert {"chains.py", "fold_collective_scaling.py", "__init__.py"} <= {p.name for p in sources}
    helper = next(p for p in sources if p.name == "chains.py")
    read = pathlib.Path.read_bytes
    monkeypatch.setattr(
        pathlib.Path, "read_bytes", lambda p: read(p) + (b"#" if p == helper else b"")
    )
    assert default_pipeline().uuid() != key


def test_uuid_follows_the_hosts(monkeypatch):
    """The default all_to_all piece size depends on whether the ranks share a host, so a graph
    compiled for one never serves the other from the FX graph cache."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    one_host = default_pipeline().uuid()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert default_pipeline().uuid() != one_host


def test_install_restores_previous_config():
    assert inductor_config.post_grad_custom_post_pass is None
    with install() as pipeline:
        assert inductor_config.post_grad_custom_post_pass is pipeline
        # a pipeline may replace a pipeline
        with install(Pipeline([fold_collective_scaling])) as inner:
            assert inductor_config.post_grad_custom_post_pass is inner
        assert inductor_config.post_grad_custom_post_pass is pipeline
    assert inductor_config.post_grad_custom_post_pass is None
    handle = install()  # a plain call stays installed
    try:
        assert isinstance(inductor_config.post_grad_custom_post_pass, Pipeline)
    finally:
        handle.restore()
    assert inductor_config.post_grad_custom_post_pass is None


def test_install_runs_the_users_joint_passes_first_and_restores_them():
    seen = []

    def users_joint_pass(graph):
        seen.append("user")

    for setting in (None, users_joint_pass, [users_joint_pass]):
        inductor_config.joint_custom_pre_pass = setting
        try:
            with install():
                joint = inductor_config.joint_custom_pre_pass
                with install():  # an inner install runs the user's passes once, not twice
                    inner = inductor_config.joint_custom_pre_pass
                    inner(torch.fx.Graph())
                assert inductor_config.joint_custom_pre_pass is joint
                # a pass without a uuid makes Inductor bypass its cache, as always
                assert (joint.uuid() is None) == (setting is not None)
            assert inductor_config.joint_custom_pre_pass is setting
        finally:
            inductor_config.joint_custom_pre_pass = None
    assert seen == ["user", "user"]


def installed():
    """The custom post-grad passes Inductor runs, in order (a list on 2.13+, one pass on 2.11)."""
    return compat.post_passes(inductor_config.post_grad_custom_post_pass)


def test_install_runs_after_the_users_own_custom_pass_and_leaves_it_alone_on_exit():
    fake_process_group(8)
    seen = []

    def users_pass(graph):
        seen.append(("user", sum(1 for n in graph.nodes if "div" in str(n.target))))

    inductor_config.post_grad_custom_post_pass = users_pass
    try:
        with install(Pipeline([fold_collective_scaling])) as pipeline:
            assert installed() == [users_pass, pipeline]
            counters["passes"].clear()
            torch.compile(hook_fn("bf16", sharded=False), fullgraph=True)(torch.randn(64))
        assert inductor_config.post_grad_custom_post_pass is users_pass  # back, alone
        # the user's pass ran (before the fold)
        assert seen and seen[0][0] == "user" and seen[0][1] > 0
        # and the pipeline ran too
        assert any(
            k.startswith("fold_collective_scaling") and "skipped" not in k
            for k in counters["passes"]
        ), dict(counters["passes"])
        with install() as outer:
            with install() as inner:  # a pipeline replaces a pipeline, the user's pass stays
                assert installed() == [users_pass, inner]
            assert installed() == [users_pass, outer]
        assert inductor_config.post_grad_custom_post_pass is users_pass
        with install() as pipeline:  # changed while installed: only the pipeline comes out
            compat.set_custom_post_pass(compat.post_pass_setting([users_pass, pipeline, print]))
        assert installed() == [users_pass, print]
        with pytest.raises(TypeError, match="expected a passes.Pipeline"):
            install(fold_collective_scaling)
    finally:
        inductor_config.post_grad_custom_post_pass = None


@pytest.mark.parametrize(
    "value, verify",
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        ("0", False),
        ("false", False),
        ("", False),
        (None, False),
    ],
)
def test_environment_flags_parse_one_way(monkeypatch, value, verify):
    for name in ("PASSES_VERIFY", "PASSES_CHECK_RANKS"):
        monkeypatch.delenv(name, raising=False)
    if value is not None:
        monkeypatch.setenv("PASSES_VERIFY", value)
    assert default_pipeline().verify is verify
    assert default_pipeline(verify=not verify).verify is (not verify)  # an argument wins


@pytest.mark.parametrize("name", ["PASSES_VERIFY", "PASSES_CHECK_RANKS"])
def test_environment_flag_with_another_value_names_the_variable(monkeypatch, name):
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(
        ValueError, match=f"environment variable {name}='maybe': expected 1, 0, true or false"
    ):
        default_pipeline()


@pytest.mark.slow  # four Inductor compiles
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
        # other options: new entry
        assert compile_once(default_pipeline(bucket_cap_mb=5.0)) == (
            0,
            1,
        )
        # other passes: new entry
        assert compile_once(Pipeline([fold_collective_scaling])) == (
            0,
            1,
        )


def test_package_exports():
    assert set(passes.__all__) >= {
        "fold_collective_scaling",
        "bucket_compressed_collectives",
        "Pipeline",
        "default_pipeline",
        "install",
        "testing",
    }


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
    last.append(first_wait)  # ... now the wait comes after its user
    with pytest.raises(RuntimeError, match="used before it has been defined"):
        gm.graph.lint()
    assert default_pipeline().run(gm.graph)
    gm.graph.lint()


def test_a_pass_that_leaves_a_read_before_its_value_is_named():
    """A rewrite that moves a value after its reader (or erases one still read) fails the run,
    naming the reader, before Inductor sees the graph."""
    from passes.core.interface import graph_pass
    from passes.testing import trace
    from tests.graphs import ddp_args, ddp_fn

    @graph_pass()
    def misplace_a_wait(graph):
        wait = next(n for n in graph.nodes if "wait_tensor" in str(n.target))
        [n for n in graph.nodes if n.op != "output"][-1].append(wait)
        return True

    fake_process_group(4)
    gm = trace(ddp_fn("bf16"), *ddp_args([(8,), (4, 2), (3,)]), world_size=4)
    with pytest.raises(RuntimeError, match=r"Pipeline: after the passes, \w+ reads a value not"):
        Pipeline([misplace_a_wait]).run(gm.graph)


def test_install_keeps_the_communication_schedule_unless_the_process_set_its_own():
    assert not inductor_config.reorder_for_compute_comm_overlap
    assert inductor_config.reorder_for_peak_memory
    with install():
        assert inductor_config.reorder_for_compute_comm_overlap
        assert inductor_config.reorder_for_compute_comm_overlap_passes == [
            sink_waits_outside_blocks
        ]
        assert not inductor_config.reorder_for_peak_memory
        with install(Pipeline([fold_collective_scaling])):
            assert inductor_config.reorder_for_compute_comm_overlap_passes == [
                sink_waits_outside_blocks
            ]
        assert inductor_config.reorder_for_compute_comm_overlap
    assert not inductor_config.reorder_for_compute_comm_overlap
    assert inductor_config.reorder_for_compute_comm_overlap_passes == []
    assert inductor_config.reorder_for_peak_memory
    own = ["sink_waits_iterative"]
    with inductor_config.patch(
        reorder_for_compute_comm_overlap=True, reorder_for_compute_comm_overlap_passes=own
    ):
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


@pytest.mark.slow
def test_torch_logs_shows_the_passes_decisions(tmp_path):
    """``TORCH_LOGS="+passes"`` (docs/passes.md): every decision, and a summary line per compile."""
    import os
    import sys

    from tests.processes import run_script

    script = tmp_path / "step.py"
    script.write_text(
        "import torch, torch.distributed as dist\nfrom "
        "torch.testing._internal.distributed.fake_pg import FakeStore\nimport compiled_hooks as "
        "ch, passes\ndist.init_process_group('fake', store=FakeStore(), rank=0, "
        "world_size=8)\nstate = ch.LowPrecisionState(dist.group.WORLD)\ndef step(a, b):\n    "
        "ch.bf16_compress_hook(state, a); ch.bf16_compress_hook(state, b)\nwith "
        "passes.install():\n    torch.compile(step, fullgraph=True)(torch.randn(64), "
        "torch.randn(32))\n"
    )
    env = {**os.environ, "TORCH_LOGS": "+passes", "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    proc = run_script([sys.executable, str(script)], timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stderr
    assert (
        log.count("fold_collective_scaling: folded factors into reduce op avg at all_reduce") == 2
    ), log[-3000:]
    summary = [line for line in log.splitlines() if "] passes: " in line]
    assert len(summary) == 1, log[-3000:]
    assert "bucket_compressed_collectives: bucketed 2 collectives into one (x1)" in summary[0], (
        summary
    )


def test_a_collective_reads_its_bucket_where_the_kernels_write_it_with_padding_on():
    """With Inductor's comprehensive padding (CUDA's default; here forced on CPU) a bucket of
    rows wider than 1024 elements is written with a padded row stride and then copied dense for
    the collective: the pipeline marks what a collective reads, and the kernel writes it dense."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fcol
    from torch._inductor.utils import run_and_get_code

    from tests import output_code

    fake_process_group(2)

    def bucket(a, b):  # 2 rows of 1200: a padded stride would be 1216
        x = torch.cat([a * 2, b * 3], 1)
        return fcol.wait_tensor(fcol.all_to_all_single(x, None, None, dist.group.WORLD)) + 1

    with (
        inductor_config.patch(disable_padding_cpu=False, fx_graph_cache=False),
        install(Pipeline([])),
    ):
        _, (code,) = run_and_get_code(
            torch.compile(bucket), torch.randn(2, 700), torch.randn(2, 500)
        )
    (read,) = output_code.collective_calls(code, "all_to_all_single")
    assert re.search(rf"{read} = empty_strided_cpu\(\(2, 1200\), \(1200, 1\)", code), code
    assert output_code.bucket_writers(code, read), code  # a kernel writes it, not a copy of it
    assert len(re.findall(r"empty_strided_cpu\(\(2, 1200\)", code)) == 1, code
