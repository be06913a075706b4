"""bucket_block_all_gathers, bucket_block_reduce_scatters, prefetch_block_all_gathers and the gloo
rewrites of their collectives (reduce_scatter_as_all_to_all, all_gather_as_all_to_all in pieces):
snapshots, the rewritten graphs' values (simulated collectives, and real gloo ranks for the
pieces), negative cases, idempotence (fake process group); and the block passes on
data_parallel's own partitioned graphs."""

import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fcol

from compiled_hooks.compat import all_gather_single, reduce_scatter_single
from compiled_hooks.graph_contract import BLOCK, BUCKET_PACK, RANK_SUM
from passes import (
    all_gather_as_all_to_all,
    bucket_block_all_gathers,
    bucket_block_reduce_scatters,
    prefetch_block_all_gathers,
    reduce_scatter_as_all_to_all,
    schedule_collectives,
)
from passes.core.ops import ALL_GATHER, ALL_REDUCE, CAST_OPS, REDUCE_SCATTER
from passes.core.ops import ALL_TO_ALL as passes_ALL_TO_ALL
from passes.core.verify import check_rewrite, copy_graph
from passes.testing import gathered_bytes_alive, graph_str, trace
from tests.passcase import PassTestCase
from tests.ranks import run_ranks


def mark(gm, blocks):
    """Mark the graph's collectives, in order, with the blocks ``data_parallel`` would name."""
    colls = [n for n in gm.graph.nodes if n.target in (ALL_GATHER, REDUCE_SCATTER)]
    assert len(colls) == len(blocks)
    for node, block in zip(colls, blocks):
        if block is not None:
            node.meta["custom"] = {BLOCK: block}
    return gm


def gather_fn(a, b, c):
    """Three parameters' shards (two of block "0", one of block "1"), cast, gathered and used."""
    g = dist.group.WORLD
    fa = all_gather_single(a.to(torch.bfloat16), 0, g)[:3]
    x = torch.sin(fa)
    fb = all_gather_single(b.to(torch.bfloat16), 0, g)
    y = x.sum(0) * fb
    fc = all_gather_single(c.to(torch.bfloat16), 0, g)
    return y.sum() * fc


def gather_graph(blocks=("0", "0", "1")):
    _ = trace(lambda: None, world_size=2)
    return mark(
        trace(gather_fn, torch.randn(2, 4), torch.randn(2), torch.randn(3), world_size=2), blocks
    )


def reduce_fn(g1, g2, g3):
    """Three gradients through the bf16 hook's chain: pre-divide, cast, reduce-scatter, cast
    back."""
    g = dist.group.WORLD
    outs = [
        reduce_scatter_single((x / 2).to(torch.bfloat16).reshape(-1), "sum", 0, g).to(torch.float32)
        for x in (torch.sin(g1), torch.sin(g2), torch.sin(g3))
    ]
    return [o + 1 for o in outs]


def reduce_graph(blocks=("0", "0", "1")):
    _ = trace(lambda: None, world_size=2)
    return mark(
        trace(reduce_fn, torch.randn(4, 3), torch.randn(6), torch.randn(2, 2), world_size=2), blocks
    )


def hybrid_reduce_fn(g1, g2, g3, k):
    """Three gradients reduce-scattered, each result then all-reduced over the replicas as
    hybrid_shard's replica hook does (pre-divided by 2, or by ``k``, a non-constant factor, when
    given): the shape Inductor's post-grad graph has once its no-op copies are gone."""
    g = dist.group.WORLD
    outs = []
    for x in (torch.sin(g1), torch.sin(g2), torch.sin(g3)):
        shard = reduce_scatter_single((x / 2).reshape(-1), "sum", 0, g)
        outs.append(fcol.all_reduce(shard / (2 if k is None else k), "sum", g) + 1)
    return outs


def hybrid_reduce_graph(non_constant=False):
    """hybrid_reduce_fn's graph, each member's reduce-scatter and all-reduce marked with its
    block: two of block "0", one of block "1"."""
    _ = trace(lambda: None, world_size=2)
    args = [torch.randn(4, 3), torch.randn(6), torch.randn(2, 2)]
    fn = hybrid_reduce_fn if non_constant else (lambda *g: hybrid_reduce_fn(*g, None))
    gm = trace(fn, *args, *([torch.randn(())] if non_constant else []), world_size=2)
    colls = [n for n in gm.graph.nodes if n.target in (REDUCE_SCATTER, ALL_REDUCE)]
    for node, block in zip(colls, ["0", "0", "0", "0", "1", "1"], strict=True):
        node.meta["custom"] = {BLOCK: block}
    return gm


