"""interleave_zero_broadcasts, shard_weight_update, all_to_all_weight_update and
all_gather_as_all_to_all on traced ZeRO steps (fake process group): snapshots of the schedule,
idempotence, numerics (simulated collectives) and what is left alone."""

import torch
from torch._dynamo.utils import counters

from passes import (
    all_gather_as_all_to_all,
    all_to_all_weight_update,
    bucket_compressed_collectives,
    interleave_zero_broadcasts,
    shard_weight_update,
)
from passes.core.verify import check_rewrite, copy_graph
from passes.testing import graph_diff, graph_str, trace
from tests.graphs import zero_optimizer, zero_step_fn
from tests.passcase import PassTestCase


def traced_step(
    world_size=2,
    shapes=((3,), (2, 3)),
    interleaved=True,
    shard_buckets=False,
    kind="fp32",
    optimizer=torch.optim.SGD,
    bucket_bytes=1,
    **kw,
):
    zero = zero_optimizer(world_size, shapes, optimizer, shard_buckets=shard_buckets, **kw)
    fn, args = zero_step_fn(zero, kind, interleaved, bucket_bytes)
    gm = trace(fn, *args(), world_size=world_size)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def schedule(gm):
    """The communication schedule: collectives, waits (what they wait for) and parameter
    write-backs, one per line; ``update`` marks where an update's last op (its broadcast
    input) is computed, ``backward`` where a gradient's last backward op (``sin``) is."""
    text = {line.split(":", 1)[0]: line for line in graph_str(gm).splitlines()}
    lines = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if "c10d" in str(n.target) or getattr(n.target, "__name__", "").startswith("copy_"):
            lines.append(text[n.name])
        elif n.target is torch.ops.aten.sin.default:
            lines.append(f"backward -> {n.name}")
        elif any(
            getattr(u.target, "__name__", "").startswith("broadcast")
            or "all_gather" in str(u.target)
            for u in n.users
        ):
            lines.append(f"update -> {n.name}")
    return "\n".join(lines)


