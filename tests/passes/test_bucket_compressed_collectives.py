"""bucket_compressed_collectives: snapshots, negative cases, idempotence (fake process group)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_reduce

from passes import bucket_compressed_collectives, fold_collective_scaling
from passes.testing import graph_str, trace
from tests.graphs import ddp_args, ddp_fn, hook_fn
from tests.passcase import PassTestCase


def ddp_graph(kind, shapes, world_size=2, fold=True):
    _ = trace(lambda: None, world_size=world_size)
    gm = trace(ddp_fn(kind), *ddp_args(shapes), world_size=world_size)
    if fold:
        fold_collective_scaling(gm.graph)
    return gm


class TestFuse(PassTestCase):
    def test_ddp_shaped_bf16_one_bucket(self):
        gm = ddp_graph("bf16", [(3, 4), (5,), (2, 2)])
        self.assertExpectedInline(
            graph_str(gm),
            """\
arg0_1: f32[3, 4] = input
arg1_1: f32[5] = input
arg2_1: f32[2, 2] = input
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
sin_2: f32[2, 2] = aten.sin(arg2_1)
convert_element_type_4: bf16[2, 2] = prims.convert_element_type(sin_2, bf16)
all_reduce_2: bf16[2, 2] = c10d.all_reduce(convert_element_type_4, 'avg', group(size=2))
wait_tensor_2: bf16[2, 2] = c10d.wait_tensor(all_reduce_2)
convert_element_type_5: f32[2, 2] = prims.convert_element_type(wait_tensor_2, f32)
copy_: f32[3, 4] = aten.copy_(arg0_1, convert_element_type_1)
copy__1: f32[5] = aten.copy_(arg1_1, convert_element_type_3)
copy__2: f32[2, 2] = aten.copy_(arg2_1, convert_element_type_5)
return [convert_element_type_1, convert_element_type_3, convert_element_type_5]""",
        )
        self.assertRewrites(gm, bucket_compressed_collectives)
        self.assertExpectedInline(
            graph_str(gm),
            """\
arg0_1: f32[3, 4] = input
arg1_1: f32[5] = input
arg2_1: f32[2, 2] = input
sin: f32[3, 4] = aten.sin(arg0_1)
sin_1: f32[5] = aten.sin(arg1_1)
sin_2: f32[2, 2] = aten.sin(arg2_1)
convert_element_type: bf16[3, 4] = prims.convert_element_type(sin, bf16)
reshape_default: bf16[12] = aten.reshape(convert_element_type, [-1])
convert_element_type_2: bf16[5] = prims.convert_element_type(sin_1, bf16)
convert_element_type_4: bf16[2, 2] = prims.convert_element_type(sin_2, bf16)
reshape_default_1: bf16[4] = aten.reshape(convert_element_type_4, [-1])
bucket_cat: bf16[21] = aten.cat([reshape_default, convert_element_type_2, reshape_default_1], 0)
bucket_all_reduce: bf16[21] = c10d.all_reduce(bucket_cat, 'avg', group(size=2))
bucket_wait: bf16[21] = c10d.wait_tensor(bucket_all_reduce)
bucket_pieces: (bf16[12], bf16[5], bf16[4]) = aten.split_with_sizes(bucket_wait, [12, 5, 4])
getitem: bf16[12] = getitem(bucket_pieces, 0)
view_default: bf16[3, 4] = aten.view(getitem, [3, 4])
convert_element_type_1: f32[3, 4] = prims.convert_element_type(view_default, f32)
getitem_1: bf16[5] = getitem(bucket_pieces, 1)
convert_element_type_3: f32[5] = prims.convert_element_type(getitem_1, f32)
getitem_2: bf16[4] = getitem(bucket_pieces, 2)
view_default_1: bf16[2, 2] = aten.view(getitem_2, [2, 2])
convert_element_type_5: f32[2, 2] = prims.convert_element_type(view_default_1, f32)
copy_: f32[3, 4] = aten.copy_(arg0_1, convert_element_type_1)
copy__1: f32[5] = aten.copy_(arg1_1, convert_element_type_3)
copy__2: f32[2, 2] = aten.copy_(arg2_1, convert_element_type_5)
return [convert_element_type_1, convert_element_type_3, convert_element_type_5]""",
        )

    def test_fp16_buckets_with_its_divisions_inside(self):
        gm = ddp_graph("fp16", [(4,), (6,)], world_size=8)
        self.assertExpectedInline(
            graph_str(gm),
            """\