class TestBucketBlockAllGathers(PassTestCase):
    def test_one_all_gather_per_block_casts_in_the_bucket(self):
        gm = gather_graph()
        before = copy_graph(gm.graph)
        self.assertRewrites(gm, bucket_block_all_gathers)
        self.assertTrue(all("val" in n.meta for n in gm.graph.nodes if n.op == "call_function"))
        self.assertExpectedInline(
            graph_str(gm),
            """\
a_1: f32[2, 4] = input
b_1: f32[2] = input
c_1: f32[3] = input
convert_element_type: bf16[2, 4] = prims.convert_element_type(a_1, bf16)
convert_element_type_1: bf16[2] = prims.convert_element_type(b_1, bf16)
bucket_pack: bf16[10] = compiled_hooks.bucket_pack([convert_element_type, convert_element_type_1], 1)
bucket_all_gather: bf16[20] = c10d.all_gather_into_tensor(bucket_pack, 2, group(size=2))
bucket_wait: bf16[20] = c10d.wait_tensor(bucket_all_gather)
bucket_pieces: (bf16[16], bf16[4]) = compiled_hooks.bucket_unpack(bucket_wait, 2, [8, 2])
getitem: bf16[16] = getitem(bucket_pieces, 0)
reshape_default: bf16[4, 4] = aten.reshape(getitem, [4, 4])
getitem_1: bf16[4] = getitem(bucket_pieces, 1)
reshape_default_1: bf16[4] = aten.reshape(getitem_1, [4])
slice_copy: bf16[3, 4] = aten.slice_copy(reshape_default, 0, 0, 3)
sin: bf16[3, 4] = aten.sin(slice_copy)
sum_1: bf16[4] = aten.sum.dim_IntList(sin, [0])
mul: bf16[4] = aten.mul(sum_1, reshape_default_1)
convert_element_type_2: bf16[3] = prims.convert_element_type(c_1, bf16)
all_gather_into_tensor_2: bf16[6] = c10d.all_gather_into_tensor(convert_element_type_2, 2, group(size=2))
wait_tensor_2: bf16[6] = c10d.wait_tensor(all_gather_into_tensor_2)
sum_2: bf16[] = aten.sum(mul)
mul_1: bf16[6] = aten.mul(sum_2, wait_tensor_2)
return mul_1""",
        )
        self.assertTrue(check_rewrite("bucket_block_all_gathers", before, gm.graph))

    def test_unmarked_all_gathers_are_not_ours(self):
        gm = gather_graph(blocks=(None, None, None))
        text = graph_str(gm)
        self.assertFalse(bucket_block_all_gathers(gm.graph))
        self.assertEqual(graph_str(gm), text)

    def test_member_whose_input_needs_another_members_result_is_left_alone(self):
        def fn(a):
            g = dist.group.WORLD
            fa = all_gather_single(a, 0, g)
            return all_gather_single(fa[:2] * 2, 0, g)  # the second gathers what the first gave

        _ = trace(lambda: None, world_size=2)
        gm = mark(trace(fn, torch.randn(2), world_size=2), ["0", "0"])
        self.assertUntouched(gm, bucket_block_all_gathers, "a member's input is not ready")

    @staticmethod
    def late_input_graph(make_input):
        """Two members; the second's input, ``make_input(b)`` of a float64 ``b``, is computed
        after the first member's result is used, and is returned too (a user besides the
        all-gather, as where backward saves a shard's cast)."""

        def fn(a, b):
            g = dist.group.WORLD
            x = torch.sin(all_gather_single(a, 0, g))
            late = make_input(b)
            return x.sum() * all_gather_single(late, 0, g), late

        _ = trace(lambda: None, world_size=2)
        b = torch.randn(6, dtype=torch.float64)
        return mark(trace(fn, torch.randn(2), b, world_size=2), ["0", "0"])

    def test_a_cast_computed_later_moves_up_to_the_bucket(self):
        gm = self.late_input_graph(lambda b: b.float())
        before = copy_graph(gm.graph)
        self.assertRewrites(gm, bucket_block_all_gathers)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        [gather] = [n for n in gm.graph.nodes if n.target is ALL_GATHER]
        [cast] = [n for n in gm.graph.nodes if n.target in CAST_OPS]
        self.assertLess(order[cast], order[gather])
        self.assertEqual(len(cast.users), 2)  # the bucket's cat, and the output
        self.assertTrue(check_rewrite("bucket_block_all_gathers", before, gm.graph))

    def test_compute_computed_later_is_left_where_it_is(self):
        gm = self.late_input_graph(lambda b: b.cos().float())
        self.assertUntouched(gm, bucket_block_all_gathers, "a member's input is not ready")