class TestInterleave(PassTestCase):
    def test_interleaved_update_waits_until_the_next_gradient_collective(self):
        gm = traced_step(interleaved=True)
        before = copy_graph(gm.graph)
        self.assertExpectedInline(
            schedule(gm),
            """\
backward -> sin
all_reduce: f32[12] = c10d.all_reduce(div, 'sum', group(size=2))
wait_tensor: f32[12] = c10d.wait_tensor(all_reduce)
update -> view_10
broadcast: f32[6] = c10d.broadcast(view_10, 0, group(size=2))
wait_tensor_1: f32[6] = c10d.wait_tensor(broadcast)
broadcast_1: f32[6] = c10d.broadcast(view_10, 1, group(size=2))
wait_tensor_2: f32[6] = c10d.wait_tensor(broadcast_1)
backward -> sin_1
all_reduce_1: f32[6] = c10d.all_reduce(div_1, 'sum', group(size=2))
wait_tensor_3: f32[6] = c10d.wait_tensor(all_reduce_1)
update -> view_23
broadcast_2: f32[3] = c10d.broadcast(view_23, 0, group(size=2))
wait_tensor_4: f32[3] = c10d.wait_tensor(broadcast_2)
broadcast_3: f32[3] = c10d.broadcast(view_23, 1, group(size=2))
wait_tensor_5: f32[3] = c10d.wait_tensor(broadcast_3)
copy_: f32[3] = aten.copy_(arg2_1, select_copy_9)
copy__1: f32[2, 3] = aten.copy_(arg3_1, view_12)
copy__2: f64[2] = aten.copy_(arg4_1, index_put_1)""",
        )
        self.assertRewrites(gm, interleave_zero_broadcasts)
        self.assertExpectedInline(
            schedule(gm),
            """\
backward -> sin
all_reduce: f32[12] = c10d.all_reduce(div, 'sum', group(size=2))
backward -> sin_1
all_reduce_1: f32[6] = c10d.all_reduce(div_1, 'sum', group(size=2))
wait_tensor: f32[12] = c10d.wait_tensor(all_reduce)
update -> view_10
broadcast: f32[6] = c10d.broadcast(view_10, 0, group(size=2))
broadcast_1: f32[6] = c10d.broadcast(view_10, 1, group(size=2))
wait_tensor_3: f32[6] = c10d.wait_tensor(all_reduce_1)
update -> view_23
broadcast_2: f32[3] = c10d.broadcast(view_23, 0, group(size=2))
broadcast_3: f32[3] = c10d.broadcast(view_23, 1, group(size=2))
wait_tensor_1: f32[6] = c10d.wait_tensor(broadcast)
wait_tensor_2: f32[6] = c10d.wait_tensor(broadcast_1)
wait_tensor_4: f32[3] = c10d.wait_tensor(broadcast_2)
wait_tensor_5: f32[3] = c10d.wait_tensor(broadcast_3)
copy_: f32[3] = aten.copy_(arg2_1, select_copy_9)
copy__1: f32[2, 3] = aten.copy_(arg3_1, view_12)
copy__2: f64[2] = aten.copy_(arg4_1, index_put_1)""",
        )
        check_rewrite("interleave_zero_broadcasts", before, gm.graph)

    def test_interleaved_compressed_update_stays_before_the_next_gradient_collective(self):
        """bf16 wire: the update goes just before the next gradient collective, so broadcasts
        stand between the two compressed all_reduces and bucket_compressed_collectives, on a second run
        of the pipeline, does not merge them (the pipeline stays idempotent)."""
        gm = traced_step(interleaved=True, kind="bf16")
        self.assertRewrites(gm, interleave_zero_broadcasts)
        nodes = list(gm.graph.nodes)
        reduces = [n for n in nodes if "all_reduce" in str(n.target)]
        first_broadcast = next(n for n in nodes if "broadcast" in str(n.target))
        self.assertLess(nodes.index(first_broadcast), nodes.index(reduces[1]))
        self.assertFalse(bucket_compressed_collectives(gm.graph))

    def test_after_backward_updates_follow_the_last_gradient(self):
        gm = traced_step(interleaved=False)
        before = copy_graph(gm.graph)
        self.assertExpectedInline(
            schedule(gm),
            """\
backward -> sin
all_reduce: f32[12] = c10d.all_reduce(div, 'sum', group(size=2))
wait_tensor: f32[12] = c10d.wait_tensor(all_reduce)
backward -> sin_1
all_reduce_1: f32[6] = c10d.all_reduce(div_1, 'sum', group(size=2))
wait_tensor_1: f32[6] = c10d.wait_tensor(all_reduce_1)
update -> view_15
broadcast: f32[6] = c10d.broadcast(view_15, 0, group(size=2))
wait_tensor_2: f32[6] = c10d.wait_tensor(broadcast)
broadcast_1: f32[6] = c10d.broadcast(view_15, 1, group(size=2))
wait_tensor_3: f32[6] = c10d.wait_tensor(broadcast_1)
update -> view_23
broadcast_2: f32[3] = c10d.broadcast(view_23, 0, group(size=2))
wait_tensor_4: f32[3] = c10d.wait_tensor(broadcast_2)
broadcast_3: f32[3] = c10d.broadcast(view_23, 1, group(size=2))
wait_tensor_5: f32[3] = c10d.wait_tensor(broadcast_3)
copy_: f32[3] = aten.copy_(arg2_1, select_copy_9)
copy__1: f32[2, 3] = aten.copy_(arg3_1, view_17)
copy__2: f64[2] = aten.copy_(arg4_1, index_put_1)""",
        )
        self.assertRewrites(gm, interleave_zero_broadcasts)
        self.assertExpectedInline(
            schedule(gm),
            """\
backward -> sin
all_reduce: f32[12] = c10d.all_reduce(div, 'sum', group(size=2))
wait_tensor: f32[12] = c10d.wait_tensor(all_reduce)
backward -> sin_1
all_reduce_1: f32[6] = c10d.all_reduce(div_1, 'sum', group(size=2))
update -> view_15
broadcast: f32[6] = c10d.broadcast(view_15, 0, group(size=2))
broadcast_1: f32[6] = c10d.broadcast(view_15, 1, group(size=2))
wait_tensor_1: f32[6] = c10d.wait_tensor(all_reduce_1)
update -> view_23
broadcast_2: f32[3] = c10d.broadcast(view_23, 0, group(size=2))
broadcast_3: f32[3] = c10d.broadcast(view_23, 1, group(size=2))
wait_tensor_2: f32[6] = c10d.wait_tensor(broadcast)
wait_tensor_3: f32[6] = c10d.wait_tensor(broadcast_1)
wait_tensor_4: f32[3] = c10d.wait_tensor(broadcast_2)
wait_tensor_5: f32[3] = c10d.wait_tensor(broadcast_3)
copy_: f32[3] = aten.copy_(arg2_1, select_copy_9)
copy__1: f32[2, 3] = aten.copy_(arg3_1, view_17)
copy__2: f64[2] = aten.copy_(arg4_1, index_put_1)""",
        )
        check_rewrite("interleave_zero_broadcasts", before, gm.graph)

    def test_no_zero_broadcast_untouched(self):
        gm = trace(
            lambda x: (
                torch.ops._c10d_functional.wait_tensor(
                    torch.ops._c10d_functional.broadcast(x * 2, 0, "0")
                )
                + 1
            ),
            torch.ones(4),
            world_size=2,
        )
        text = graph_str(gm)
        self.assertFalse(interleave_zero_broadcasts(gm.graph))
        self.assertEqual(graph_str(gm), text)