arg0_1: f32[4] = input
arg1_1: f32[6] = input
sin: f32[4] = aten.sin(arg0_1)
div: f32[4] = aten.div(sin, 4.0)
convert_element_type: f16[4] = prims.convert_element_type(div, f16)
all_reduce: f16[4] = c10d.all_reduce(convert_element_type, 'sum', group(size=8))
wait_tensor: f16[4] = c10d.wait_tensor(all_reduce)
div_1: f16[4] = aten.div(wait_tensor, 2.0)
convert_element_type_1: f32[4] = prims.convert_element_type(div_1, f32)
sin_1: f32[6] = aten.sin(arg1_1)
div_2: f32[6] = aten.div(sin_1, 4.0)
convert_element_type_2: f16[6] = prims.convert_element_type(div_2, f16)
all_reduce_1: f16[6] = c10d.all_reduce(convert_element_type_2, 'sum', group(size=8))
wait_tensor_1: f16[6] = c10d.wait_tensor(all_reduce_1)
div_3: f16[6] = aten.div(wait_tensor_1, 2.0)
convert_element_type_3: f32[6] = prims.convert_element_type(div_3, f32)
copy_: f32[4] = aten.copy_(arg0_1, convert_element_type_1)
copy__1: f32[6] = aten.copy_(arg1_1, convert_element_type_3)
return [convert_element_type_1, convert_element_type_3]""",
        )
        self.assertRewrites(gm, bucket_compressed_collectives)
        self.assertExpectedInline(
            graph_str(gm),
            """\
arg0_1: f32[4] = input
arg1_1: f32[6] = input
sin: f32[4] = aten.sin(arg0_1)
sin_1: f32[6] = aten.sin(arg1_1)
div: f32[4] = aten.div(sin, 4.0)
convert_element_type: f16[4] = prims.convert_element_type(div, f16)
div_2: f32[6] = aten.div(sin_1, 4.0)
convert_element_type_2: f16[6] = prims.convert_element_type(div_2, f16)
bucket_cat: f16[10] = aten.cat([convert_element_type, convert_element_type_2], 0)
bucket_all_reduce: f16[10] = c10d.all_reduce(bucket_cat, 'sum', group(size=8))
bucket_wait: f16[10] = c10d.wait_tensor(bucket_all_reduce)
bucket_pieces: (f16[4], f16[6]) = aten.split_with_sizes(bucket_wait, [4, 6])
getitem: f16[4] = getitem(bucket_pieces, 0)
div_1: f16[4] = aten.div(getitem, 2.0)
convert_element_type_1: f32[4] = prims.convert_element_type(div_1, f32)
getitem_1: f16[6] = getitem(bucket_pieces, 1)
div_3: f16[6] = aten.div(getitem_1, 2.0)
convert_element_type_3: f32[6] = prims.convert_element_type(div_3, f32)
copy_: f32[4] = aten.copy_(arg0_1, convert_element_type_1)
copy__1: f32[6] = aten.copy_(arg1_1, convert_element_type_3)
return [convert_element_type_1, convert_element_type_3]""",
        )

    def test_bucket_caps_split_buckets(self):
        # 6 gradients of 256 KiB in bf16: a first bucket of 0.5 MiB, then one of up to 1 MiB
        gm = ddp_graph("bf16", [(128, 1024)] * 6)
        self.assertRewrites(
            gm, bucket_compressed_collectives, bucket_cap_mb=1.0, first_bucket_cap_mb=0.5
        )
        text = graph_str(gm)
        self.assertEqual(text.count("c10d.all_reduce"), 2)
        self.assertIn("bucket_cat: bf16[262144]", text)  # the first two gradients
        self.assertIn("bucket_cat_1: bf16[524288]", text)  # the other four
        # the first bucket is waited only after the second one is issued
        self.assertLess(text.index("bucket_all_reduce_1"), text.index("bucket_wait:"))

    def test_first_bucket_fills_then_closes(self):
        # DDP's rule: a gradient larger than the first cap goes out in the first bucket, with
        # what came before it, instead of waiting for the second bucket to fill
        gm = ddp_graph("bf16", [(8,), (1024, 1024), (8,), (1024, 1024)])
        self.assertRewrites(
            gm, bucket_compressed_collectives, bucket_cap_mb=25.0, first_bucket_cap_mb=1.0
        )
        text = graph_str(gm)
        self.assertEqual(text.count("c10d.all_reduce"), 2)
        self.assertIn("bucket_cat: bf16[1048584]", text)
        self.assertIn("bucket_cat_1: bf16[1048584]", text)

    def test_reduce_scatter_bucket_is_rank_major(self):
        _ = trace(lambda: None, world_size=2)
        hook = hook_fn("bf16", sharded=True)

        def fn(a, oa, b, ob):
            hook(a, oa)
            hook(b, ob)
            return oa, ob

        gm = trace(
            fn, torch.randn(12), torch.empty(6), torch.randn(4, 2), torch.empty(2, 2), world_size=2
        )
        fold_collective_scaling(gm.graph)
        self.assertExpectedInline(
            graph_str(gm),
            """\
