"""bucket_quantized_collectives on traced int8 hook calls (fake process group): one all-to-all
and one all-gather for many gradients, in an order that lets compute run while they are in
flight, the same values (simulated collectives), and what is left alone."""

from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fcol

import compiled_hooks as ch
from compiled_hooks.graph_contract import BLOCK, DEQUANTIZE_PACKED, INT8
from compiled_hooks.int8 import collectives as int8_collectives
from compiled_hooks.int8.codec import pack, quantize, unpack
from passes import bucket_quantized_collectives
from passes.core.marks import block_of
from passes.core.ops import ALL_GATHER, ALL_TO_ALL, WAIT
from passes.core.verify import check_rewrite, copy_graph
from passes.testing import fake_process_group, graph_str, trace
from tests.passcase import PassTestCase

SHAPES = ((16,), (6, 5), (33,))


def hook_graph(shapes=SHAPES, feedback=False, reduce_scatter=False):
    """:func:`backward` traced on the fake process group."""
    fake_process_group(2)
    state = ch.QuantizedState(dist.group.WORLD, block_size=8, error_feedback=feedback)
    return traced_backward(state, [torch.randn(s) for s in shapes], reduce_scatter)[0]


def traced_backward(state, grads, reduce_scatter=False):
    """:func:`backward` of ``grads`` traced as Dynamo traces it: the state's residuals (created
    first) are graph inputs after the gradients, which the graph updates in place. Returns the
    graph and those residuals."""
    for i, g in enumerate(grads):
        shape = g.reshape(-1).shape if reduce_scatter else g.shape
        state.prepare(f"p{i}", shape, g.device, reduce_scatter=reduce_scatter)
    slots, residuals = list(state._errors), list(state._errors.values())
    fn = backward(state, reduce_scatter)

    def traced(*args):
        state._errors.update(zip(slots, args[len(grads) :]))
        try:
            return fn(*args[: len(grads)])
        finally:
            state._errors.update(zip(slots, residuals))

    return trace(traced, *grads, *residuals, world_size=None), residuals


