"""schedule_collectives: waits late, collectives early, collective order kept; and the schedule
that reaches Inductor's generated code (fake process group) for a compiled DDP backward and a
data_parallel forward prefetching one block ahead."""

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_reduce

import compiled_hooks as ch
import passes
from passes import fold_collective_scaling, schedule_collectives
from passes.core.verify import check_rewrite, copy_graph
from passes.schedule_collectives import schedule_problems
from passes.testing import fake_process_group, graph_str, trace
from tests.graphs import ddp_args, ddp_fn, mlp
from tests.passcase import PassTestCase


def collectives(graph):
    return [
        (n.target, str(n.args[1:]))
        for n in graph.nodes
        if getattr(n.target, "namespace", None) == "_c10d_functional"
        and "wait" not in str(n.target)
    ]


class TestSchedule(PassTestCase):
    def test_ddp_waits_move_to_the_write_back(self):
        _ = trace(lambda: None, world_size=2)
        gm = trace(ddp_fn("bf16"), *ddp_args([(3, 4), (5,)]), world_size=2)
        fold_collective_scaling(gm.graph)
        before = copy_graph(gm.graph)
        self.assertEqual(
            sorted(schedule_problems(gm.graph)),
            [
                "wait_tensor waits before sin_1, which does not use its result",
                "wait_tensor_1 waits before copy_, which does not use its result",
            ],
        )
        self.assertRewrites(gm, schedule_collectives)
        self.assertExpectedInline(
            graph_str(gm),
            """\
arg0_1: f32[3, 4] = input
arg1_1: f32[5] = input
sin: f32[3, 4] = aten.sin(arg0_1)
convert_element_type: bf16[3, 4] = prims.convert_element_type(sin, bf16)
all_reduce: bf16[3, 4] = c10d.all_reduce(convert_element_type, 'avg', group(size=2))
sin_1: f32[5] = aten.sin(arg1_1)
convert_element_type_2: bf16[5] = prims.convert_element_type(sin_1, bf16)
all_reduce_1: bf16[5] = c10d.all_reduce(convert_element_type_2, 'avg', group(size=2))
wait_tensor: bf16[3, 4] = c10d.wait_tensor(all_reduce)
convert_element_type_1: f32[3, 4] = prims.convert_element_type(wait_tensor, f32)
copy_: f32[3, 4] = aten.copy_(arg0_1, convert_element_type_1)
wait_tensor_1: bf16[5] = c10d.wait_tensor(all_reduce_1)
convert_element_type_3: f32[5] = prims.convert_element_type(wait_tensor_1, f32)
copy__1: f32[5] = aten.copy_(arg1_1, convert_element_type_3)
return [convert_element_type_1, convert_element_type_3]""",
        )
        self.assertEqual(schedule_problems(gm.graph), [])
        self.assertTrue(check_rewrite("schedule_collectives", before, gm.graph))

    def test_collective_issued_after_its_input_but_never_before_an_earlier_collective(self):
        def fn(a, b, c):
            x, y = torch.sin(a), torch.sin(b)
            z = torch.cos(c) @ torch.cos(c)  # unrelated compute the collectives can overlap
            rx = all_reduce(x, "sum", dist.group.WORLD)  # traced after z
            ry = all_reduce(y, "sum", dist.group.WORLD)
            return rx + 1, ry + 1, z

        _ = trace(lambda: None, world_size=2)
        gm = trace(fn, torch.randn(4), torch.randn(4), torch.randn(3, 3), world_size=2)
        order = collectives(gm.graph)
        self.assertRewrites(gm, schedule_collectives)
        self.assertEqual(collectives(gm.graph), order)
        text = graph_str(gm)
        self.assertExpectedInline(
            text,
            """\
a_1: f32[4] = input
b_1: f32[4] = input
c_1: f32[3, 3] = input
sin: f32[4] = aten.sin(a_1)
all_reduce: f32[4] = c10d.all_reduce(sin, 'sum', group(size=2))
sin_1: f32[4] = aten.sin(b_1)
all_reduce_1: f32[4] = c10d.all_reduce(sin_1, 'sum', group(size=2))
cos: f32[3, 3] = aten.cos(c_1)
cos_1: f32[3, 3] = aten.cos(c_1)
mm: f32[3, 3] = aten.mm(cos, cos_1)
wait_tensor: f32[4] = c10d.wait_tensor(all_reduce)
add: f32[4] = aten.add(wait_tensor, 1)
wait_tensor_1: f32[4] = c10d.wait_tensor(all_reduce_1)
add_1: f32[4] = aten.add(wait_tensor_1, 1)
return [add, add_1, mm]""",
        )

    def test_collective_stays_after_a_mutation(self):
        _ = trace(lambda: None, world_size=2)
        gm = trace(
            lambda a, b: all_reduce(torch.sin(a) + b, "sum", dist.group.WORLD),
            torch.randn(4),
            torch.randn(4),
            world_size=2,
        )
        graph = gm.graph
        a, b = [n for n in graph.nodes if n.op == "placeholder"]
        coll = next(
            n for n in graph.nodes if n.target is torch.ops._c10d_functional.all_reduce.default
        )
        with graph.inserting_before(coll):  # a write the collective might read through an alias
            write = graph.call_function(torch.ops.aten.copy_.default, (a, b))
        write.meta["val"] = a.meta["val"]
        text = graph_str(graph)
        self.assertFalse(schedule_collectives(graph))
        self.assertEqual(graph_str(graph), text)