class TestBucketBlockReduceScatters(PassTestCase):
    def test_one_reduce_scatter_per_block_rank_major(self):
        gm = reduce_graph()
        before = copy_graph(gm.graph)
        self.assertRewrites(gm, bucket_block_reduce_scatters)
        self.assertTrue(all("val" in n.meta for n in gm.graph.nodes if n.op == "call_function"))
        self.assertExpectedInline(
            graph_str(gm),
            """\
g1_1: f32[4, 3] = input
g2_1: f32[6] = input
g3_1: f32[2, 2] = input
sin: f32[4, 3] = aten.sin(g1_1)
sin_1: f32[6] = aten.sin(g2_1)
div: f32[4, 3] = aten.div(sin, 2)
convert_element_type: bf16[4, 3] = prims.convert_element_type(div, bf16)
view: bf16[12] = aten.view(convert_element_type, [-1])
div_1: f32[6] = aten.div(sin_1, 2)
convert_element_type_2: bf16[6] = prims.convert_element_type(div_1, bf16)
view_1: bf16[6] = aten.view(convert_element_type_2, [-1])
bucket_pack: bf16[18] = compiled_hooks.bucket_pack([view, view_1], 2)
bucket_reduce_scatter_tensor: bf16[9] = c10d.reduce_scatter_tensor(bucket_pack, 'sum', 2, group(size=2))
sin_2: f32[2, 2] = aten.sin(g3_1)
div_2: f32[2, 2] = aten.div(sin_2, 2)
convert_element_type_4: bf16[2, 2] = prims.convert_element_type(div_2, bf16)
view_2: bf16[4] = aten.view(convert_element_type_4, [-1])
reduce_scatter_tensor_2: bf16[2] = c10d.reduce_scatter_tensor(view_2, 'sum', 2, group(size=2))
wait_tensor_2: bf16[2] = c10d.wait_tensor(reduce_scatter_tensor_2)
convert_element_type_5: f32[2] = prims.convert_element_type(wait_tensor_2, f32)
bucket_wait: bf16[9] = c10d.wait_tensor(bucket_reduce_scatter_tensor)
bucket_pieces: (bf16[6], bf16[3]) = aten.split_with_sizes(bucket_wait, [6, 3])
getitem: bf16[6] = getitem(bucket_pieces, 0)
convert_element_type_1: f32[6] = prims.convert_element_type(getitem, f32)
getitem_1: bf16[3] = getitem(bucket_pieces, 1)
convert_element_type_3: f32[3] = prims.convert_element_type(getitem_1, f32)
add: f32[6] = aten.add(convert_element_type_1, 1)
add_1: f32[3] = aten.add(convert_element_type_3, 1)
add_2: f32[2] = aten.add(convert_element_type_5, 1)
return [add, add_1, add_2]""",
        )
        self.assertTrue(check_rewrite("bucket_block_reduce_scatters", before, gm.graph))

    def test_hybrid_shard_one_reduce_scatter_then_one_all_reduce_per_block(self):
        gm = hybrid_reduce_graph()
        before = copy_graph(gm.graph)
        self.assertRewrites(gm, bucket_block_reduce_scatters)
        self.assertExpectedInline(
            graph_str(gm),
            """\
arg0_1: f32[4, 3] = input
arg1_1: f32[6] = input
arg2_1: f32[2, 2] = input
sin: f32[4, 3] = aten.sin(arg0_1)
sin_1: f32[6] = aten.sin(arg1_1)
div: f32[4, 3] = aten.div(sin, 2)
view: f32[12] = aten.view(div, [-1])
div_2: f32[6] = aten.div(sin_1, 2)
view_1: f32[6] = aten.view(div_2, [-1])
bucket_pack: f32[18] = compiled_hooks.bucket_pack([view, view_1], 2)
bucket_reduce_scatter_tensor: f32[9] = c10d.reduce_scatter_tensor(bucket_pack, 'sum', 2, group(size=2))
sin_2: f32[2, 2] = aten.sin(arg2_1)
div_4: f32[2, 2] = aten.div(sin_2, 2)
view_2: f32[4] = aten.view(div_4, [-1])
reduce_scatter_tensor_2: f32[2] = c10d.reduce_scatter_tensor(view_2, 'sum', 2, group(size=2))
wait_tensor_4: f32[2] = c10d.wait_tensor(reduce_scatter_tensor_2)
div_5: f32[2] = aten.div(wait_tensor_4, 2)
bucket_wait: f32[9] = c10d.wait_tensor(bucket_reduce_scatter_tensor)
bucket_pieces: (f32[6], f32[3]) = aten.split_with_sizes(bucket_wait, [6, 3])
getitem: f32[6] = getitem(bucket_pieces, 0)
getitem_1: f32[3] = getitem(bucket_pieces, 1)
div_1: f32[6] = aten.div(getitem, 2)
div_3: f32[3] = aten.div(getitem_1, 2)
bucket_pack_1: f32[9] = compiled_hooks.bucket_pack([div_1, div_3], 1)
bucket_all_reduce: f32[9] = c10d.all_reduce(bucket_pack_1, 'sum', group(size=2))
all_reduce_2: f32[2] = c10d.all_reduce(div_5, 'sum', group(size=2))
wait_tensor_5: f32[2] = c10d.wait_tensor(all_reduce_2)
bucket_wait_1: f32[9] = c10d.wait_tensor(bucket_all_reduce)
bucket_pieces_1: (f32[6], f32[3]) = aten.split_with_sizes(bucket_wait_1, [6, 3])
getitem_2: f32[6] = getitem(bucket_pieces_1, 0)
getitem_3: f32[3] = getitem(bucket_pieces_1, 1)
add: f32[6] = aten.add(getitem_2, 1)
add_1: f32[3] = aten.add(getitem_3, 1)
add_2: f32[2] = aten.add(wait_tensor_5, 1)
return [add, add_1, add_2]""",
        )
        self.assertTrue(check_rewrite("bucket_block_reduce_scatters", before, gm.graph))

    def test_hybrid_shard_replica_chain_with_a_non_constant_factor_is_left_alone(self):
        """The replica hook's division by a traced value: in the graph Inductor's passes see it
        follows the reduce-scatter's wait directly, so both chains carry a non-constant factor
        and neither moves."""
        gm = hybrid_reduce_graph(non_constant=True)
        self.assertUntouched(gm, bucket_block_reduce_scatters, "non-constant factor")

    def test_non_constant_factor_is_left_alone(self):
        def fn(g1, g2, k):
            g = dist.group.WORLD
            return [
                reduce_scatter_single((x / k).reshape(-1), "sum", 0, g)
                for x in (torch.sin(g1), torch.sin(g2))
            ]

        _ = trace(lambda: None, world_size=2)
        gm = mark(
            trace(fn, torch.randn(4), torch.randn(2), torch.randn(()), world_size=2), ["0", "0"]
        )
        self.assertUntouched(gm, bucket_block_reduce_scatters, "non-constant factor")

    def test_block_of_one_member_is_waited_after_the_next_blocks_gradient(self):
        """A block with one reduce-scatter (the root's own parameter, say) whose result is used
        right away: the use moves to the outputs as a bucket's would, so schedule_collectives
        waits for it after the next block's gradient, not before (which would hold back every
        later collective in Inductor's schedule)."""

        def fn(g1, g2):
            g = dist.group.WORLD
            first = reduce_scatter_single(torch.sin(g1), "sum", 0, g) + 1
            second = reduce_scatter_single(torch.sin(g2), "sum", 0, g)
            return first, second

        _ = trace(lambda: None, world_size=2)
        gm = mark(trace(fn, torch.randn(4), torch.randn(4), world_size=2), ["root", "0"])
        self.assertRewrites(gm, bucket_block_reduce_scatters)
        schedule_collectives(gm.graph)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        first, second = [n for n in gm.graph.nodes if n.target is REDUCE_SCATTER]
        self.assertLess(order[second], order[next(iter(first.users))], graph_str(gm))