class TestShardWeightUpdate(PassTestCase):
    def test_all_reduce_and_broadcasts_become_reduce_scatter_and_all_gather(self):
        """The traced step of one sharded parameter: the gradient's all_reduce and this rank's
        slice of it become a reduce_scatter, the broadcasts of every rank's new slice an
        all_gather; nothing else changes."""
        gm = traced_step(shard_buckets=True, shapes=((3,),))
        before = copy_graph(gm.graph)
        self.assertRewrites(gm, shard_weight_update)
        self.assertExpectedInline(
            graph_diff(before, gm.graph),
            """\
-all_reduce: f32[4] = c10d.all_reduce(div, 'sum', group(size=2))
-wait_tensor: f32[4] = c10d.wait_tensor(all_reduce)
-view_3: f32[2, 2] = aten.view(wait_tensor, [2, 2])
+reduce_scatter_tensor_default: f32[2] = c10d.reduce_scatter_tensor(div, 'sum', 2, group(size=2))
+wait_tensor_default: f32[2] = c10d.wait_tensor(reduce_scatter_tensor_default)
...
-view_6: f32[4] = aten.view(view_3, [-1])
-view_7: f32[2, 2] = aten.view(view_6, [2, 2])
-index: f32[1, 2] = aten.index(view_7, [group_rank])
-view_8: f32[2] = aten.view(index, [-1])
+view_default: f32[1, 2] = aten.view(wait_tensor_default, [1, 2])
+view_8: f32[2] = aten.view(view_default, [-1])
...
-broadcast: f32[2] = c10d.broadcast(view_14, 0, group(size=2))
-wait_tensor_1: f32[2] = c10d.wait_tensor(broadcast)
-broadcast_1: f32[2] = c10d.broadcast(view_14, 1, group(size=2))
-wait_tensor_2: f32[2] = c10d.wait_tensor(broadcast_1)
-cat_2: f32[4] = aten.cat([wait_tensor_1, wait_tensor_2])
-view_15: f32[2, 2] = aten.view(cat_2, [2, -1])
+all_gather_into_tensor_default: f32[4] = c10d.all_gather_into_tensor(view_14, 2, group(size=2))
+wait_tensor_default_1: f32[4] = c10d.wait_tensor(all_gather_into_tensor_default)
+view_15: f32[2, 2] = aten.view(wait_tensor_default_1, [2, -1])""",
        )
        check_rewrite("shard_weight_update", before, gm.graph)

    def test_collective_counts_and_numerics(self):
        for world_size, kind in [(2, "fp32"), (4, "fp32"), (4, "bf16")]:
            gm = traced_step(
                world_size,
                shapes=((5,), (3, 7), (2,)),
                shard_buckets=True,
                kind=kind,
                optimizer=torch.optim.Adam,
            )
            before = copy_graph(gm.graph)

            def count(name, gm=gm):
                return sum(name in str(n.target) for n in gm.graph.nodes)

            self.assertEqual(
                (
                    count("all_reduce"),
                    count("broadcast"),
                    count("reduce_scatter"),
                    count("all_gather"),
                ),
                (3, 3 * world_size, 0, 0),
            )
            self.assertTrue(shard_weight_update(gm.graph))
            self.assertEqual(
                (
                    count("all_reduce"),
                    count("broadcast"),
                    count("reduce_scatter"),
                    count("all_gather"),
                ),
                (0, 0, 3, 3),
            )
            check_rewrite("shard_weight_update", before, gm.graph)

    def test_index_not_proven_to_be_this_rank_untouched(self):
        def fn(x, idx):
            w = torch.ops._c10d_functional.wait_tensor(
                torch.ops._c10d_functional.all_reduce(x, "sum", "0")
            )
            return w.view(2, 3)[idx]

        gm = trace(fn, torch.ones(6), torch.zeros(1, dtype=torch.long), world_size=2)
        text = graph_str(gm)
        self.assertFalse(shard_weight_update(gm.graph))
        self.assertEqual(graph_str(gm), text)

    def test_broadcasts_from_some_ranks_only_untouched(self):
        def fn(y):
            parts = [
                torch.ops._c10d_functional.wait_tensor(
                    torch.ops._c10d_functional.broadcast(y, src, "0")
                )
                for src in (0, 0)
            ]
            return torch.cat(parts)

        gm = trace(fn, torch.ones(3), world_size=2)
        text = graph_str(gm)
        self.assertFalse(shard_weight_update(gm.graph))
        self.assertEqual(graph_str(gm), text)


