"""fold_collective_scaling: snapshots, negative cases, idempotence (fake process group)."""

import torch
import torch.distributed as dist

from passes import fold_collective_scaling
from passes.testing import graph_str, trace
from tests.graphs import ddp_args, ddp_fn, hook_args, hook_fn
from tests.passcase import PassTestCase


class TestFold(PassTestCase):
    def trace_hook(self, kind, sharded, world_size=8):
        # make the group first: the hook's state reads it
        _ = trace(lambda: None, world_size=world_size)
        return trace(hook_fn(kind, sharded), *hook_args(sharded, world_size), world_size=world_size)

    def test_bf16_all_reduce_becomes_avg(self):
        gm = self.trace_hook("bf16", sharded=False)
        self.assertExpectedInline(
            graph_str(gm),
            """\
grad_1: f32[16] = input
div: f32[16] = aten.div(grad_1, 4.0)
convert_element_type: bf16[16] = prims.convert_element_type(div, bf16)
all_reduce: bf16[16] = c10d.all_reduce(convert_element_type, 'sum', group(size=8))
wait_tensor: bf16[16] = c10d.wait_tensor(all_reduce)
div_1: bf16[16] = aten.div(wait_tensor, 2.0)
convert_element_type_1: f32[16] = prims.convert_element_type(div_1, f32)
copy_: f32[16] = aten.copy_(grad_1, convert_element_type_1)
return convert_element_type_1""",
        )
        self.assertRewrites(gm, fold_collective_scaling)
        self.assertExpectedInline(
            graph_str(gm),
            """\
grad_1: f32[16] = input
convert_element_type: bf16[16] = prims.convert_element_type(grad_1, bf16)
all_reduce: bf16[16] = c10d.all_reduce(convert_element_type, 'avg', group(size=8))
wait_tensor: bf16[16] = c10d.wait_tensor(all_reduce)
convert_element_type_1: f32[16] = prims.convert_element_type(wait_tensor, f32)
copy_: f32[16] = aten.copy_(grad_1, convert_element_type_1)
return convert_element_type_1""",
        )

    def test_fp32_all_reduce_becomes_avg(self):
        gm = self.trace_hook("fp32", sharded=False)
        self.assertExpectedInline(
            graph_str(gm),
            """\
grad_1: f32[16] = input
div: f32[16] = aten.div(grad_1, 4.0)
all_reduce: f32[16] = c10d.all_reduce(div, 'sum', group(size=8))
wait_tensor: f32[16] = c10d.wait_tensor(all_reduce)
div_1: f32[16] = aten.div(wait_tensor, 2.0)
copy_: f32[16] = aten.copy_(grad_1, div_1)
return div_1""",
        )
        self.assertRewrites(gm, fold_collective_scaling)
        self.assertExpectedInline(
            graph_str(gm),
            """\
grad_1: f32[16] = input
all_reduce: f32[16] = c10d.all_reduce(grad_1, 'avg', group(size=8))
wait_tensor: f32[16] = c10d.wait_tensor(all_reduce)
copy_: f32[16] = aten.copy_(grad_1, wait_tensor)
return wait_tensor""",
        )

    def test_bf16_reduce_scatter_becomes_avg(self):
        gm = self.trace_hook("bf16", sharded=True)
        self.assertExpectedInline(
            graph_str(gm),
            """\
grad_1: f32[128] = input
output_1: f32[16] = input
div: f32[128] = aten.div(grad_1, 4.0)
convert_element_type: bf16[128] = prims.convert_element_type(div, bf16)
view: bf16[128] = aten.view(convert_element_type, [-1])
reduce_scatter_tensor: bf16[16] = c10d.reduce_scatter_tensor(view, 'sum', 8, group(size=8))
wait_tensor: bf16[16] = c10d.wait_tensor(reduce_scatter_tensor)
div_1: bf16[16] = aten.div(wait_tensor, 2.0)
convert_element_type_1: f32[16] = prims.convert_element_type(div_1, f32)
copy_: f32[16] = aten.copy_(output_1, convert_element_type_1)
return convert_element_type_1""",
        )
        self.assertRewrites(gm, fold_collective_scaling)
        self.assertExpectedInline(
            graph_str(gm),
            """\
grad_1: f32[128] = input
output_1: f32[16] = input
convert_element_type: bf16[128] = prims.convert_element_type(grad_1, bf16)
view: bf16[128] = aten.view(convert_element_type, [-1])
reduce_scatter_tensor: bf16[16] = c10d.reduce_scatter_tensor(view, 'avg', 8, group(size=8))
wait_tensor: bf16[16] = c10d.wait_tensor(reduce_scatter_tensor)
convert_element_type_1: f32[16] = prims.convert_element_type(wait_tensor, f32)
copy_: f32[16] = aten.copy_(output_1, convert_element_type_1)
return convert_element_type_1""",
        )

    def test_fp32_reduce_scatter_becomes_avg(self):
        gm = self.trace_hook("fp32", sharded=True)
        self.assertExpectedInline(
            graph_str(gm),
            """\
grad_1: f32[128] = input
output_1: f32[16] = input
div: f32[128] = aten.div(grad_1, 4.0)
view: f32[128] = aten.view(div, [-1])
reduce_scatter_tensor: f32[16] = c10d.reduce_scatter_tensor(view, 'sum', 8, group(size=8))
wait_tensor: f32[16] = c10d.wait_tensor(reduce_scatter_tensor)
div_1: f32[16] = aten.div(wait_tensor, 2.0)
copy_: f32[16] = aten.copy_(output_1, div_1)
return div_1""",
        )
        self.assertRewrites(gm, fold_collective_scaling)
        self.assertExpectedInline(
            graph_str(gm),
            """\
grad_1: f32[128] = input
output_1: f32[16] = input
view: f32[128] = aten.view(grad_1, [-1])
reduce_scatter_tensor: f32[16] = c10d.reduce_scatter_tensor(view, 'avg', 8, group(size=8))
wait_tensor: f32[16] = c10d.wait_tensor(reduce_scatter_tensor)
copy_: f32[16] = aten.copy_(output_1, wait_tensor)
return wait_tensor""",
        )

    def test_ddp_shaped_bf16_world_2(self):
        _ = trace(lambda: None, world_size=2)
        gm = trace(ddp_fn("bf16"), *ddp_args([(3, 4), (5,)]), world_size=2)
        self.assertExpectedInline(
            graph_str(gm),
            """\
arg0_1: f32[3, 4] = input
arg1_1: f32[5] = input
sin: f32[3, 4] = aten.sin(arg0_1)
div: f32[3, 4] = aten.div(sin, 2.0)
convert_element_type: bf16[3, 4] = prims.convert_element_type(div, bf16)
all_reduce: bf16[3, 4] = c10d.all_reduce(convert_element_type, 'sum', group(size=2))
wait_tensor: bf16[3, 4] = c10d.wait_tensor(all_reduce)
convert_element_type_1: f32[3, 4] = prims.convert_element_type(wait_tensor, f32)
sin_1: f32[5] = aten.sin(arg1_1)
div_1: f32[5] = aten.div(sin_1, 2.0)
convert_element_type_2: bf16[5] = prims.convert_element_type(div_1, bf16)
all_reduce_1: bf16[5] = c10d.all_reduce(convert_element_type_2, 'sum', group(size=2))
wait_tensor_1: bf16[5] = c10d.wait_tensor(all_reduce_1)
convert_element_type_3: f32[5] = prims.convert_element_type(wait_tensor_1, f32)
copy_: f32[3, 4] = aten.copy_(arg0_1, convert_element_type_1)
copy__1: f32[5] = aten.copy_(arg1_1, convert_element_type_3)
return [convert_element_type_1, convert_element_type_3]""",
        )
        self.assertRewrites(gm, fold_collective_scaling)
        self.assertExpectedInline(
            graph_str(gm),
            """\
arg0_1: f32[3, 4] = input
arg1_1: f32[5] = input
sin: f32[3, 4] = aten.sin(arg0_1)
convert_element_type: bf16[3, 4] = prims.convert_element_type(sin, bf16)
all_reduce: bf16[3, 4] = c10d.all_reduce(convert_element_type, 'avg', group(size=2))
wait_tensor: bf16[3, 4] = c10d.wait_tensor(all_reduce)
convert_element_type_1: f32[3, 4] = prims.convert_element_type(wait_tensor, f32)
sin_1: f32[5] = aten.sin(arg1_1)
convert_element_type_2: bf16[5] = prims.convert_element_type(sin_1, bf16)
all_reduce_1: bf16[5] = c10d.all_reduce(convert_element_type_2, 'avg', group(size=2))
wait_tensor_1: bf16[5] = c10d.wait_tensor(all_reduce_1)
convert_element_type_3: f32[5] = prims.convert_element_type(wait_tensor_1, f32)
copy_: f32[3, 4] = aten.copy_(arg0_1, convert_element_type_1)
copy__1: f32[5] = aten.copy_(arg1_1, convert_element_type_3)
return [convert_element_type_1, convert_element_type_3]""",
        )

    def test_loss_scale_merges_into_one_scale(self):
        _ = trace(lambda: None, world_size=8)
        hook = hook_fn("bf16", sharded=False)

        def fn(g):  # a gradient-accumulation factor in front of the hook: product 1/32
            g.mul_(0.25)
            return hook(g)

        gm = trace(fn, *hook_args(False, 8))
        self.assertExpectedInline(
            graph_str(gm),
            """\
g_1: f32[16] = input
mul: f32[16] = aten.mul(g_1, 0.25)
div: f32[16] = aten.div(mul, 4.0)
convert_element_type: bf16[16] = prims.convert_element_type(div, bf16)
all_reduce: bf16[16] = c10d.all_reduce(convert_element_type, 'sum', group(size=8))
wait_tensor: bf16[16] = c10d.wait_tensor(all_reduce)
div_1: bf16[16] = aten.div(wait_tensor, 2.0)
convert_element_type_1: f32[16] = prims.convert_element_type(div_1, f32)
copy_: f32[16] = aten.copy_(g_1, convert_element_type_1)
return convert_element_type_1""",
        )
        self.assertRewrites(gm, fold_collective_scaling)
        self.assertExpectedInline(
            graph_str(gm),
            """\
g_1: f32[16] = input
folded_scale: f32[16] = aten.mul(g_1, 0.03125)
convert_element_type: bf16[16] = prims.convert_element_type(folded_scale, bf16)
all_reduce: bf16[16] = c10d.all_reduce(convert_element_type, 'sum', group(size=8))
wait_tensor: bf16[16] = c10d.wait_tensor(all_reduce)
convert_element_type_1: f32[16] = prims.convert_element_type(wait_tensor, f32)
copy_: f32[16] = aten.copy_(g_1, convert_element_type_1)
return convert_element_type_1""",
        )

    def test_world_size_one_removes_factors_and_keeps_sum(self):
        _ = trace(lambda: None, world_size=1)
        hook = hook_fn("bf16", sharded=False)
        gm = trace(lambda g: hook((g * 2.0) / 2.0), *hook_args(False, 1), world_size=1)
        self.assertRewrites(gm, fold_collective_scaling)
        self.assertExpectedInline(
            graph_str(gm),
            """\
g_1: f32[16] = input
convert_element_type: bf16[16] = prims.convert_element_type(g_1, bf16)
all_reduce: bf16[16] = c10d.all_reduce(convert_element_type, 'sum', group(size=1))
wait_tensor: bf16[16] = c10d.wait_tensor(all_reduce)
convert_element_type_1: f32[16] = prims.convert_element_type(wait_tensor, f32)
return convert_element_type_1""",
        )

    def test_factors_whose_float_product_is_one_are_removed(self):
        # found by the randomized test: * 3 then * 0.333... multiplies to 1.0 in floating point
        # (not exactly); folding it into mul(x, 1.0) made a second run remove that
        _ = trace(lambda: None, world_size=8)
        from torch.distributed._functional_collectives import all_reduce

        gm = trace(lambda x: all_reduce(x, "sum", dist.group.WORLD) * 3.0 * (1 / 3), torch.randn(8))
        self.assertRewrites(gm, fold_collective_scaling)
        self.assertNotIn("aten.mul", graph_str(gm))

    # --- left alone ---------------------------------------------------------------------

    def test_fp16_keeps_its_split(self):
        for sharded in (False, True):
            gm = self.trace_hook("fp16", sharded)
            self.assertUntouched(
                gm, fold_collective_scaling, "fp16 wire dtype keeps its pre/post split"
            )

    def test_non_constant_factor(self):
        _ = trace(lambda: None, world_size=8)
        hook = hook_fn("bf16", sharded=False)
        gm = trace(lambda g, t: hook(g.div_(t)), *hook_args(False, 8), torch.tensor(3.0))
        # the tensor factor stops the chain before the hook's own division: that one stays
        self.assertUntouched(gm, fold_collective_scaling, "non-constant factor")

    def test_single_factor_not_matching_world_size(self):
        _ = trace(lambda: None, world_size=8)
        from torch.distributed._functional_collectives import all_reduce

        def fn(g):
            return all_reduce((g / 3.0).to(torch.bfloat16), "sum", dist.group.WORLD).float()

        gm = trace(fn, *hook_args(False, 8))
        self.assertUntouched(gm, fold_collective_scaling, "a single factor")
        self.assertIn("'sum'", graph_str(gm))

    def test_intermediate_with_second_user(self):
        _ = trace(lambda: None, world_size=8)
        from torch.distributed._functional_collectives import all_reduce

        def fn(g):
            d = g / 4.0
            r = all_reduce(d.to(torch.bfloat16), "sum", dist.group.WORLD) / 2.0
            return r.float(), d.sum()  # d is also used here: removing the division would change it

        gm = trace(fn, *hook_args(False, 8))
        self.assertUntouched(gm, fold_collective_scaling, "has another user")

    def test_chained_collectives_on_two_groups(self):
        _ = trace(lambda: None, world_size=8)
        from torch.distributed._functional_collectives import all_reduce

        inner = dist.new_group([0, 1, 2, 3])

        def fn(g):  # hierarchical: sum in a group of 4, then across the world
            r = all_reduce(g / 4.0, "sum", inner)
            return all_reduce(r / 2.0, "sum", dist.group.WORLD)

        gm = trace(fn, *hook_args(False, 8))
        self.assertUntouched(gm, fold_collective_scaling, "chained with another collective")

    def test_backend_without_avg_gets_one_scale(self):
        gm = self.trace_hook("bf16", sharded=False)
        self.assertRewrites(gm, fold_collective_scaling, avg_backends=())
        self.assertIn("'sum'", graph_str(gm))
        self.assertIn("folded_scale: f32[16] = aten.mul(grad_1, 0.125)", graph_str(gm))

    def test_graph_without_metadata_is_left_alone(self):
        from passes import bucket_compressed_collectives

        gm = self.trace_hook("bf16", sharded=False)
        for n in gm.graph.nodes:
            n.meta.pop("val", None)
        self.assertUntouched(gm, fold_collective_scaling, "no fake-tensor metadata")
        self.assertFalse(bucket_compressed_collectives(gm.graph))

    def test_already_avg_is_left_alone(self):
        gm = self.trace_hook("bf16", sharded=False)
        fold_collective_scaling(gm.graph)
        counters_before = graph_str(gm)
        self.assertFalse(fold_collective_scaling(gm.graph))
        self.assertEqual(graph_str(gm), counters_before)
