"""insert_rank_guard on traced graphs (fake process group): where the check goes, what it
records, idempotence, what is left alone; and the check_ranks option of Pipeline / install."""

import json

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from passes import (
    Pipeline,
    bucket_compressed_collectives,
    default_pipeline,
    insert_rank_guard,
    install,
)
from passes.insert_rank_guard import collective_record
from passes.testing import fake_process_group, graph_str, trace
from tests.graphs import ddp_args, ddp_fn
from tests.passcase import PassTestCase


def _record(gm) -> dict:
    (check,) = [
        n for n in gm.graph.nodes if n.target is torch.ops.compiled_hooks.check_ranks.default
    ]
    return json.loads(check.args[0])


class TestInsertRankGuard(PassTestCase):
    def test_snapshot(self):
        gm = trace(
            lambda a: fc.all_reduce(a * 2, "sum", dist.group.WORLD) + 1,
            torch.randn(4),
            world_size=2,
        )
        self.assertExpectedInline(
            graph_str(gm),
            """\
a_1: f32[4] = input
mul: f32[4] = aten.mul(a_1, 2)
all_reduce: f32[4] = c10d.all_reduce(mul, 'sum', group(size=2))
wait_tensor: f32[4] = c10d.wait_tensor(all_reduce)
add: f32[4] = aten.add(wait_tensor, 1)
return add""",
        )
        self.assertRewrites(gm, insert_rank_guard)
        self.assertExpectedInline(
            graph_str(gm),
            """\
a_1: f32[4] = input
check_ranks_default:  = compiled_hooks.check_ranks('{"0":[["all_reduce",["sum"],["float32",[4]],""]]}')
mul: f32[4] = aten.mul(a_1, 2)
all_reduce: f32[4] = c10d.all_reduce(mul, 'sum', group(size=2))
wait_tensor: f32[4] = c10d.wait_tensor(all_reduce)
add: f32[4] = aten.add(wait_tensor, 1)
return add""",
        )

    @pytest.mark.filterwarnings("ignore:.*reduce_scatter_tensor. is deprecated")
    def test_check_goes_first_and_records_every_collective_in_order(self):
        def fn(a, b):
            x = fc.all_reduce(a, "avg", dist.group.WORLD)
            y = fc.reduce_scatter_tensor(b.to(torch.bfloat16), "sum", 0, dist.group.WORLD)
            return x + 1, fc.broadcast(y, 3, dist.group.WORLD)

        gm = trace(fn, torch.randn(4), torch.randn(16), world_size=4)
        self.assertRewrites(gm, insert_rank_guard)
        record = _record(gm)
        self.assertEqual(list(record), [dist.group.WORLD.group_name])
        self.assertEqual(
            [e[:3] for e in record[dist.group.WORLD.group_name]],
            [
                ["all_reduce", ["avg"], ["float32", [4]]],
                ["reduce_scatter_tensor", ["sum", "4"], ["bfloat16", [16]]],
                ["broadcast", ["3"], ["bfloat16", [4]]],
            ],
        )
        first_non_input = next(n for n in gm.graph.nodes if n.op != "placeholder")
        self.assertIs(first_non_input.target, torch.ops.compiled_hooks.check_ranks.default)

    def test_records_the_order_the_other_passes_left(self):
        fake_process_group(2)
        gm = trace(ddp_fn("bf16"), *ddp_args([(8,), (8,), (8,)]), world_size=2)
        bucket_compressed_collectives(gm.graph)  # three all_reduces become one bucket
        self.assertRewrites(gm, insert_rank_guard)
        (entries,) = _record(gm).values()
        self.assertEqual([e[:3] for e in entries], [["all_reduce", ["sum"], ["bfloat16", [24]]]])

    def test_a_stale_check_is_replaced(self):
        fake_process_group(2)
        gm = trace(ddp_fn("bf16"), *ddp_args([(8,), (8,)]), world_size=2)
        insert_rank_guard(gm.graph)
        bucket_compressed_collectives(gm.graph)  # the graph changed after the check was made
        self.assertRewrites(gm, insert_rank_guard)
        (entries,) = _record(gm).values()
        self.assertEqual(len(entries), 1)

    def test_graph_without_collectives_is_left_alone(self):
        gm = trace(lambda x: x.sin() * 2, torch.randn(4), world_size=2)
        text = graph_str(gm)
        self.assertFalse(insert_rank_guard(gm.graph))
        self.assertEqual(graph_str(gm), text)
        self.assertEqual(collective_record(gm.graph), {})


def test_check_ranks_option(monkeypatch, fake_pg):
    assert not default_pipeline().check_ranks
    assert default_pipeline(check_ranks=True).check_ranks
    # FX graph cache key
    assert default_pipeline().uuid() != default_pipeline(check_ranks=True).uuid()
    assert "check_ranks=True" in repr(default_pipeline(check_ranks=True))
    monkeypatch.setenv("PASSES_CHECK_RANKS", "1")
    assert default_pipeline().check_ranks and not default_pipeline(check_ranks=False).check_ranks
    with install() as pipeline:
        assert pipeline.check_ranks
    monkeypatch.setenv("PASSES_CHECK_RANKS", "yes please")
    with pytest.raises(
        ValueError,
        match=r"environment variable PASSES_CHECK_RANKS='yes please': expected 1, 0, true or false",
    ):
        default_pipeline()
    monkeypatch.delenv("PASSES_CHECK_RANKS")
    with pytest.raises(TypeError, match="check_ranks must be True, False or None"):
        install(check_ranks="yes")
    with pytest.raises(ValueError, match="pass check_ranks= to the Pipeline you give"):
        install(Pipeline([bucket_compressed_collectives]), check_ranks=True)


def test_check_ranks_needs_an_initialized_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        install(check_ranks=True)


def test_fast_path_is_a_lookup_on_groups_with_nothing_to_compare(fake_pg):
    gm = trace(lambda a: fc.all_reduce(a, "sum", dist.group.WORLD), torch.randn(4), world_size=8)
    insert_rank_guard(gm.graph)
    gm.recompile()
    record = _record(gm)
    # a fake group: nothing to compare with
    torch.ops.compiled_hooks.check_ranks(json.dumps(record))
    torch.ops.compiled_hooks.check_ranks(json.dumps(record))