FAKE = {"all_to_all_backends": ("fake",)}


def counts(gm):
    names = ("all_reduce", "broadcast", "all_to_all", "all_gather", "reduce_scatter")
    return tuple(sum(name in str(n.target) for n in gm.graph.nodes) for name in names)


class TestAllToAllWeightUpdate(PassTestCase):
    def test_whole_parameter_step_exchanges_rows_in_chunks(self):
        """Whole parameters, one bucket of 5 + 2 elements (owners 0 and 1: rows of 5, the
        second padded): the all_reduce read in this rank's row becomes two all_to_all chunks
        of at most 3 elements per destination, summed; the two owners' broadcasts two
        all_gather chunks, which the write-back reads directly (the 2-element member from the
        first chunk, the 5-element one from both, joined), with no join of the whole rows."""
        gm = traced_step(shapes=((5,), (2,)), interleaved=False, bucket_bytes=1 << 20)
        before = copy_graph(gm.graph)
        self.assertRewrites(gm, all_to_all_weight_update, all_to_all_chunk_bytes=12, **FAKE)
        self.assertExpectedInline(
            schedule(gm),
            """\
backward -> sin
backward -> sin_1
all_to_all_single_default: f32[2, 3] = c10d.all_to_all_single(view_default, [1, 1], [1, 1], group(size=2))
all_to_all_single_default_1: f32[2, 2] = c10d.all_to_all_single(view_default_1, [1, 1], [1, 1], group(size=2))
wait_tensor_default: f32[2, 3] = c10d.wait_tensor(all_to_all_single_default)
wait_tensor_default_1: f32[2, 2] = c10d.wait_tensor(all_to_all_single_default_1)
update -> slice_tensor_4
all_gather_into_tensor_default: f32[6] = c10d.all_gather_into_tensor(slice_tensor_4, 2, group(size=2))
update -> slice_tensor_5
all_gather_into_tensor_default_1: f32[4] = c10d.all_gather_into_tensor(slice_tensor_5, 2, group(size=2))
wait_tensor_default_2: f32[6] = c10d.wait_tensor(all_gather_into_tensor_default)
wait_tensor_default_3: f32[4] = c10d.wait_tensor(all_gather_into_tensor_default_1)
copy_: f32[5] = aten.copy_(arg2_1, cat_default_4)
copy__1: f32[2] = aten.copy_(arg3_1, slice_tensor_6)
copy__2: f64[2] = aten.copy_(arg4_1, index_put)""",
        )
        check_rewrite(PASS_A2A, before, gm.graph)
        self.assertEqual(counts(gm), (0, 0, 2, 2, 0))
        # not the step scalars' table
        joins = [
            n
            for n in gm.graph.nodes
            if n.target is torch.ops.aten.cat.default
            and n.args[1:] == (1,)
            and n.meta["val"].dtype != torch.float64
        ]
        self.assertEqual(joins, [])
        self.assertEqual(counters["passes"][f"{PASS_A2A}: row read from the gathered chunks"], 2)

    def test_collective_counts_and_numerics(self):
        """Both ZeRO layouts, 2 and 4 ranks, fp32 and bf16 wires, one bucket per parameter
        (bucket_bytes=1): every all_reduce and every set of owner broadcasts rewritten; the
        values the simulated collectives give are unchanged."""
        for world_size, kind, shard_buckets in [
            (2, "fp32", False),
            (4, "bf16", False),
            (4, "fp32", True),
        ]:
            gm = traced_step(
                world_size,
                shapes=((5,), (3, 7), (2,)),
                shard_buckets=shard_buckets,
                kind=kind,
                optimizer=torch.optim.Adam,
            )
            before = copy_graph(gm.graph)
            self.assertEqual(counts(gm), (3, 3 * world_size, 0, 0, 0))
            self.assertTrue(all_to_all_weight_update(gm.graph, **FAKE))
            self.assertEqual(counts(gm), (0, 0, 3, 3, 0))
            check_rewrite(PASS_A2A, before, gm.graph)
            self.assertFalse(all_to_all_weight_update(gm.graph, **FAKE))  # idempotent

    def test_own_row_update_counts_and_numerics(self):
        """The sharded update (AdamW, one bucket whose rows balance: each rank computes its own
        row's deltas, the rows of deltas are broadcast): rewritten like the update of every
        member, with the values the simulated collectives give unchanged, fp32 and bf16 wires."""
        for kind, interleaved in [("fp32", True), ("bf16", False)]:
            gm = traced_step(
                2,
                shapes=((8,), (4, 4), (16,), (3,), (6,)),
                kind=kind,
                interleaved=interleaved,
                optimizer=torch.optim.AdamW,
                bucket_bytes=1 << 20,
                weight_decay=0.1,
            )
            # no owner select (a where on a 0-dim owner == rank); a where on the state's tail, whose
            # rows differ (25 | 24), keeps what lies there (lerp with a tensor weight decomposes
            # into a where on abs(weight) >= 0.5: not counted)
            wheres = [
                n
                for n in gm.graph.nodes
                if n.target is torch.ops.aten.where.self
                and n.args[0].target is not torch.ops.aten.ge.Scalar
            ]
            self.assertEqual([n.args[0].meta["val"].shape for n in wheres], [torch.Size([25])] * 2)
            before = copy_graph(gm.graph)
            self.assertEqual(counts(gm), (1, 2, 0, 0, 0))
            self.assertTrue(all_to_all_weight_update(gm.graph, **FAKE))
            self.assertEqual(counts(gm), (0, 0, 1, 1, 0))
            check_rewrite(PASS_A2A, before, gm.graph)

    def test_leaves_alone_a_backend_not_listed_and_an_index_not_this_rank(self):
        self.assertUntouched(traced_step(shapes=((3,),)), all_to_all_weight_update, "backend fake")

        def fn(x, idx):
            w = torch.ops._c10d_functional.wait_tensor(
                torch.ops._c10d_functional.all_reduce(x, "sum", "0")
            )
            return w.view(2, 3)[idx]

        gm = trace(fn, torch.ones(6), torch.zeros(1, dtype=torch.long), world_size=2)
        text = graph_str(gm)
        self.assertFalse(all_to_all_weight_update(gm.graph, **FAKE))
        self.assertEqual(graph_str(gm), text)

    def test_gathered_rows_are_waited_for_at_the_write_back(self):
        """After backward, one bucket per parameter, each exchanged in all_gather chunks of 3
        elements: a bucket's gathered chunks are read first by their join (a ``cat``), not by
        the write-back. The join moves down with the waits to the write-backs, so the second
        bucket's update and all_gathers run while the first bucket's are in flight."""
        gm = traced_step(shapes=((2,), (5,)), interleaved=False)
        all_to_all_weight_update(gm.graph, all_to_all_chunk_bytes=12, **FAKE)
        # as Dynamo traces the hooks: the second gradient waited for (and summed) only after the
        # first bucket's gathered rows are joined
        nodes = list(gm.graph.nodes)
        waits = [
            n
            for n in nodes
            if n.args and "wait" in str(n.target) and "all_to_all" in str(n.args[0].target)
        ]
        gathered = [
            n
            for n in nodes
            if n.args and "wait" in str(n.target) and "all_gather" in str(n.args[0].target)
        ]
        join = min((u for w in gathered for u in w.users), key=nodes.index)
        chain = {waits[-1]}
        for n in nodes[nodes.index(waits[-1]) : nodes.index(join)]:
            if n in chain or chain.intersection(n.all_input_nodes):
                chain.add(n)
                join.append(n)
                join = n
        before = copy_graph(gm.graph)
        self.assertRewrites(gm, interleave_zero_broadcasts)
        self.assertExpectedInline(
            schedule(gm),
            """\
backward -> sin
all_to_all_single_default: f32[2, 3] = c10d.all_to_all_single(view_default, [1, 1], [1, 1], group(size=2))
all_to_all_single_default_1: f32[2, 2] = c10d.all_to_all_single(view_default_1, [1, 1], [1, 1], group(size=2))
wait_tensor_default: f32[2, 3] = c10d.wait_tensor(all_to_all_single_default)
wait_tensor_default_1: f32[2, 2] = c10d.wait_tensor(all_to_all_single_default_1)
backward -> sin_1
all_to_all_single_default_2: f32[2, 2] = c10d.all_to_all_single(view_default_3, [1, 1], [1, 1], group(size=2))
update -> slice_tensor_4
all_gather_into_tensor_default: f32[6] = c10d.all_gather_into_tensor(slice_tensor_4, 2, group(size=2))
update -> slice_tensor_5
all_gather_into_tensor_default_1: f32[4] = c10d.all_gather_into_tensor(slice_tensor_5, 2, group(size=2))
wait_tensor_default_2: f32[2, 2] = c10d.wait_tensor(all_to_all_single_default_2)
update -> view_23
all_gather_into_tensor_default_2: f32[4] = c10d.all_gather_into_tensor(view_23, 2, group(size=2))
wait_tensor_default_3: f32[6] = c10d.wait_tensor(all_gather_into_tensor_default)
wait_tensor_default_4: f32[4] = c10d.wait_tensor(all_gather_into_tensor_default_1)
wait_tensor_default_5: f32[4] = c10d.wait_tensor(all_gather_into_tensor_default_2)
copy_: f32[2] = aten.copy_(arg2_1, select_copy_9)
copy__1: f32[5] = aten.copy_(arg3_1, cat_default_5)
copy__2: f64[2] = aten.copy_(arg4_1, index_put_1)""",
        )
        gathers = [n for n in gm.graph.nodes if "all_gather" in str(n.target)]
        nodes = list(gm.graph.nodes)
        self.assertLess(
            nodes.index(gathers[-1]), min(nodes.index(next(iter(g.users))) for g in gathers)
        )
        check_rewrite("interleave_zero_broadcasts", before, gm.graph)

    def test_interleaved_update_waits_for_all_chunks_of_the_next_gradient(self):
        """Interleaved, the second bucket's gradient exchanged in two all_to_all chunks: the
        first bucket's update and all_gather move down past both chunks, so the second bucket's
        gradient goes on the wire first."""
        gm = traced_step(shapes=((5,), (2,)), interleaved=True)
        all_to_all_weight_update(gm.graph, all_to_all_chunk_bytes=12, **FAKE)
        before = copy_graph(gm.graph)
        self.assertRewrites(gm, interleave_zero_broadcasts)
        nodes = list(gm.graph.nodes)
        exchanges = [n for n in nodes if "all_to_all" in str(n.target)]
        gathers = [n for n in nodes if "all_gather" in str(n.target)]
        self.assertEqual((len(exchanges), len(gathers)), (3, 3))
        self.assertLess(nodes.index(exchanges[-1]), nodes.index(gathers[0]))
        check_rewrite("interleave_zero_broadcasts", before, gm.graph)

    def test_chunk_size_must_be_positive(self):
        with self.assertRaisesRegex(ValueError, "all_to_all_chunk_bytes must be a positive int"):
            all_to_all_weight_update(
                traced_step(shapes=((3,),)).graph, all_to_all_chunk_bytes=0, **FAKE
            )


