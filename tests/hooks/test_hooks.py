"""Hook numerics on real gloo ranks: eager originals, the hand recipe, compiled vs eager."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._comm_hooks import default_hooks as eager

import compiled_hooks as ch
from tests.ranks import run_ranks

SHAPES = [(7, 5), (64,), (3, 4, 8)]
WIRE = {"fp16": torch.float16, "bf16": torch.bfloat16}
HOOK = {"fp16": ch.fp16_compress_hook, "bf16": ch.bf16_compress_hook}
EAGER_HOOK = {"fp16": eager.fp16_compress_hook, "bf16": eager.bf16_compress_hook}


def _grads(rank, world_size, shapes=SHAPES):
    g = torch.Generator().manual_seed(1234 + rank)
    # a wide range of magnitudes, so the pre/post split and the casts matter
    return [
        torch.randn(s, generator=g) * 10.0 ** torch.randint(-3, 4, s, generator=g) for s in shapes
    ]


def _recipe(world_size, grads_all, wire, pre, post):
    """pre-divide, cast, sum (exactly, in fp64), round to the wire dtype, post-divide, cast back."""
    parts = [(g / pre).to(wire).double() for g in grads_all]
    total = torch.stack(parts).sum(0).to(wire)
    return (total / post if post > 1 else total).to(torch.float32)


def _gather(t, world_size):
    out = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(out, t.contiguous())
    return out


def numerics_worker(rank, world_size):
    group = dist.group.WORLD
    state, lp = ch.DefaultState(group), ch.LowPrecisionState(group)
    pre, post = state.gradient_predivide_factor, state.gradient_postdivide_factor
    # The eager compression hooks call record_stream, which CPU tensors do not have.
    torch.Tensor.record_stream = lambda self, stream: None
    out = {}
    for i, g in enumerate(_grads(rank, world_size)):
        ours, ref = g.clone(), g.clone()
        ch.allreduce_hook(state, ours)
        eager.allreduce_hook(eager.DefaultState(group), ref)
        out[f"allreduce/{i}"] = (ours, ref)

        flat = g.reshape(-1)[: (g.numel() // world_size) * world_size].clone()
        shard = torch.empty(flat.numel() // world_size)
        ref_shard = torch.empty_like(shard)
        ch.reduce_scatter_hook(state, flat.clone(), shard)
        eager.reduce_scatter_hook(eager.DefaultState(group), flat.clone(), ref_shard)
        out[f"reduce_scatter/{i}"] = (shard, ref_shard)

        gathered = _gather(g, world_size)
        gathered_flat = _gather(flat, world_size)
        for name, wire in WIRE.items():
            ours = g.clone()
            HOOK[name](lp, ours)
            orig = g.clone()
            EAGER_HOOK[name](eager.LowPrecisionState(group), orig)
            out[f"{name}_allreduce/{i}"] = (
                ours,
                _recipe(world_size, gathered, wire, pre, post),
                orig,
            )

            shard = torch.empty(flat.numel() // world_size)
            HOOK[name](lp, flat.clone(), shard)
            orig_in, orig_out = flat.clone(), torch.empty(flat.numel() // world_size)
            EAGER_HOOK[name](eager.LowPrecisionState(group), orig_in, orig_out)
            full = _recipe(world_size, gathered_flat, wire, pre, post)
            out[f"{name}_reduce_scatter/{i}"] = (shard, full.chunk(world_size)[rank], orig_out)
    return out


TOL = {torch.float16: dict(rtol=2e-3, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5)}


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_hook_numerics(world_size):
    per_rank = run_ranks(numerics_worker, world_size)
    for rank, out in enumerate(per_rank):
        for key, (ours, ref, *orig) in out.items():
            kind = key.split("/")[0]
            assert ours.dtype == torch.float32, key
            if kind in ("allreduce", "reduce_scatter"):
                # the eager original, bit for bit
                assert torch.equal(ours, ref), f"rank {rank} {key}"
                continue
            wire = WIRE[kind.split("_")[0]]
            if world_size == 2:
                # one addition per element: the wire-dtype sum is the rounded exact sum
                assert torch.equal(ours, ref), f"rank {rank} {key}"
            else:
                # gloo's summation order is its own: within the wire dtype's rounding
                torch.testing.assert_close(ours, ref, **TOL[wire], msg=f"rank {rank} {key}")
            # and the eager original (patched to run on CPU) agrees to the same tolerance
            torch.testing.assert_close(
                ours, orig[0], **TOL[wire], msg=f"rank {rank} {key} vs eager"
            )
    # every rank holds the same all-reduced gradient
    for key in per_rank[0]:
        if "reduce_scatter" not in key:
            for out in per_rank[1:]:
                assert torch.equal(out[key][0], per_rank[0][key][0]), key