def _call(codes: list[str], pattern: str) -> str:
    """The ``call`` function of the first generated module that matches ``pattern``."""
    code = next(c for c in codes if re.search(pattern, c))
    return code[code.index("def call(") :]


def _code_positions(code: str, pattern: str) -> list[int]:
    """The lines of ``code`` that run what ``pattern`` matches (not its output's size checks)."""
    return [
        i
        for i, line in enumerate(code.splitlines())
        if re.search(pattern, line) and not line.lstrip().startswith("assert_")
    ]


@pytest.mark.slow  # an Inductor compile; the snapshots above pin the FX order in the fast tier
def test_compiled_ddp_backward_overlaps_every_bucket_but_the_last():
    """Inductor's generated backward, with the passes installed: every bucket but the last is
    issued before the last gradient matmul, and every wait comes after it (in a DDP backward no
    gradient depends on a bucket's result, so any earlier wait would stall unrelated work)."""
    fake_process_group(2)  # removed after the test (conftest)
    net = mlp()
    _, model = ch.compile_ddp(net, ch.LowPrecisionState(dist.group.WORLD), ch.bf16_compress_hook)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    x = torch.randn(8, 64)

    def step():
        with (
            passes.install(passes.default_pipeline(bucket_cap_mb=0.01, first_bucket_cap_mb=0.01)),
            ch.compiled_autograd(),
        ):
            model(x).square().mean().backward()

    from torch._inductor.utils import run_and_get_code

    _, codes = run_and_get_code(step)
    call = _call(codes, "all_reduce_")
    issues = _code_positions(call, r"_c10d_functional\.all_reduce_\.")
    waits = _code_positions(call, r"_c10d_functional\.wait_tensor\.")
    grads = _code_positions(call, r"extern_kernels\.(addmm|mm)\(")
    assert len(issues) >= 3, call  # several buckets, or nothing to overlap
    assert all(i < grads[-1] for i in issues[:-1]), call
    assert min(waits) > grads[-1], call


@pytest.mark.slow  # an Inductor compile; test_block_passes pins the FX order in the fast tier
def test_compiled_data_parallel_forward_gathers_one_block_ahead():
    """Inductor's generated forward of ``data_parallel`` (resharding): before block k's matmul
    at most blocks k and k + 1 have been gathered (``prefetch_block_all_gathers``' depth 1),
    not every block's parameters at the start, as Inductor's ``sink_waits`` orders it."""
    from torch.distributed.device_mesh import init_device_mesh

    from compiled_hooks.fsdp import data_parallel

    fake_process_group(2)
    net = mlp()
    blocks = [m for m in net if isinstance(m, nn.Linear)]
    model = data_parallel(
        net, init_device_mesh("cpu", (2,)), reshard_after_forward=True, blocks=blocks
    )
    run = torch.compile(model, fullgraph=True)
    x = torch.randn(8, 64)

    from torch._inductor.utils import run_and_get_code

    with passes.install():
        _, codes = run_and_get_code(lambda: run(x).square().mean().backward())
    forward = _call(codes, r"all_gather_into_tensor")
    gathers = _code_positions(forward, r"_c10d_functional\.all_gather_into_tensor\.")
    # a block runs as a region (compiled_hooks.fsdp.regions), its matmul in the region's function
    # that the call invokes, or inline where its region is called once
    matmuls = _code_positions(
        forward, r"extern_kernels\.(addmm|mm)\(|= partitioned_fw_subgraph_\w+\("
    )
    assert len(gathers) == len(blocks) == len(matmuls), forward
    for k, matmul in enumerate(matmuls):
        assert sum(g < matmul for g in gathers) <= k + 2, forward
