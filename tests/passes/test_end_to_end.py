"""Compiled DDP + bf16_compress_hook with the installed pipeline, on 2 gloo ranks.

Counts the all_reduce calls in Inductor's output code, compares gradients with the run
without passes, and checks that no scale is left around any collective.
"""

import re

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import compiled_hooks as ch
import passes
from passes.core.chains import chains
from tests.ranks import run_ranks

LAYERS = 8


def _scales_left(graph):
    counters["e2e"]["scales around collectives"] += sum(
        len(c.scales()) for c in chains(graph, "e2e")
    )
    counters["e2e"]["collectives"] += len(chains(graph, "e2e"))
    return False


def e2e_worker(rank, world_size):
    torch._inductor.config.fx_graph_cache = False
    out = {}
    for use_passes in (False, True):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(LAYERS)])
        _, model = ch.compile_ddp(
            net, ch.LowPrecisionState(dist.group.WORLD), ch.bf16_compress_hook
        )
        for p in net.parameters():
            p.grad = torch.zeros_like(p)
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))

        def step(model=model, x=x):
            with ch.compiled_autograd():
                model(x).square().mean().backward()

        pipeline = passes.Pipeline(
            [passes.fold_collective_scaling, passes.bucket_compressed_collectives, _scales_left]
        )
        if use_passes:
            with passes.install(pipeline):
                _, codes = run_and_get_code(step)
        else:
            _, codes = run_and_get_code(step)
        code = "\n".join(codes)
        out[use_passes] = {
            "grads": [p.grad.clone() for p in net.parameters()],
            "all_reduce_calls": len(re.findall(r"_c10d_functional\.all_reduce_?\.default\(", code)),
            "avg_calls": len(re.findall(r"all_reduce_?\.default\(\w+, 'avg'", code)),
            "buckets": sum(v for k, v in counters["passes"].items() if "bucketed" in k),
            "scales_left": counters["e2e"]["scales around collectives"],
            "collectives_seen": counters["e2e"]["collectives"],
        }
    return out


@pytest.mark.slow
def test_compiled_ddp_with_pipeline():
    ranks = run_ranks(e2e_worker, 2, timeout=400)
    for rank, out in enumerate(ranks):
        plain, fused = out[False], out[True]
        assert plain["all_reduce_calls"] == 2 * LAYERS  # one per parameter without the passes
        assert fused["buckets"] >= 1
        assert fused["all_reduce_calls"] <= fused["buckets"], fused
        # gloo is not in AVG_BACKENDS (its avg is a sum and then a division pass over the bucket):
        # the collective stays a sum, the division stays in fp32 before the cast, in its kernel
        assert fused["avg_calls"] == 0
        assert fused["collectives_seen"] >= 1 and fused["scales_left"] == 0
        for i, (a, b) in enumerate(zip(plain["grads"], fused["grads"])):
            # 2 ranks, power-of-two factors: the same bf16 sums, so the same gradients
            torch.testing.assert_close(a, b, rtol=2.0**-7, atol=1e-6, msg=f"rank {rank} param {i}")
    for a, b in zip(ranks[0][True]["grads"], ranks[1][True]["grads"]):
        assert torch.equal(a, b)