a_1: f32[12] = input
oa_1: f32[6] = input
b_1: f32[4, 2] = input
ob_1: f32[2, 2] = input
convert_element_type: bf16[12] = prims.convert_element_type(a_1, bf16)
view: bf16[12] = aten.view(convert_element_type, [-1])
reduce_scatter_tensor: bf16[6] = c10d.reduce_scatter_tensor(view, 'avg', 2, group(size=2))
wait_tensor: bf16[6] = c10d.wait_tensor(reduce_scatter_tensor)
convert_element_type_1: f32[6] = prims.convert_element_type(wait_tensor, f32)
convert_element_type_2: bf16[4, 2] = prims.convert_element_type(b_1, bf16)
view_2: bf16[8] = aten.view(convert_element_type_2, [-1])
reduce_scatter_tensor_1: bf16[4] = c10d.reduce_scatter_tensor(view_2, 'avg', 2, group(size=2))
wait_tensor_1: bf16[4] = c10d.wait_tensor(reduce_scatter_tensor_1)
view_3: bf16[2, 2] = aten.view(wait_tensor_1, [2, 2])
convert_element_type_3: f32[2, 2] = prims.convert_element_type(view_3, f32)
copy_: f32[6] = aten.copy_(oa_1, convert_element_type_1)
copy__1: f32[2, 2] = aten.copy_(ob_1, convert_element_type_3)
return [convert_element_type_1, convert_element_type_3]""",
        )
        self.assertRewrites(gm, bucket_compressed_collectives)
        self.assertExpectedInline(
            graph_str(gm),
            """\
