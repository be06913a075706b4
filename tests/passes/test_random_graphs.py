"""Every pass on a few hundred random graphs: each result is unchanged or computes the same.

RANDOM_GRAPHS=N and RANDOM_GRAPHS_SEED=S run more graphs or another sequence; the seed and the
counts are printed in the test summary.
"""

import os
import random

import pytest
from torch._dynamo.utils import counters

import passes
from passes.core.verify import check_rewrite, copy_graph
from passes.schedule_collectives import schedule_problems
from passes.testing import graph_str, trace
from tests.random_graphs import random_case, random_options

COUNT = int(os.environ.get("RANDOM_GRAPHS", "200"))
SEED = int(os.environ.get("RANDOM_GRAPHS_SEED", "0"))


def _pipelines(rng):
    opts = random_options(rng)
    quantized_cap = opts.pop("quantized_bucket_cap_mb")
    return {
        "fold_collective_scaling": passes.Pipeline([passes.fold_collective_scaling]),
        "bucket_compressed_collectives": passes.Pipeline(
            [passes.bucket_compressed_collectives], **opts
        ),
        "bucket_quantized_collectives": passes.Pipeline(
            [passes.bucket_quantized_collectives], quantized_bucket_cap_mb=quantized_cap
        ),
        "default_pipeline": passes.default_pipeline(**opts, quantized_bucket_cap_mb=quantized_cap),
        "default_pipeline + shard_weight_update": passes.default_pipeline(
            shard_weight_update=True, **opts, quantized_bucket_cap_mb=quantized_cap
        ),
    }


@pytest.mark.slow
def test_random_graphs(summary):
    rng = random.Random(SEED)
    counters["passes"].clear()
    tally = {"graphs": 0, "rewritten": 0, "unchanged": 0}
    for i in range(COUNT):
        desc, make, args, world_size = random_case(rng)
        trace(lambda: None, world_size=world_size)
        fn = make()
        gm = trace(fn, *(args() if callable(args) else args), world_size=world_size)
        gm.graph.eliminate_dead_code()  # as Inductor's graphs: the ZeRO step leaves dead views
        tally["graphs"] += 1
        for name, pipeline in _pipelines(rng).items():
            graph = copy_graph(gm.graph)
            context = f"graph {i} (seed {SEED}): {desc}, {name}"
            try:
                changed = pipeline.run(graph)
                if changed:
                    assert check_rewrite(name, gm.graph, graph, seed=i), (
                        f"{context}: could not be verified"
                    )
                    tally["rewritten"] += 1
                else:
                    assert graph_str(graph) == graph_str(gm.graph), (
                        f"{context}: changed but said it did not"
                    )
                    tally["unchanged"] += 1
                if name.startswith("default_pipeline"):
                    problems = schedule_problems(graph)
                    assert not problems, f"{context}: not scheduled: {problems}"
                text = graph_str(graph)
                assert not pipeline.run(graph) and graph_str(graph) == text, (
                    f"{context}: not idempotent"
                )
            except AssertionError as e:
                raise AssertionError(f"{context}\n{e}") from None
    skipped = {k: v for k, v in counters["passes"].items() if "verify skipped" in k}
    assert not skipped, skipped
    summary(
        f"randomized pass test: seed {SEED}, {tally['graphs']} graphs x 5 pipelines: "
        f"{tally['rewritten']} rewrites verified, {tally['unchanged']} left unchanged"
    )
    assert tally["rewritten"] > COUNT // 2  # the generator really exercises the passes
