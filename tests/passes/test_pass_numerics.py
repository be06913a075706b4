"""Rewritten graphs compute what the originals compute, on 2 and 4 gloo ranks.

Each rank traces the same functions with the real group, runs the graph, applies the passes,
runs it again on the same inputs and compares outputs and the inputs written in place.
"""

import pytest
import torch

from passes import bucket_compressed_collectives, fold_collective_scaling
from passes.testing import trace
from tests.graphs import ddp_args, ddp_fn, hook_args, hook_fn
from tests.ranks import run_ranks

SHAPES = [(33, 7), (64,), (5, 4, 3), (1,)]


def _cases(world_size):
    for kind in ("fp32", "bf16", "fp16"):
        for sharded in (False, True):
            yield (
                f"hook/{kind}/{'rs' if sharded else 'ar'}",
                hook_fn(kind, sharded),
                hook_args(sharded, world_size, 40),
            )
        yield f"ddp/{kind}", ddp_fn(kind), ddp_args(SHAPES)


def _run(gm, args):
    args = [a.clone() for a in args]
    out = gm(*args)
    return [o.clone() for o in (out if isinstance(out, (list, tuple)) else [out])] + args


def numerics_worker(rank, world_size):
    results = {}
    for name, fn, args in _cases(world_size):
        args = tuple(a * (1 + rank) for a in args)  # every rank contributes something else
        gm = trace(fn, *args, world_size=None)
        before = _run(gm, args)
        changes = []
        # gloo implements avg (a sum, then a division pass): the default leaves it out for speed
        # only, so the fold into avg is checked on gloo's real collectives here
        for graph_pass, options in (
            (fold_collective_scaling, {"avg_backends": {"gloo"}}),
            (bucket_compressed_collectives, {}),
        ):
            changes.append(graph_pass(gm.graph, **options))
            gm.recompile()
            results[f"{name}/{graph_pass.__name__}"] = (before, _run(gm, args), changes[-1])
    return results


EPS = {"bf16": 2.0**-8, "fp16": 2.0**-11}


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_rewritten_graphs_compute_the_same_values(world_size):
    per_rank = run_ranks(numerics_worker, world_size)
    rewrites = {key: changed for key, (_, _, changed) in per_rank[0].items()}
    # the cases exercise the rewrites: every fold except fp16, every ddp-shaped fuse except fp32
    assert (
        rewrites["hook/bf16/ar/fold_collective_scaling"]
        and rewrites["hook/fp32/rs/fold_collective_scaling"]
    )
    assert not rewrites["hook/fp16/ar/fold_collective_scaling"]
    assert (
        rewrites["ddp/bf16/bucket_compressed_collectives"]
        and rewrites["ddp/fp16/bucket_compressed_collectives"]
    )
    assert not rewrites["ddp/fp32/bucket_compressed_collectives"]
    for rank, results in enumerate(per_rank):
        for key, (before, after, _) in results.items():
            kind = key.split("/")[1]
            for i, (b, a) in enumerate(zip(before, after)):
                msg = f"rank {rank} {key} tensor {i}: max diff {(b - a).abs().max()}"
                if world_size == 2 or kind == "fp32" or key.endswith("fold_collective_scaling"):
                    # factors are powers of two: folding is exact; with 2 ranks a sum is one
                    # rounding whatever the buffer layout
                    assert torch.equal(b, a), msg
                else:
                    # gloo's summation order for an element depends on its place in the buffer,
                    # so a bucket may round a wire-dtype sum differently: within 2 roundings
                    bound = 2 * EPS[kind] * b.abs().max()
                    assert ((b - a).abs() <= bound).all(), msg
