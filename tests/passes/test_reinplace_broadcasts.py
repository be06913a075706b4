"""reinplace_broadcasts: broadcasts of packed values run in place (fake
process group): snapshot, numerics, idempotence, what is left alone."""

import torch

from passes import reinplace_broadcasts
from passes.core.verify import check_rewrite, copy_graph
from passes.testing import graph_str, trace
from tests.passcase import PassTestCase

c10d = torch.ops._c10d_functional


def broadcasts(gm):
    return [n for n in gm.graph.nodes if "broadcast" in str(n.target)]


class TestReinplaceBroadcasts(PassTestCase):
    def test_packed_broadcast_in_place(self):
        def fn(a, b):
            w = c10d.wait_tensor(c10d.broadcast(torch.cat([a * 2, b * 2]), 0, "0"))
            return w + 1

        gm = trace(fn, torch.randn(3), torch.randn(2), world_size=2)
        before = copy_graph(gm.graph)
        self.assertRewrites(gm, reinplace_broadcasts)
        self.assertExpectedInline(
            graph_str(gm),
            """\
a_1: f32[3] = input
b_1: f32[2] = input
mul: f32[3] = aten.mul(a_1, 2)
mul_1: f32[2] = aten.mul(b_1, 2)
cat: f32[5] = aten.cat([mul, mul_1])
broadcast: f32[5] = c10d.broadcast_(cat, 0, group(size=2))
wait_tensor: f32[5] = c10d.wait_tensor(broadcast)
add: f32[5] = aten.add(wait_tensor, 1)
return add""",
        )
        self.assertTrue(check_rewrite("reinplace_broadcasts", before, gm.graph))

    def test_owner_broadcasts_of_packed_values(self):
        """Per-owner broadcasts of packed new values (as the ZeRO hooks issued them before they
        broadcast every rank's row) on 2 and 4 ranks: each runs in place; values unchanged."""

        def step(a, b, c):
            first = c10d.wait_tensor(c10d.broadcast(torch.cat([a * 2, b * 2]), 0, "0"))
            second = c10d.wait_tensor(c10d.broadcast(torch.cat([c - 1, c + 1]), 1, "0"))
            return first + 1, second * 3

        for world_size in (2, 4):
            gm = trace(step, torch.randn(3), torch.randn(2), torch.randn(4), world_size=world_size)
            before = copy_graph(gm.graph)
            self.assertRewrites(gm, reinplace_broadcasts)
            self.assertEqual([n.target for n in broadcasts(gm)], [c10d.broadcast_.default] * 2)
            self.assertTrue(check_rewrite("reinplace_broadcasts", before, gm.graph))

    def test_left_alone(self):
        def read_twice(a, b):
            x = torch.cat([a, b])
            return c10d.wait_tensor(c10d.broadcast(x, 0, "0")) + x

        def graph_input(a):
            return c10d.wait_tensor(c10d.broadcast(a, 0, "0")) + a

        self.assertUntouched(
            trace(read_twice, torch.randn(3), torch.randn(2), world_size=2),
            reinplace_broadcasts,
            "another user",
        )
        gm = trace(graph_input, torch.randn(3), world_size=2)
        text = graph_str(gm)
        self.assertFalse(reinplace_broadcasts(gm.graph))
        self.assertEqual(graph_str(gm), text)