a_1: f32[12] = input
oa_1: f32[6] = input
b_1: f32[4, 2] = input
ob_1: f32[2, 2] = input
convert_element_type: bf16[12] = prims.convert_element_type(a_1, bf16)
view: bf16[12] = aten.view(convert_element_type, [-1])
reshape_default: bf16[2, 6] = aten.reshape(view, [2, -1])
convert_element_type_2: bf16[4, 2] = prims.convert_element_type(b_1, bf16)
view_2: bf16[8] = aten.view(convert_element_type_2, [-1])
reshape_default_1: bf16[2, 4] = aten.reshape(view_2, [2, -1])
bucket_cat: bf16[2, 10] = aten.cat([reshape_default, reshape_default_1], 1)
reshape_default_2: bf16[20] = aten.reshape(bucket_cat, [-1])
bucket_reduce_scatter_tensor: bf16[10] = c10d.reduce_scatter_tensor(reshape_default_2, 'avg', 2, group(size=2))
bucket_wait: bf16[10] = c10d.wait_tensor(bucket_reduce_scatter_tensor)
bucket_pieces: (bf16[6], bf16[4]) = aten.split_with_sizes(bucket_wait, [6, 4])
getitem: bf16[6] = getitem(bucket_pieces, 0)
convert_element_type_1: f32[6] = prims.convert_element_type(getitem, f32)
getitem_1: bf16[4] = getitem(bucket_pieces, 1)
view_3: bf16[2, 2] = aten.view(getitem_1, [2, 2])
convert_element_type_3: f32[2, 2] = prims.convert_element_type(view_3, f32)
copy_: f32[6] = aten.copy_(oa_1, convert_element_type_1)
copy__1: f32[2, 2] = aten.copy_(ob_1, convert_element_type_3)
return [convert_element_type_1, convert_element_type_3]""",
        )

    # --- left alone ---------------------------------------------------------------------

    def test_uncompressed_collectives_are_not_ours(self):
        gm = ddp_graph("fp32", [(4,), (6,)])
        text = graph_str(gm)
        self.assertFalse(bucket_compressed_collectives(gm.graph))
        self.assertEqual(graph_str(gm), text)

    def test_different_groups_and_dtypes_are_not_mixed(self):
        _ = trace(lambda: None, world_size=4)
        sub = dist.new_group([0, 1])

        def fn(a, b, c):
            ra = all_reduce(a.to(torch.bfloat16), "avg", dist.group.WORLD)
            rb = all_reduce(b.to(torch.bfloat16), "avg", sub)  # other group
            rc = all_reduce(c.to(torch.float16), "avg", dist.group.WORLD)  # other wire dtype
            return ra.float(), rb.float(), rc.float()

        gm = trace(fn, torch.randn(4), torch.randn(4), torch.randn(4), world_size=4)
        text = graph_str(gm)
        self.assertFalse(bucket_compressed_collectives(gm.graph))
        self.assertEqual(graph_str(gm), text)

    def test_result_needed_before_last_input(self):
        _ = trace(lambda: None, world_size=2)

        def fn(a, b):
            ra = all_reduce(a.to(torch.bfloat16), "avg", dist.group.WORLD).float()
            s = ra.sum()  # uses a's result ...
            t = torch.sin(b)  # ... before b's input exists (independent of a)
            rb = all_reduce(t.to(torch.bfloat16), "avg", dist.group.WORLD).float()
            return s, rb

        gm = trace(fn, torch.randn(4), torch.randn(4))
        self.assertUntouched(
            gm, bucket_compressed_collectives, "used before its last input is ready"
        )

    def test_dependent_collectives_are_not_bucketed(self):
        _ = trace(lambda: None, world_size=2)

        def fn(a):
            ra = all_reduce(a.to(torch.bfloat16), "avg", dist.group.WORLD).float()
            rb = all_reduce((ra * 3).to(torch.bfloat16), "avg", dist.group.WORLD).float()
            return rb

        gm = trace(fn, torch.randn(4))
        text = graph_str(gm)
        self.assertFalse(bucket_compressed_collectives(gm.graph))
        self.assertEqual(graph_str(gm), text)

    def test_interleaved_groups_bucket_once(self):
        # found by the randomized test: after bucketing the world group's collectives, the
        # subgroup's ones became adjacent and a second run bucketed them. Another collective
        # in between now always separates candidates.
        _ = trace(lambda: None, world_size=4)
        sub = dist.new_group([0, 1])

        def fn(a, b, c, d, e, f):
            outs = []
            for x, group in ((a, None), (b, None), (c, sub), (d, None), (e, None), (f, sub)):
                outs.append(
                    all_reduce(
                        torch.sin(x).to(torch.bfloat16), "avg", group or dist.group.WORLD
                    ).float()
                )
            return outs

        gm = trace(fn, *[torch.randn(4) for _ in range(6)], world_size=4)
        self.assertRewrites(gm, bucket_compressed_collectives)
        self.assertEqual(graph_str(gm).count("c10d.all_reduce"), 4)  # 2 buckets, 2 subgroup singles

    def test_first_cap_singleton_is_stable(self):
        # found by the randomized test: a first member larger than the first cap stays alone,
        # and a second run must not treat the next bucket as the first
        gm = ddp_graph("bf16", [(64, 64), (4,), (5,), (6,)])
        self.assertRewrites(gm, bucket_compressed_collectives, first_bucket_cap_mb=1e-3)
        self.assertEqual(graph_str(gm).count("c10d.all_reduce"), 2)

    def test_bad_caps(self):
        gm = ddp_graph("bf16", [(4,)])
        with self.assertRaisesRegex(ValueError, "bucket caps must be positive"):
            bucket_compressed_collectives(gm.graph, bucket_cap_mb=0)


def test_the_former_name_warns_and_is_the_same_pass():
    import passes

    with pytest.warns(DeprecationWarning, match="renamed passes.bucket_compressed_collectives"):
        old = passes.fuse_collective_casts
    assert old is bucket_compressed_collectives
    with pytest.raises(AttributeError, match="no attribute 'fuse_nothing'"):
        passes.fuse_nothing  # noqa: B018