PASS_A2A = "all_to_all_weight_update"


class TestAllGatherAsAllToAll(PassTestCase):
    def test_all_gathers_go_out_as_all_to_alls(self):
        """After all_to_all_weight_update (two all_gather chunks in flight at once): each
        all_gather becomes an all_to_all of N copies of its input, values unchanged; the fake
        backend stands in for gloo here."""
        gm = traced_step(shapes=((5,), (2,)), interleaved=False, bucket_bytes=1 << 20)
        all_to_all_weight_update(gm.graph, all_to_all_chunk_bytes=12, **FAKE)
        before = copy_graph(gm.graph)
        self.assertRewrites(gm, all_gather_as_all_to_all, all_gather_backends=("fake",))
        self.assertExpectedInline(
            schedule(gm),
            """\
backward -> sin
backward -> sin_1
all_to_all_single_default: f32[2, 3] = c10d.all_to_all_single(view_default, [1, 1], [1, 1], group(size=2))
all_to_all_single_default_1: f32[2, 2] = c10d.all_to_all_single(view_default_1, [1, 1], [1, 1], group(size=2))
wait_tensor_default: f32[2, 3] = c10d.wait_tensor(all_to_all_single_default)
wait_tensor_default_1: f32[2, 2] = c10d.wait_tensor(all_to_all_single_default_1)
all_to_all_single_default_2: f32[6] = c10d.all_to_all_single(view_default_6, [3, 3], [3, 3], group(size=2))
all_to_all_single_default_3: f32[4] = c10d.all_to_all_single(view_default_7, [2, 2], [2, 2], group(size=2))
wait_tensor_default_2: f32[6] = c10d.wait_tensor(all_to_all_single_default_2)
wait_tensor_default_3: f32[4] = c10d.wait_tensor(all_to_all_single_default_3)
copy_: f32[5] = aten.copy_(arg2_1, cat_default_4)
copy__1: f32[2] = aten.copy_(arg3_1, slice_tensor_6)
copy__2: f64[2] = aten.copy_(arg4_1, index_put)""",
        )
        check_rewrite("all_gather_as_all_to_all", before, gm.graph)
        self.assertEqual(
            counters["passes"]["all_gather_as_all_to_all: all_gather -> all_to_all"], 2
        )

    def test_leaves_other_backends_alone(self):
        gm = traced_step(shapes=((5,), (2,)), interleaved=False, bucket_bytes=1 << 20)
        all_to_all_weight_update(gm.graph, **FAKE)
        self.assertUntouched(gm, all_gather_as_all_to_all, "backend fake")


