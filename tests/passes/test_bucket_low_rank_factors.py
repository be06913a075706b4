"""bucket_low_rank_factors on traced PowerSGD graphs (fake process group)."""

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from compiled_hooks.powersgd import PowerSGDState, powerSGD_hook
from passes import bucket_low_rank_factors, default_pipeline, fold_collective_scaling
from passes.core.verify import check_rewrite, copy_graph
from passes.schedule_collectives import schedule_problems
from passes.testing import trace
from tests.passcase import PassTestCase

# (4, 32) and the bias do not compress at rank 2
SHAPES = [
    (32, 16),
    (32,),
    (32, 32),
    (4, 32),
    (64, 8, 3),
]


def powersgd_graph(shapes=SHAPES, rank=2, world_size=2):
    """The graph of one compressed step of powerSGD_hook over gradients of ``shapes``."""
    trace(lambda: None, world_size=world_size)
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    state = PowerSGDState(dist.group.WORLD, matrix_approximation_rank=rank, start_powerSGD_iter=2)
    for _ in range(2):  # two uncompressed steps, run eagerly (the fake group does not communicate)
        for p in params:
            powerSGD_hook(state, torch.randn(p.shape), param=p)
    assert state.compressing

    slots = [s for s in state._slots.values() if s.compress]

    def step(*tensors):  # gradients, then each compressed slot's error and Q (traced as inputs)
        grads, rest = tensors[: len(params)], tensors[len(params) :]
        for s, error, q in zip(slots, rest[0::2], rest[1::2]):
            s.error, s.q = error, q
        for g, p in zip(grads, params):
            powerSGD_hook(state, g, param=p)

    inputs = [torch.randn(s) for s in shapes] + [t.clone() for s in slots for t in (s.error, s.q)]
    gm = trace(step, *inputs, world_size=world_size)
    fold_collective_scaling(gm.graph)
    return gm


def all_reduces(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "all_reduce" in str(n.target)]


class TestBucketLowRankFactors(PassTestCase):
    def test_one_all_reduce_per_round(self):
        gm = powersgd_graph()
        before = copy_graph(gm.graph)
        # 3 compressed gradients x (P, Q) + 2 uncompressed
        self.assertEqual(len(all_reduces(gm)), 8)
        self.assertRewrites(gm, bucket_low_rank_factors)
        # In the order of their last inputs: the uncompressed bucket (averaged: the division
        # folded; 32 + 4x32 elements), P (summed; 32x2 + 32x2 + 64x2), Q (averaged; 16x2 + 32x2 +
        # 24x2)
        self.assertEqual(
            [(n.args[1], n.meta["val"].numel()) for n in all_reduces(gm)],
            [("avg", 160), ("sum", 256), ("avg", 144)],
        )
        self.assertTrue(check_rewrite("bucket_low_rank_factors", before, gm.graph))
        self.assertEqual(
            counters["passes"]["bucket_low_rank_factors: bucketed 3 factor all_reduces into one"], 2
        )
        self.assertEqual(
            counters["passes"]["bucket_low_rank_factors: bucketed 2 factor all_reduces into one"], 1
        )

    def test_cap_splits_a_round(self):
        gm = powersgd_graph()
        # P pieces are 256 + 256 + 512 bytes: a 600-byte cap gives a bucket of two and the third
        # alone; Q pieces are 128 + 256 + 192 bytes: one bucket; the uncompressed 128 + 512: two.
        self.assertTrue(bucket_low_rank_factors(gm.graph, factor_bucket_cap_mb=600 / 2**20))
        self.assertEqual(len(all_reduces(gm)), 5)

    def test_single_compressed_gradient_left_alone(self):
        gm = powersgd_graph(shapes=[(32, 32), (32,)])
        self.assertFalse(bucket_low_rank_factors(gm.graph))

    def test_uncompressed_phase_left_alone(self):
        """Before start_powerSGD_iter there are no factors: the full gradients keep their own
        all_reduces, issued as each is ready."""
        trace(lambda: None, world_size=2)
        params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
        state = PowerSGDState(dist.group.WORLD, matrix_approximation_rank=2, start_powerSGD_iter=2)

        def step(*grads):
            for g, p in zip(grads, params):
                powerSGD_hook(state, g, param=p)

        gm = trace(step, *[torch.randn(s) for s in SHAPES], world_size=2)
        fold_collective_scaling(gm.graph)
        self.assertEqual(len(all_reduces(gm)), len(SHAPES))
        self.assertFalse(bucket_low_rank_factors(gm.graph))

    def test_in_default_pipeline(self):
        gm = powersgd_graph()
        before = copy_graph(gm.graph)
        self.assertTrue(default_pipeline(verify=True).run(gm.graph))
        self.assertEqual(len(all_reduces(gm)), 3)
        self.assertEqual(schedule_problems(gm.graph), [])
        self.assertTrue(check_rewrite("default_pipeline", before, gm.graph))
