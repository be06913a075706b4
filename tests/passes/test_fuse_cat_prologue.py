"""fuse_cat_prologue: a packed bucket's scale and cast move into the cat's members (fake
process group): snapshot, numerics, idempotence, what is left alone."""

import torch
from torch._dynamo.utils import counters

from passes import fuse_cat_prologue
from passes.core.verify import check_rewrite, copy_graph
from passes.testing import graph_str, trace
from tests.graphs import zero_optimizer, zero_step_fn
from tests.passcase import PassTestCase

c10d = torch.ops._c10d_functional


def bucket_hook(a, b):
    """A hook on a bucket packed by the caller, as the ZeRO hooks do (bf16 compression)."""
    flat = torch.cat([a.reshape(-1), b.reshape(-1)])
    sent = (flat / 2.0).to(torch.bfloat16)
    return c10d.wait_tensor(c10d.all_reduce(sent, "sum", "0")).float()


class TestFuseCatPrologue(PassTestCase):
    def test_scale_and_cast_move_into_members(self):
        gm = trace(bucket_hook, torch.randn(3), torch.randn(2, 2), world_size=2)
        before = copy_graph(gm.graph)
        self.assertExpectedInline(
            graph_str(gm),
            """\
a_1: f32[3] = input
b_1: f32[2, 2] = input
view: f32[3] = aten.view(a_1, [-1])
view_1: f32[4] = aten.view(b_1, [-1])
cat: f32[7] = aten.cat([view, view_1])
div: f32[7] = aten.div(cat, 2.0)
convert_element_type: bf16[7] = prims.convert_element_type(div, bf16)
all_reduce: bf16[7] = c10d.all_reduce(convert_element_type, 'sum', group(size=2))
wait_tensor: bf16[7] = c10d.wait_tensor(all_reduce)
convert_element_type_1: f32[7] = prims.convert_element_type(wait_tensor, f32)
return convert_element_type_1""",
        )
        self.assertRewrites(gm, fuse_cat_prologue)
        self.assertExpectedInline(
            graph_str(gm),
            """\
a_1: f32[3] = input
b_1: f32[2, 2] = input
view: f32[3] = aten.view(a_1, [-1])
view_1: f32[4] = aten.view(b_1, [-1])
div_tensor: f32[3] = aten.div(view, 2.0)
convert_element_type_default: bf16[3] = prims.convert_element_type(div_tensor, bf16)
div_tensor_1: f32[4] = aten.div(view_1, 2.0)
convert_element_type_default_1: bf16[4] = prims.convert_element_type(div_tensor_1, bf16)
cat_default: bf16[7] = aten.cat([convert_element_type_default, convert_element_type_default_1])
all_reduce: bf16[7] = c10d.all_reduce(cat_default, 'sum', group(size=2))
wait_tensor: bf16[7] = c10d.wait_tensor(all_reduce)
convert_element_type_1: f32[7] = prims.convert_element_type(wait_tensor, f32)
return convert_element_type_1""",
        )
        self.meta_consistent(gm)
        self.assertTrue(check_rewrite("fuse_cat_prologue", before, gm.graph))

    def test_zero_step_buckets_numerics(self):
        """The ZeRO hooks' buckets (fp32 and bf16, 2 and 4 ranks): every bucket's all_reduce
        reads its cat afterwards, and the step computes the same values."""
        for world_size, kind in [(2, "fp32"), (4, "bf16")]:
            zero = zero_optimizer(world_size, ((3,), (2, 3), (4,), (5,)), torch.optim.AdamW)
            # two buckets of two
            fn, args = zero_step_fn(zero, kind, interleaved=True, bucket_bytes=30)
            gm = trace(fn, *args(), world_size=world_size)
            before = copy_graph(gm.graph)
            self.assertRewrites(gm, fuse_cat_prologue)
            reduces = [n for n in gm.graph.nodes if n.target is c10d.all_reduce.default]
            self.assertEqual(len(reduces), 2)
            self.assertTrue(all(n.args[0].target is torch.ops.aten.cat.default for n in reduces))
            self.assertTrue(check_rewrite("fuse_cat_prologue", before, gm.graph))

    def test_left_alone(self):
        def cat_read_twice(a, b):
            flat = torch.cat([a, b])
            return c10d.wait_tensor(c10d.all_reduce(flat / 2.0, "sum", "0")) + flat

        def tensor_factor(a, b, s):
            return c10d.wait_tensor(c10d.all_reduce(torch.cat([a, b]) / s, "sum", "0"))

        def not_flat(a, b):
            return c10d.wait_tensor(c10d.all_reduce(torch.cat([a, b], dim=1) * 0.5, "sum", "0"))

        x, y = torch.randn(3), torch.randn(2)
        cases = [
            (cat_read_twice, (x, y), "the cat has another user"),
            (tensor_factor, (x, y, torch.tensor(2.0)), "is not a constant scale"),
            (not_flat, (torch.randn(2, 3), torch.randn(2, 1)), "a member is not 1-D"),
        ]
        for fn, inputs, reason in cases:
            with self.subTest(fn.__name__):
                self.assertUntouched(trace(fn, *inputs, world_size=2), fuse_cat_prologue, reason)

    def test_no_cat_is_not_counted(self):
        gm = trace(
            lambda g: c10d.wait_tensor(c10d.all_reduce(g / 2.0, "sum", "0")),
            torch.randn(4),
            world_size=2,
        )
        self.assertFalse(fuse_cat_prologue(gm.graph))
        self.assertFalse([k for k in counters["passes"] if k.startswith("fuse_cat_prologue")])