class TestInterleaveLeavesAlone(PassTestCase):
    def test_update_after_a_write_to_what_it_reads_stays(self):
        """An update placed after a write to an input it reads would read the old value if it
        moved up to its gradient's wait: left where it is."""
        c10d = torch.ops._c10d_functional

        def fn(g, p, other, x):
            w = c10d.wait_tensor(c10d.all_reduce(g, "avg", "0"))
            other.copy_(c10d.wait_tensor(c10d.broadcast(p - 0.1 * w, 0, "0")))
            p.copy_(x)

        gm = trace(fn, *[torch.ones(4) for _ in range(4)], world_size=2)
        nodes = list(gm.graph.nodes)
        wait = next(n for n in nodes if n.name == "wait_tensor")
        write_p = next(
            n for n in nodes if n.target is torch.ops.aten.copy_.default and n.args[0].name == "p_1"
        )
        wait.append(write_p)  # the program writes p right after the gradient, then updates from p
        gm.graph.lint()
        self.assertUntouched(
            gm, interleave_zero_broadcasts, "a mutation between the gradient and the update"
        )

    def test_interleaved_update_with_a_write_before_the_next_gradient_stays(self):
        """Held back to the next gradient collective, the update would move past a write that
        comes before that collective (here the write-back of its own broadcast): left where it
        is."""
        c10d = torch.ops._c10d_functional

        def fn(g1, g2, p, other):
            w = c10d.wait_tensor(c10d.all_reduce(g1, "avg", "0"))
            other.copy_(c10d.wait_tensor(c10d.broadcast(p - 0.1 * w, 0, "0")))
            return c10d.wait_tensor(c10d.all_reduce(g2.sin(), "avg", "0"))

        gm = trace(fn, *[torch.ones(4) for _ in range(4)], world_size=2)
        nodes = list(gm.graph.nodes)
        published = next(n for n in nodes if n.name == "wait_tensor_1")
        published.append(next(n for n in nodes if n.target is torch.ops.aten.copy_.default))
        gm.graph.lint()
        self.assertUntouched(
            gm, interleave_zero_broadcasts, "a write between two gradient collectives"
        )