def chain_fn(a, b, c):
    """Three blocks used in turn, their all-gathers all at the top (as schedule_collectives leaves
    them)."""
    g = dist.group.WORLD
    fa, fb, fc = (all_gather_single(t, 0, g) for t in (a, b, c))
    x = torch.sin(fa)
    x = torch.sin(x * fb)
    return torch.sin(x * fc)


class TestPrefetchBlockAllGathers(PassTestCase):
    def graph(self):
        _ = trace(lambda: None, world_size=2)
        gm = mark(
            trace(chain_fn, torch.randn(4), torch.randn(4), torch.randn(4), world_size=2),
            ["a", "b", "c"],
        )
        schedule_collectives(gm.graph)  # what the pipeline runs first: waits at their uses
        return gm

    def test_each_block_goes_out_one_block_ahead(self):
        gm = self.graph()
        before = copy_graph(gm.graph)
        peak = max(gathered_bytes_alive(gm.graph))
        self.assertRewrites(gm, prefetch_block_all_gathers)
        self.assertExpectedInline(
            graph_str(gm),
            """\
a_1: f32[4] = input
b_1: f32[4] = input
c_1: f32[4] = input
all_gather_into_tensor: f32[8] = c10d.all_gather_into_tensor(a_1, 2, group(size=2))
all_gather_into_tensor_1: f32[8] = c10d.all_gather_into_tensor(b_1, 2, group(size=2))
wait_tensor: f32[8] = c10d.wait_tensor(all_gather_into_tensor)
sin: f32[8] = aten.sin(wait_tensor)
all_gather_into_tensor_2: f32[8] = c10d.all_gather_into_tensor(c_1, 2, group(size=2))
wait_tensor_1: f32[8] = c10d.wait_tensor(all_gather_into_tensor_1)
mul: f32[8] = aten.mul(sin, wait_tensor_1)
sin_1: f32[8] = aten.sin(mul)
wait_tensor_2: f32[8] = c10d.wait_tensor(all_gather_into_tensor_2)
mul_1: f32[8] = aten.mul(sin_1, wait_tensor_2)
sin_2: f32[8] = aten.sin(mul_1)
return sin_2""",
        )
        self.assertLess(max(gathered_bytes_alive(gm.graph)), peak)
        self.assertTrue(check_rewrite("prefetch_block_all_gathers", before, gm.graph))

    def test_depth_two_sends_all_three_before_the_first_wait(self):
        gm = self.graph()  # three blocks: while the first computes, the other two are in flight
        self.assertFalse(prefetch_block_all_gathers(gm.graph, prefetch_depth=2))
        order = [
            n.name for n in gm.graph.nodes if n.op == "call_function" and "c10d" in str(n.target)
        ]
        self.assertEqual(
            order,
            [
                "all_gather_into_tensor",
                "all_gather_into_tensor_1",
                "all_gather_into_tensor_2",
                "wait_tensor",
                "wait_tensor_1",
                "wait_tensor_2",
            ],
        )

    def test_bad_depth(self):
        with pytest.raises(ValueError, match="prefetch_depth must be an int >= 1"):
            prefetch_block_all_gathers(self.graph().graph, prefetch_depth=0)

    def test_a_gather_the_graph_returns_goes_out_first(self):
        """Block "b"'s gathered parameters are returned (kept for backward): alive to the end
        anyway, its all-gather goes out before the first wait; "a", "c" and "d" keep depth 1
        among themselves ("c" while "a" computes, "d" while "c" does)."""
        _ = trace(lambda: None, world_size=2)
        gm = mark(
            trace(kept_fn, *(torch.randn(4) for _ in range(4)), world_size=2), ["a", "b", "c", "d"]
        )
        schedule_collectives(gm.graph)
        before = copy_graph(gm.graph)
        self.assertRewrites(gm, prefetch_block_all_gathers)
        self.assertExpectedInline(
            graph_str(gm),
            """\
a_1: f32[4] = input
b_1: f32[4] = input
c_1: f32[4] = input
d_1: f32[4] = input
all_gather_into_tensor: f32[8] = c10d.all_gather_into_tensor(a_1, 2, group(size=2))
all_gather_into_tensor_1: f32[8] = c10d.all_gather_into_tensor(b_1, 2, group(size=2))
all_gather_into_tensor_2: f32[8] = c10d.all_gather_into_tensor(c_1, 2, group(size=2))
wait_tensor: f32[8] = c10d.wait_tensor(all_gather_into_tensor)
sin: f32[8] = aten.sin(wait_tensor)
wait_tensor_1: f32[8] = c10d.wait_tensor(all_gather_into_tensor_1)
mul: f32[8] = aten.mul(sin, wait_tensor_1)
sin_1: f32[8] = aten.sin(mul)
all_gather_into_tensor_3: f32[8] = c10d.all_gather_into_tensor(d_1, 2, group(size=2))
wait_tensor_2: f32[8] = c10d.wait_tensor(all_gather_into_tensor_2)
mul_1: f32[8] = aten.mul(sin_1, wait_tensor_2)
sin_2: f32[8] = aten.sin(mul_1)
wait_tensor_3: f32[8] = c10d.wait_tensor(all_gather_into_tensor_3)
mul_2: f32[8] = aten.mul(sin_2, wait_tensor_3)
sin_3: f32[8] = aten.sin(mul_2)
return [sin_3, wait_tensor_1]""",
        )
        self.assertTrue(check_rewrite("prefetch_block_all_gathers", before, gm.graph))


