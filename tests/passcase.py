"""Base class for pass snapshot tests."""

import expecttest
import torch
from torch._dynamo.utils import counters

from passes.testing import graph_str


class PassTestCase(expecttest.TestCase):
    def setUp(self):
        counters["passes"].clear()

    def assertRewrites(self, gm, graph_pass, **options):
        """The pass changes the graph, keeps it valid, and changes nothing when run again."""
        self.assertTrue(graph_pass(gm.graph, **options))
        gm.graph.lint()
        gm.recompile()
        text = graph_str(gm)
        self.assertFalse(graph_pass(gm.graph, **options), "second run changed the graph")
        self.assertEqual(graph_str(gm), text)

    def assertUntouched(self, gm, graph_pass, reason, **options):
        """The pass leaves the graph as it was and counts why."""
        text = graph_str(gm)
        self.assertFalse(graph_pass(gm.graph, **options))
        self.assertEqual(graph_str(gm), text)
        name = graph_pass.__name__
        reasons = [k for k in counters["passes"] if k.startswith(f"{name}: skipped")]
        reasons += [k for k in counters["passes"] if k.startswith(f"{name}: skipped bucket")]
        self.assertTrue(
            any(reason in k for k in reasons), f"no skip reason {reason!r} in {reasons}"
        )

    def meta_consistent(self, gm):
        for n in gm.graph.nodes:
            if n.op == "call_function":
                v = n.meta.get("val")
                self.assertIsInstance(v, torch.Tensor, n.name)