def _gloo_shard_worker(rank, world_size):
    """The same traced ZeRO step on a real gloo group: what the pass does by default and when
    gloo is asked for."""
    from torch._dynamo.utils import counters

    out = {}
    zero = zero_optimizer(world_size, ((5,), (3, 7)), torch.optim.SGD)
    fn, args = zero_step_fn(zero, "fp32", True)
    gm = trace(fn, *args(), world_size=None)
    gm.graph.eliminate_dead_code()
    out["all_to_all"] = (all_to_all_weight_update(gm.graph), counts(gm))
    for backends in (None, ("gloo",)):
        counters["passes"].clear()
        zero = zero_optimizer(world_size, ((5,), (3, 7)), torch.optim.SGD, shard_buckets=True)
        fn, args = zero_step_fn(zero, "fp32", True)
        gm = trace(fn, *args(), world_size=None)
        gm.graph.eliminate_dead_code()
        options = {} if backends is None else {"shard_backends": backends}
        changed = shard_weight_update(gm.graph, **options)
        out[backends] = (
            changed,
            sum("reduce_scatter" in str(n.target) for n in gm.graph.nodes),
            dict(counters["passes"]),
        )
    return out


def test_shard_weight_update_leaves_gloo_alone_by_default():
    from tests.ranks import run_ranks

    out = run_ranks(_gloo_shard_worker, 2)[0]
    changed, reduce_scatters, counts = out[None]
    assert not changed and reduce_scatters == 0, counts
    skipped = [k for k in counts if k.startswith("shard_weight_update: skipped: backend gloo")]
    assert skipped and "reduce_scatter costs more" in skipped[0], counts
    changed, reduce_scatters, _ = out[("gloo",)]
    assert changed and reduce_scatters == 2
    # all_to_all_weight_update is the one that rewrites gloo graphs by default
    assert out["all_to_all"] == (True, (0, 0, 2, 2, 0)), out["all_to_all"]