def kept_fn(a, b, c, d):
    """Four blocks, each gathered right before its use; the graph returns block "b"'s gathered
    value, as a forward without ``reshard_after_forward`` returns what backward reads."""
    g = dist.group.WORLD
    x = torch.sin(all_gather_single(a, 0, g))
    fb = all_gather_single(b, 0, g)
    x = torch.sin(x * fb)
    x = torch.sin(x * all_gather_single(c, 0, g))
    return torch.sin(x * all_gather_single(d, 0, g)), fb


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_data_parallel_forward_gathers_one_block_ahead_or_all_first(reshard):
    """data_parallel's partitioned forward of an MLP (fp32, 2 fake ranks): resharding, each
    block's gather goes out one block ahead (the shard views the graph also saves for the
    backward's re-gather move up with it); keeping the gathered parameters, every gather goes
    out before the first wait."""
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    from compiled_hooks.fsdp import data_parallel
    from passes.testing import fake_process_group
    from tests.graphs import data_parallel_graphs, mlp

    fake_process_group(2)
    net = mlp()
    blocks = [m for m in net if isinstance(m, torch.nn.Linear)]
    model = data_parallel(
        net, init_device_mesh("cpu", (2,)), reshard_after_forward=reshard, blocks=blocks
    )
    (kind, gm), *_ = data_parallel_graphs(model, torch.randn(8, 64))
    assert kind == "forward"
    counters["passes"].clear()
    for graph_pass in (
        bucket_block_all_gathers,
        schedule_collectives,
        prefetch_block_all_gathers,
    ):
        graph_pass(gm.graph)
    order = "".join(
        "G" if n.target is ALL_GATHER else "w" if "wait" in str(n.target) else "m"
        for n in gm.graph.nodes
        if n.target is ALL_GATHER or "wait" in str(n.target) or "addmm" in str(n.target)
    )
    assert order == ("GGwmGwmGwmwm" if reshard else "GGGGwmwmwmwm"), order
    assert not [k for k in counters["passes"] if "skipped" in k], dict(counters["passes"])


