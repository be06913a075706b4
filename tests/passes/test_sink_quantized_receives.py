"""sink_quantized_receives on traced int8 hook calls (fake process group): every gradient's
all-to-all goes out before the first one is waited, with the same values (simulated
collectives), the write-backs left last; a write and data_parallel's collectives stop it or
are left alone."""

import pytest
import torch
import torch.distributed as dist

import compiled_hooks as ch
from compiled_hooks.graph_contract import BLOCK
from passes import bucket_quantized_collectives, sink_quantized_receives
from passes.core.ops import ALL_GATHER, ALL_TO_ALL, WAIT, aten
from passes.core.verify import check_rewrite, copy_graph
from passes.testing import fake_process_group, graph_str, trace
from tests.passcase import PassTestCase
from tests.passes import test_bucket_quantized_collectives
from tests.passes.test_bucket_quantized_collectives import hook_graph
from tests.ranks import run_ranks


def positions(gm):
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def waits_of(gm, target):
    return [next(iter(n.users)) for n in gm.graph.nodes if n.target is target]


def writebacks(gm):
    """The residuals' and gradients' write-backs (``copy_`` into a graph input), in order."""
    return [
        n.name
        for n in gm.graph.nodes
        if n.target is aten.copy_.default and n.args[0].op == "placeholder"
    ]


def order_str(gm):
    """The graph's collectives, waits, compute steps (``cos``) and write-backs, in order."""
    shown = (ALL_TO_ALL, ALL_GATHER, WAIT, aten.cos.default, aten.copy_.default)
    return "\n".join(
        f"{n.name} = {n.target.__name__}({', '.join(a.name for a in n.all_input_nodes)})"
        for n in gm.graph.nodes
        if n.target in shown
    )