def backward(state, reduce_scatter=False):
    """A backward's shape: each gradient computed (``cos`` of the last one), then hooked with
    ``state``; returns the shards of the reduce-scatter form."""

    def fn(*grads):
        c, shards = grads[0].sum(), []
        for i, grad in enumerate(grads):
            c = (c + grad.sum()).cos()  # each gradient needs compute after the one before
            g = grad * c
            if reduce_scatter:
                shards.append(g.new_empty(g.numel() // 2))
                ch.int8_compress_hook(state, g.reshape(-1), shards[-1], param=f"p{i}")
            else:
                ch.int8_compress_hook(state, g, param=f"p{i}")
                grad.copy_(g)
        return shards

    return fn


def collectives(gm):
    return [n for n in gm.graph.nodes if n.target in (ALL_TO_ALL, ALL_GATHER)]


class TestBucketQuantizedCollectives(PassTestCase):
    def test_one_all_to_all_and_one_all_gather_with_the_same_values(self):
        for feedback in (False, True):
            gm = hook_graph(feedback=feedback)
            before = copy_graph(gm.graph)
            self.assertEqual(len(collectives(gm)), 6)
            self.assertTrue(bucket_quantized_collectives(gm.graph))
            gm.graph.lint()
            self.assertEqual([n.target for n in collectives(gm)], [ALL_TO_ALL, ALL_GATHER])
            self.assertTrue(check_rewrite("test", before, gm.graph))

    def test_members_packed_by_a_cat_are_spliced_into_one_cat(self):
        """On CPU each member's rows are packed by a cat (scales' bytes, values): the bucket
        cats those pieces itself, so the graph holds one cat per bucket and no cat of cats."""
        gm = hook_graph()
        before = copy_graph(gm.graph)
        packs = [m.args[0] for m in collectives(gm)]
        self.assertTrue(all(p.target is torch.ops.aten.cat.default for p in packs))
        self.assertTrue(bucket_quantized_collectives(gm.graph))
        for bucket in [m.args[0] for m in collectives(gm)]:
            self.assertIs(bucket.target, torch.ops.aten.cat.default)
            self.assertEqual(len(bucket.args[0]), 6)  # 3 members, 2 pieces each
            self.assertFalse(any(p.target is torch.ops.aten.cat.default for p in bucket.args[0]))
        self.assertFalse(any(p in gm.graph.nodes for p in packs))  # the members' cats are gone
        self.assertTrue(check_rewrite("test", before, gm.graph))

    def test_reduce_scatter_form(self):
        gm = hook_graph(shapes=((16,), (8,)), reduce_scatter=True)
        before = copy_graph(gm.graph)
        self.assertTrue(bucket_quantized_collectives(gm.graph))
        self.assertEqual([n.target for n in collectives(gm)], [ALL_TO_ALL])
        self.assertTrue(check_rewrite("test", before, gm.graph))

    def test_bucket_goes_out_after_its_last_input_and_is_waited_at_first_use(self):
        """The bucket is issued as soon as the last gradient's rows are packed; what reads any
        member's result (the first gradient's sum and re-quantization) comes after its wait."""
        gm = hook_graph()
        bucket_quantized_collectives(gm.graph)
        nodes = list(gm.graph.nodes)
        a2a = next(n for n in nodes if n.target is ALL_TO_ALL)
        (wait,) = a2a.users
        self.assertIs(a2a.args[0].target, torch.ops.aten.cat.default)
        last_input = max(a2a.args[0].args[0], key=nodes.index)
        self.assertEqual(nodes.index(a2a), nodes.index(a2a.args[0]) + 1)
        self.assertLess(nodes.index(last_input), nodes.index(a2a.args[0]))
        readers = [u for u in wait.users]
        self.assertTrue(all(nodes.index(r) > nodes.index(wait) for r in readers))
        self.assertIs(wait.target, WAIT)

    def test_the_dequantize_op_reads_its_columns_of_the_bucket_in_place(self):
        """On CPU the int8 collectives' results are read by the dequantize op alone, which
        takes any strides: each gets its columns of the bucket as they are. Another reader (a
        view of them may need a unit row stride) gets a contiguous copy."""
        with mock.patch.object(int8_collectives, "ATEN_DEQUANTIZE_MIN_BYTES", 0):
            gm = hook_graph()
        bucket_quantized_collectives(gm.graph)
        readers = [n for n in gm.graph.nodes if n.target is DEQUANTIZE_PACKED]
        self.assertEqual(len(readers), 6)
        for r in readers:
            self.assertIs(r.args[0].target, torch.ops.aten.slice.Tensor)
            self.assertIs(r.args[0].args[0].target, WAIT)
        self.assertFalse([n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default])

        fake_process_group(2)

        def fn(a, b):
            received = []
            for x in (a, b):
                packed = pack(*quantize(x.view(2, -1), 8))
                with torch.fx.traceback.annotate({INT8: True}):
                    received.append(fcol.all_to_all_single(packed, None, None, "0"))
            return [unpack(r, 8)[0].sum() for r in received]

        gm = trace(fn, torch.randn(16), torch.randn(16), world_size=None)
        self.assertTrue(bucket_quantized_collectives(gm.graph))
        clones = [n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default]
        self.assertEqual([c.args[0].target for c in clones], [torch.ops.aten.slice.Tensor] * 2)

    def test_idempotent_and_one_member_left_alone(self):
        gm = hook_graph()
        bucket_quantized_collectives(gm.graph)
        text = graph_str(gm)
        self.assertFalse(bucket_quantized_collectives(gm.graph))
        self.assertEqual(graph_str(gm), text)
        gm = hook_graph(shapes=((16,),))
        text = graph_str(gm)
        self.assertFalse(bucket_quantized_collectives(gm.graph))
        self.assertEqual(graph_str(gm), text)

    def test_cap_cuts_buckets(self):
        gm = hook_graph(shapes=((64,), (64,), (64,), (64,)))
        # a member's all-to-all sends 2 rows of 4 blocks (8 values and a 4-byte scale each): 96
        # bytes; its all-gather one row, 48 bytes. A cap of 200 bytes: 2 + 2, and 4.
        bucket_quantized_collectives(gm.graph, quantized_bucket_cap_mb=200 / 2**20)
        self.assertEqual([n.target for n in collectives(gm)], [ALL_TO_ALL, ALL_TO_ALL, ALL_GATHER])

    def test_default_cap_is_a_quarter_outside_a_block_and_25_mib_in_one(self):
        """Six members of 100k values: an all-to-all sends 2 rows of 6250 blocks (8 values and
        a 4-byte scale each), 150 kB; an all-gather one row, 75 kB. Their quarters are below
        int8's 0.5 MiB floor (the other buckets' 2 MiB would make one bucket of each kind):
        buckets of 3 and 3 all-to-alls, and of 6 all-gathers. In a data_parallel block, one
        bucket of each kind."""
        shapes = ((100_000,),) * 6
        gm = hook_graph(shapes=shapes)
        bucket_quantized_collectives(gm.graph)
        self.assertEqual([n.target for n in collectives(gm)], [ALL_TO_ALL] * 2 + [ALL_GATHER])
        gm = hook_graph(shapes=shapes)
        for n in collectives(gm):
            n.meta.setdefault("custom", {})[BLOCK] = "layers.0"
        bucket_quantized_collectives(gm.graph)
        self.assertEqual([n.target for n in collectives(gm)], [ALL_TO_ALL, ALL_GATHER])

    def test_a_member_whose_input_needs_another_members_result_is_left_alone(self):
        """The second gradient is computed from the first one's average: they cannot go out
        together."""
        fake_process_group(2)
        state = ch.QuantizedState(dist.group.WORLD, block_size=8, error_feedback=False)

        def fn(a, b):
            ch.int8_compress_hook(state, a)
            b.add_(a)
            ch.int8_compress_hook(state, b)

        gm = trace(fn, torch.randn(16), torch.randn(16), world_size=None)
        self.assertUntouched(
            gm, bucket_quantized_collectives, "a member's input needs another member's result"
        )

    def test_float_collectives_are_not_members(self):
        fake_process_group(2)
        c10d = torch.ops._c10d_functional

        def fn(a, b):
            x = c10d.wait_tensor(c10d.all_gather_into_tensor(a, 2, "0"))
            y = c10d.wait_tensor(c10d.all_gather_into_tensor(b, 2, "0"))
            return x + y

        gm = trace(fn, torch.randn(1, 8), torch.randn(1, 8), world_size=None)
        text = graph_str(gm)
        self.assertFalse(bucket_quantized_collectives(gm.graph))
        self.assertEqual(graph_str(gm), text)

    def test_int8_collectives_without_the_mark_are_not_members(self):
        """Where the int8 path's collectives carry ``INT8``, an int8 all-to-all without it (of
        someone else's code, the same shape) is not taken for one of them."""
        fake_process_group(2)
        state = ch.QuantizedState(dist.group.WORLD, block_size=8, error_feedback=False)

        def fn(a, b, c):
            ch.int8_compress_hook(state, c)
            received = [
                fcol.all_to_all_single(pack(*quantize(x.view(2, -1), 8)), None, None, "0")
                for x in (a, b)
            ]
            return [unpack(r, 8)[0].sum() for r in received]

        gm = trace(fn, torch.randn(16), torch.randn(16), torch.randn(16), world_size=None)
        unmarked = [n for n in collectives(gm) if INT8 not in n.meta.get("custom", {})]
        self.assertEqual(len(unmarked), 2)
        text = graph_str(gm)
        self.assertFalse(bucket_quantized_collectives(gm.graph))
        self.assertEqual(graph_str(gm), text)

    def test_a_graph_without_marks_is_bucketed_by_its_int8_inputs(self):
        """Compiled autograd drops ``annotate``'s marks from the backward it compiles: in a
        graph where no collective is marked, the int8 input is what tells them."""
        gm = hook_graph()
        for n in gm.graph.nodes:
            n.meta.pop("custom", None)
        before = copy_graph(gm.graph)
        self.assertTrue(bucket_quantized_collectives(gm.graph))
        self.assertEqual([n.target for n in collectives(gm)], [ALL_TO_ALL, ALL_GATHER])
        self.assertTrue(check_rewrite("test", before, gm.graph))

    def test_the_hooks_collectives_carry_the_mark(self):
        gm = hook_graph()
        marked = [n for n in collectives(gm) if n.meta.get("custom", {}).get(INT8)]
        self.assertEqual(len(marked), 6)

    def test_one_bucket_per_data_parallel_block(self):
        """data_parallel's int8 collectives are bucketed within their block, never across."""
        fake_process_group(2)
        state = ch.QuantizedState(dist.group.WORLD, block_size=8, error_feedback=False)

        def fn(*grads):
            for i, grad in enumerate(grads):
                with torch.fx.traceback.annotate({BLOCK: f"layers.{i // 2}"}):
                    ch.int8_compress_hook(state, grad)

        gm = trace(fn, *[torch.randn(16) for _ in range(4)], world_size=None)
        before = copy_graph(gm.graph)
        self.assertTrue(bucket_quantized_collectives(gm.graph))
        kinds = [(n.target, block_of(n)) for n in collectives(gm)]
        self.assertEqual(
            sorted(kinds, key=str),
            sorted([(t, f"layers.{b}") for t in (ALL_TO_ALL, ALL_GATHER) for b in (0, 1)], key=str),
        )
        self.assertTrue(check_rewrite("test", before, gm.graph))