class TestShardBackends(PassTestCase):
    def test_backend_not_listed_untouched(self):
        gm = traced_step(shard_buckets=True, shapes=((3,),))
        self.assertUntouched(gm, shard_weight_update, "backend fake", shard_backends=("nccl",))


def test_interleave_leaves_int8_hooks_alone(monkeypatch):
    """An int8 hook's all-gather follows its all-to-all as a ZeRO broadcast follows its gradient
    collective; of int8 rows, it is not taken for one. Taken for one, the pass would reorder
    the graph."""
    import torch.distributed as dist

    import compiled_hooks as ch
    from passes.testing import fake_process_group

    fake_process_group(2)
    state = ch.QuantizedState(dist.group.WORLD, block_size=4, error_feedback=False)

    def fn(g1, g2):
        ch.int8_compress_hook(state, g1)
        ch.int8_compress_hook(state, g2.sin())

    gm = trace(fn, torch.ones(16), torch.ones(16), world_size=None)
    text = graph_str(gm)
    assert not interleave_zero_broadcasts(gm.graph) and graph_str(gm) == text
    import sys

    module = sys.modules["passes.interleave_zero_broadcasts"]  # the package exports the pass
    monkeypatch.setattr(module, "is_quantized", lambda n: False)
    assert interleave_zero_broadcasts(gm.graph)