class TestSinkQuantizedReceives(PassTestCase):
    def test_snapshot(self):
        gm = hook_graph(shapes=((16,), (8,)), feedback=True)
        self.assertRewrites(gm, sink_quantized_receives)
        self.assertExpectedInline(
            order_str(gm),
            """\
cos = cos.default(add)
all_to_all_single = all_to_all_single.default(cat_1)
cos_1 = cos.default(add_9)
all_to_all_single_1 = all_to_all_single.default(cat_5)
wait_tensor = wait_tensor.default(all_to_all_single)
all_gather_into_tensor = all_gather_into_tensor.default(cat_3)
wait_tensor_2 = wait_tensor.default(all_to_all_single_1)
all_gather_into_tensor_1 = all_gather_into_tensor.default(cat_7)
wait_tensor_1 = wait_tensor.default(all_gather_into_tensor)
wait_tensor_3 = wait_tensor.default(all_gather_into_tensor_1)
copy_ = copy_.default(arg0_1, slice_copy_5)
copy__1 = copy_.default(arg1_1, slice_copy_13)
copy__2 = copy_.default(arg2_1, where_1)
copy__3 = copy_.default(arg3_1, where_4)
copy__4 = copy_.default(arg4_1, where_7)
copy__5 = copy_.default(arg5_1, where_10)""",
        )

    def test_every_collective_goes_out_before_the_first_wait_of_its_kind_same_values(self):
        """Every all-to-all is issued before the first all-to-all's wait, and every all-gather
        before the first all-gather's wait (the next receive side runs while an all-gather is
        on the wire); the write-backs stay last."""
        for feedback in (False, True):
            gm = hook_graph(feedback=feedback)
            before, written = copy_graph(gm.graph), writebacks(gm)
            # 3 gradients, and 2 residuals each with feedback
            self.assertEqual(len(written), 9 if feedback else 3)
            at = positions(gm)
            exchanges = [n for n in gm.graph.nodes if n.target is ALL_TO_ALL]
            self.assertLess(at[next(iter(exchanges[0].users))], at[exchanges[1]])
            self.assertRewrites(gm, sink_quantized_receives)
            at = positions(gm)
            last_issue = max(at[n] for n in gm.graph.nodes if n.target is ALL_TO_ALL)
            self.assertTrue(all(at[w] > last_issue for w in waits_of(gm, ALL_TO_ALL)))
            cos = [n for n in gm.graph.nodes if n.target is aten.cos.default]
            self.assertTrue(all(at[w] > at[cos[-1]] for w in waits_of(gm, ALL_TO_ALL)))
            last_gather = max(at[n] for n in gm.graph.nodes if n.target is ALL_GATHER)
            self.assertTrue(all(at[w] > last_gather for w in waits_of(gm, ALL_GATHER)))
            self.assertEqual(writebacks(gm), written)
            self.assertEqual(list(gm.graph.nodes)[-len(written) - 1].name, written[0])
            self.assertTrue(check_rewrite("test", before, gm.graph))

    def test_after_bucketing_and_in_the_reduce_scatter_form(self):
        gm = hook_graph(shapes=((16,), (8,), (24,)), feedback=True)
        bucket_quantized_collectives(gm.graph, quantized_bucket_cap_mb=100 / 2**20)
        before = copy_graph(gm.graph)
        self.assertRewrites(gm, sink_quantized_receives)
        self.assertTrue(check_rewrite("test", before, gm.graph))
        gm = hook_graph(shapes=((16,), (8,)), feedback=True, reduce_scatter=True)
        before = copy_graph(gm.graph)
        self.assertRewrites(gm, sink_quantized_receives)
        self.assertTrue(check_rewrite("test", before, gm.graph))

    def test_a_write_stops_it(self):
        gm = hook_graph(shapes=((16,), (8,)))
        nodes = list(gm.graph.nodes)
        first_wait = waits_of(gm, ALL_TO_ALL)[0]
        second = next(n for n in nodes[nodes.index(first_wait) :] if n.target is aten.cos.default)
        placeholder = next(n for n in nodes if n.op == "placeholder")
        with gm.graph.inserting_before(second):
            write = gm.graph.call_function(aten.mul_.Tensor, (placeholder, 2.0))
        sink_quantized_receives(gm.graph)
        at = positions(gm)
        gathers = [n for n in gm.graph.nodes if n.target is ALL_GATHER]
        self.assertLess(at[first_wait], at[write])
        self.assertLess(at[gathers[0]], at[write])

    def test_data_parallel_blocks_and_other_collectives_are_left_alone(self):
        gm = hook_graph(shapes=((16,), (8,)))
        for n in gm.graph.nodes:
            if n.target in (ALL_TO_ALL, ALL_GATHER):
                n.meta.setdefault("custom", {})[BLOCK] = "layers.0"
        text = graph_str(gm)
        self.assertFalse(sink_quantized_receives(gm.graph))
        self.assertEqual(graph_str(gm), text)
        fake_process_group(2)
        state = ch.LowPrecisionState(dist.group.WORLD)

        def fn(a, b):
            ch.bf16_compress_hook(state, a)
            ch.bf16_compress_hook(state, (b * a.sum()).cos())
            return a, b

        gm = trace(fn, torch.randn(16), torch.randn(16), world_size=None)
        text = graph_str(gm)
        self.assertFalse(sink_quantized_receives(gm.graph))
        self.assertEqual(graph_str(gm), text)

    def test_waits_are_moved_not_copied(self):
        gm = hook_graph()
        count = len(gm.graph.nodes)
        sink_quantized_receives(gm.graph)
        self.assertEqual(len(gm.graph.nodes), count)
        self.assertEqual(len(waits_of(gm, ALL_TO_ALL)), 3)
        self.assertTrue(all(w.target is WAIT for w in waits_of(gm, ALL_TO_ALL)))


def numerics_worker(rank, world_size):
    """Three gradients through the int8 hook with error feedback, on the real group: the graph
    run before and after the pass from the same residuals gives the same gradients and keeps
    the same residuals, bit for bit."""
    state = ch.QuantizedState(dist.group.WORLD, block_size=8)
    g = torch.Generator().manual_seed(rank)
    args = [torch.randn(s, generator=g) for s in test_bucket_quantized_collectives.SHAPES]
    gm, residuals = test_bucket_quantized_collectives.traced_backward(state, args)
    start = state.state_dict()
    results = []
    for rewrite in (False, True):
        if rewrite:
            changed = sink_quantized_receives(gm.graph)
            gm.recompile()
        state.load_state_dict(start)
        grads = [a.clone() for a in args]
        gm(*grads, *residuals)
        gm(*grads, *residuals)  # a second step reads the residuals the first kept
        results.append((grads, state.state_dict()["errors"]))
    return changed, results


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_moved_graph_computes_the_same_values_on_gloo_ranks(world_size):
    for rank, (changed, (before, after)) in enumerate(run_ranks(numerics_worker, world_size)):
        assert changed, rank
        for b, a in zip(before[0], after[0]):
            assert torch.equal(b, a), rank
        assert before[1].keys() == after[1].keys() and len(before[1]) == 3, rank
        for name, parts in before[1].items():
            assert parts.keys() == after[1][name].keys() == {0, 1}, (rank, name)
            for part, t in parts.items():
                assert torch.equal(t, after[1][name][part]), (rank, name, part)