def test_data_parallel_graphs_one_collective_per_block_and_bounded_memory():
    """The passes on data_parallel's partitioned forward and backward (reshard_after_forward,
    4 fake ranks): one all-gather per block each way, one reduce-scatter per block, at most the
    root and two blocks' gathered parameters alive (prefetch depth 1), the same values."""
    from torch.distributed.device_mesh import init_device_mesh

    import passes
    from compiled_hooks.fsdp import data_parallel
    from passes.testing import fake_process_group
    from tests.fsdp.test_data_parallel import BF16, DIM, HIDDEN, VOCAB, Net
    from tests.graphs import data_parallel_graphs, gather_reduce_counts

    fake_process_group(4)
    model = data_parallel(Net(), init_device_mesh("cpu", (4,)), mp_policy=BF16)
    counts = {}
    for kind, gm in data_parallel_graphs(model, torch.randint(0, VOCAB, (4, 6))):
        before = copy_graph(gm.graph)
        for graph_pass in (
            passes.fold_collective_scaling,
            bucket_block_all_gathers,
            bucket_block_reduce_scatters,
            schedule_collectives,
            prefetch_block_all_gathers,
        ):
            graph_pass(gm.graph)
        gm.graph.lint()
        assert check_rewrite(kind, before, gm.graph)
        counts[kind] = gather_reduce_counts(gm)
        rows = lambda r: -(-r // 4) * 4  # noqa: E731 - padded rows
        root = rows(VOCAB) * DIM * 2
        block = (rows(HIDDEN) * (DIM + 1) + rows(DIM) * (HIDDEN + 1)) * 2
        assert max(gathered_bytes_alive(gm.graph)) <= root + 2 * block, kind
    assert counts == {"forward": [3, 0], "backward": [3, 3]}


@pytest.mark.slow  # a dozen seconds: the verifier on both partitioned graphs
def test_data_parallel_int8_graphs_one_collective_per_block_issued_ahead():
    """int8 weight gathers and the int8 hook on data_parallel's partitioned graphs (4 fake
    ranks): the quantize moves with its gather into the block's bucket (its scales feed two
    nodes of the cone), so each block's one int8 all-gather goes out while the block before it
    computes; each block's gradients go out as one int8 all-to-all; the same values."""
    from torch.distributed.device_mesh import init_device_mesh

    import compiled_hooks as ch
    import passes
    from compiled_hooks.fsdp import data_parallel, register_comm_hook
    from passes.testing import fake_process_group
    from tests.fsdp.test_data_parallel import BF16, VOCAB, Net
    from tests.graphs import data_parallel_graphs

    fake_process_group(4)
    mesh = init_device_mesh("cpu", (4,))
    model = data_parallel(Net(), mesh, mp_policy=BF16, gather_dtype=torch.int8)
    register_comm_hook(model, ch.QuantizedState(mesh.get_group(0)), ch.int8_compress_hook)
    counts = {}
    for kind, gm in data_parallel_graphs(model, torch.randint(0, VOCAB, (4, 6))):
        before = copy_graph(gm.graph)
        for graph_pass in (
            bucket_block_all_gathers,
            passes.bucket_quantized_collectives,
            schedule_collectives,
            prefetch_block_all_gathers,
        ):
            graph_pass(gm.graph)
        gm.graph.lint()
        assert check_rewrite(kind, before, gm.graph)
        nodes = list(gm.graph.nodes)
        gathers = [n for n in nodes if n.target is ALL_GATHER]
        assert all(n.args[0].meta["val"].dtype == torch.int8 for n in gathers)
        waits = sorted((next(iter(n.users)) for n in gathers), key=nodes.index)
        for gather, wait in zip(sorted(gathers, key=lambda n: nodes.index(*n.users))[1:], waits):
            assert nodes.index(gather) < nodes.index(wait), kind  # out a block ahead
        counts[kind] = [len(gathers), sum(n.target is passes_ALL_TO_ALL for n in nodes)]
    assert counts == {"forward": [3, 0], "backward": [3, 3]}


class TestReduceScatterAsAllToAll(PassTestCase):
    def graph(self, op="avg"):
        _ = trace(lambda: None, world_size=2)
        return trace(
            lambda x: (
                reduce_scatter_single(x.to(torch.bfloat16), op, 0, dist.group.WORLD).float() + 1
            ),
            torch.randn(4, 3),
            world_size=2,
        )

    def test_all_to_all_and_a_sum_in_fp32(self):
        gm = self.graph()
        before = copy_graph(gm.graph)
        self.assertRewrites(gm, reduce_scatter_as_all_to_all, reduce_scatter_backends={"fake"})
        self.assertExpectedInline(
            graph_str(gm),
            """\
x_1: f32[4, 3] = input
convert_element_type: bf16[4, 3] = prims.convert_element_type(x_1, bf16)
all_to_all_single_default: bf16[4, 3] = c10d.all_to_all_single(convert_element_type, [2, 2], [2, 2], group(size=2))
wait_tensor_default: bf16[4, 3] = c10d.wait_tensor(all_to_all_single_default)
rank_sum_default: bf16[2, 3] = compiled_hooks.rank_sum(wait_tensor_default, 2, 2)
convert_element_type_1: f32[2, 3] = prims.convert_element_type(rank_sum_default, f32)
add: f32[2, 3] = aten.add(convert_element_type_1, 1)
return add""",
        )
        self.assertTrue(check_rewrite("reduce_scatter_as_all_to_all", before, gm.graph))

    def divided(self, divisor, read_elsewhere=False):
        """An fp32 reduce-scatter (sum) of ``x / divisor``, a hook's pre-division."""
        _ = trace(lambda: None, world_size=2)

        def step(x):
            d = x / divisor
            out = reduce_scatter_single(d, "sum", 0, dist.group.WORLD) + 1
            return (out, d.sum()) if read_elsewhere else out

        return trace(step, torch.randn(4, 3), world_size=2)

    def test_a_division_by_a_power_of_two_goes_into_the_sum(self):
        gm = self.divided(4.0)
        before = copy_graph(gm.graph)
        self.assertRewrites(gm, reduce_scatter_as_all_to_all, reduce_scatter_backends={"fake"})
        self.assertExpectedInline(
            graph_str(gm),
            """\
x_1: f32[4, 3] = input
all_to_all_single_default: f32[4, 3] = c10d.all_to_all_single(x_1, [2, 2], [2, 2], group(size=2))
wait_tensor_default: f32[4, 3] = c10d.wait_tensor(all_to_all_single_default)
rank_sum_default: f32[2, 3] = compiled_hooks.rank_sum(wait_tensor_default, 2, 1, 4)
add: f32[2, 3] = aten.add(rank_sum_default, 1)
return add""",
        )
        self.assertTrue(check_rewrite("reduce_scatter_as_all_to_all", before, gm.graph))

    def test_other_divisions_stay_with_the_senders(self):
        """By 3 or by 0.5 (inexact or not a division in the sum), or read by another node too."""
        for gm in (self.divided(3.0), self.divided(0.5), self.divided(2.0, read_elsewhere=True)):
            self.assertRewrites(gm, reduce_scatter_as_all_to_all, reduce_scatter_backends={"fake"})
            ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
            self.assertIn(torch.ops.aten.div.Tensor, ops)
            (rank_sum,) = gm.graph.find_nodes(op="call_function", target=RANK_SUM)
            self.assertEqual(rank_sum.args[1:], (2, 1))

    def test_other_backends_and_ops_are_left_alone(self):
        self.assertUntouched(self.graph(), reduce_scatter_as_all_to_all, "backend fake")
        self.assertUntouched(
            self.graph("max"),
            reduce_scatter_as_all_to_all,
            "reduce op max",
            reduce_scatter_backends={"fake"},
        )

    def test_in_pieces_each_summed_after_its_wait(self):
        """Two rows of 3 bf16 per destination, at most 6 bytes a piece: one all_to_all per row
        of every rank's block, each summed in fp32 right after its wait, the sums joined."""
        gm = self.graph()
        before = copy_graph(gm.graph)
        self.assertRewrites(
            gm,
            reduce_scatter_as_all_to_all,
            reduce_scatter_backends={"fake"},
            all_to_all_chunk_bytes=6,
        )
        self.assertExpectedInline(
            graph_str(gm),
            """\
x_1: f32[4, 3] = input
convert_element_type: bf16[4, 3] = prims.convert_element_type(x_1, bf16)
view_default: bf16[12] = aten.view(convert_element_type, [-1])
bucket_unpack_default: (bf16[6], bf16[6]) = compiled_hooks.bucket_unpack(view_default, 2, [3, 3])
getitem: bf16[6] = getitem(bucket_unpack_default, 0)
view_default_1: bf16[2, 3] = aten.view(getitem, [2, 3])
all_to_all_single_default: bf16[2, 3] = c10d.all_to_all_single(view_default_1, [1, 1], [1, 1], group(size=2))
getitem_1: bf16[6] = getitem(bucket_unpack_default, 1)
view_default_2: bf16[2, 3] = aten.view(getitem_1, [2, 3])
all_to_all_single_default_1: bf16[2, 3] = c10d.all_to_all_single(view_default_2, [1, 1], [1, 1], group(size=2))
wait_tensor_default: bf16[2, 3] = c10d.wait_tensor(all_to_all_single_default)
rank_sum_default: bf16[1, 3] = compiled_hooks.rank_sum(wait_tensor_default, 2, 2)
wait_tensor_default_1: bf16[2, 3] = c10d.wait_tensor(all_to_all_single_default_1)
rank_sum_default_1: bf16[1, 3] = compiled_hooks.rank_sum(wait_tensor_default_1, 2, 2)
bucket_pack_default: bf16[6] = compiled_hooks.bucket_pack([rank_sum_default, rank_sum_default_1], 1)
view_default_3: bf16[2, 3] = aten.view(bucket_pack_default, [2, 3])
convert_element_type_1: f32[2, 3] = prims.convert_element_type(view_default_3, f32)
add: f32[2, 3] = aten.add(convert_element_type_1, 1)
return add""",
        )
        self.assertTrue(check_rewrite("reduce_scatter_as_all_to_all", before, gm.graph))


class TestAllGatherAsAllToAll(PassTestCase):
    def test_a_bucket_is_packed_once(self):
        """A flat bucket that only the all_gather reads: its pieces packed N times in one copy,
        and the bucket's own pack gone; a bucket read by anything else is copied N times."""
        _ = trace(lambda: None, world_size=2)

        def gather(a, b):
            return all_gather_single(BUCKET_PACK([a, b], 1), 0, dist.group.WORLD)

        def gather_and_read(a, b):
            bucket = BUCKET_PACK([a, b], 1)
            return all_gather_single(bucket, 0, dist.group.WORLD), bucket * 2

        x, y = torch.randn(2), torch.randn(3, 1)
        gm = trace(gather, x, y, world_size=2)
        before = copy_graph(gm.graph)
        self.assertRewrites(gm, all_gather_as_all_to_all, all_gather_backends={"fake"})
        self.assertExpectedInline(
            graph_str(gm),
            """\
a_1: f32[2] = input
b_1: f32[3, 1] = input
bucket_pack_default: f32[10] = compiled_hooks.bucket_pack([a_1, b_1, a_1, b_1], 1)
view_default: f32[10] = aten.view(bucket_pack_default, [10])
all_to_all_single_default: f32[10] = c10d.all_to_all_single(view_default, [5, 5], [5, 5], group(size=2))
wait_tensor: f32[10] = c10d.wait_tensor(all_to_all_single_default)
return wait_tensor""",
        )
        self.assertTrue(check_rewrite("all_gather_as_all_to_all", before, gm.graph))
        gm = trace(gather_and_read, x, y, world_size=2)
        all_gather_as_all_to_all(gm.graph, all_gather_backends={"fake"})
        packs = [n.args[0] for n in gm.graph.nodes if n.target is BUCKET_PACK]
        self.assertEqual([len(p) for p in packs], [2, 2])


class TestAllGatherAsAllToAllInPieces(PassTestCase):
    def test_pieces_joined_rank_major(self):
        """Three rows of 2 floats, at most 8 bytes a piece: three all_to_alls of N copies of one
        row each, waited for where the all_gather's wait was, joined back rank-major."""
        _ = trace(lambda: None, world_size=2)
        gm = trace(
            lambda x: all_gather_single(x, 0, dist.group.WORLD) * 2, torch.randn(3, 2), world_size=2
        )
        before = copy_graph(gm.graph)
        self.assertRewrites(
            gm, all_gather_as_all_to_all, all_gather_backends={"fake"}, all_to_all_chunk_bytes=8
        )
        self.assertExpectedInline(
            graph_str(gm),
            """\
x_1: f32[3, 2] = input
slice_tensor: f32[1, 2] = aten.slice(x_1, 0, 0, 1)
bucket_pack_default: f32[4] = compiled_hooks.bucket_pack([slice_tensor, slice_tensor], 1)
view_default: f32[2, 2] = aten.view(bucket_pack_default, [2, 2])
all_to_all_single_default: f32[2, 2] = c10d.all_to_all_single(view_default, [1, 1], [1, 1], group(size=2))
slice_tensor_1: f32[1, 2] = aten.slice(x_1, 0, 1, 2)
bucket_pack_default_1: f32[4] = compiled_hooks.bucket_pack([slice_tensor_1, slice_tensor_1], 1)
view_default_1: f32[2, 2] = aten.view(bucket_pack_default_1, [2, 2])
all_to_all_single_default_1: f32[2, 2] = c10d.all_to_all_single(view_default_1, [1, 1], [1, 1], group(size=2))
slice_tensor_2: f32[1, 2] = aten.slice(x_1, 0, 2, 3)
bucket_pack_default_2: f32[4] = compiled_hooks.bucket_pack([slice_tensor_2, slice_tensor_2], 1)
view_default_2: f32[2, 2] = aten.view(bucket_pack_default_2, [2, 2])
all_to_all_single_default_2: f32[2, 2] = c10d.all_to_all_single(view_default_2, [1, 1], [1, 1], group(size=2))
wait_tensor_default: f32[2, 2] = c10d.wait_tensor(all_to_all_single_default)
wait_tensor_default_1: f32[2, 2] = c10d.wait_tensor(all_to_all_single_default_1)
wait_tensor_default_2: f32[2, 2] = c10d.wait_tensor(all_to_all_single_default_2)
bucket_pack_default_3: f32[12] = compiled_hooks.bucket_pack([wait_tensor_default, wait_tensor_default_1, wait_tensor_default_2], 2)
view_default_3: f32[6, 2] = aten.view(bucket_pack_default_3, [6, 2])
mul: f32[6, 2] = aten.mul(view_default_3, 2)
return mul""",
        )
        self.assertTrue(check_rewrite("all_gather_as_all_to_all", before, gm.graph))

    def test_chunk_size_must_be_positive(self):
        with self.assertRaisesRegex(
            ValueError, "all_gather_as_all_to_all: all_to_all_chunk_bytes must be a positive"
        ):
            all_gather_as_all_to_all(gather_graph().graph, all_to_all_chunk_bytes=0)

    def test_default_pieces_follow_the_hosts(self):
        """By default 800 KB per destination go out in two pieces where the ranks span hosts or
        the launcher does not say, and in one all_to_all where torchrun says they share one."""
        x = torch.randn(200_000)
        for env, pieces in (
            ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, 1),
            ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}, 2),
            ({}, 2),
        ):
            with self.subTest(env=env), mock.patch.dict(os.environ):
                for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
                    os.environ.pop(name, None)
                os.environ.update(env)
                gm = trace(lambda x: all_gather_single(x, 0, dist.group.WORLD), x, world_size=2)
                all_gather_as_all_to_all(gm.graph, all_gather_backends={"fake"})
                self.assertEqual(sum(n.target is passes_ALL_TO_ALL for n in gm.graph.nodes), pieces)


def pieces_worker(rank, world_size):
    """A bucket-sized all-gather and reduce-scatter on real gloo ranks, before and after the
    rewrites in pieces (several all_to_alls in flight at once)."""
    g = dist.group.WORLD

    def fn(a, b):
        gathered = all_gather_single(a.to(torch.bfloat16), 0, g)
        reduced = reduce_scatter_single(b.to(torch.bfloat16), "sum", 0, g).float()
        return gathered, reduced

    gen = torch.Generator().manual_seed(rank)
    a, b = torch.randn(1000, 3, generator=gen), torch.randn(2000, 3, generator=gen)
    gm = trace(fn, a, b, world_size=None)
    expected = gm(a, b)
    changed = [
        all_gather_as_all_to_all(gm.graph, all_to_all_chunk_bytes=1000),
        reduce_scatter_as_all_to_all(gm.graph, all_to_all_chunk_bytes=1000),
    ]
    gm.recompile()
    pieces = sum(n.target is passes_ALL_TO_ALL for n in gm.graph.nodes)
    got = [gm(a, b) for _ in range(3)]
    return changed, pieces, [all(torch.equal(x, y) for x, y in zip(expected, out)) for out in got]


def test_pieces_on_gloo_equal_the_collectives_bitwise():
    for changed, pieces, equal in run_ranks(pieces_worker, 2):
        # 1000 rows of 6 bytes per destination, at most 166 rows a piece: 7 pieces each
        assert changed == [True, True] and pieces == 14, (changed, pieces)
        assert all(equal), equal
