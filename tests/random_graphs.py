"""A seeded generator of graphs the passes may meet.

Families: one hook call; a DDP-shaped backward (many gradients, random shapes, a user's
scale in front of the hook, an intermediate that is also returned, part of the gradients
reduced in a subgroup); a ZeRO-shaped step (average, update, broadcast from an owner); the
ZeRO hooks' step over a real ``ZeroOptimizer`` (SGD-momentum, Adam or AdamW, whole parameters or
``shard_buckets``, interleaved or after backward, fp32 or bf16 hook, buckets of one parameter,
a few, or all); ``data_parallel``-shaped blocks of gathers and reduce-scatters under their block
marks; hand-written chains (random constant factors, casts, views, sum or avg, all_reduce or
reduce_scatter); and int8 hook calls in a DDP-shaped backward. Each case is ``(description,
make, args, world_size)``; ``make()`` builds the function and its process-group state, after
the fake group of ``world_size`` exists; ``args`` is a tuple, or a callable giving one that is
called after ``make()``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fcol

import compiled_hooks as ch
from compiled_hooks import compat

WORLD_SIZES = [1, 2, 3, 4, 6, 8, 16]
KINDS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
HOOKS = {
    "fp32": (ch.allreduce_hook, ch.reduce_scatter_hook, ch.DefaultState),
    "bf16": (ch.bf16_compress_hook, ch.bf16_compress_hook, ch.LowPrecisionState),
    "fp16": (ch.fp16_compress_hook, ch.fp16_compress_hook, ch.LowPrecisionState),
}

Case = tuple[str, Callable[[], Callable[..., Any]], tuple, int]


def _shape(rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3)))


def _tensor(rng: random.Random, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(rng.randrange(2**31)))


def _subgroup(ws: int):
    return dist.new_group(list(range(ws // 2))) if ws >= 4 else dist.group.WORLD


def hook_case(rng: random.Random, ws: int) -> Case:
    kind, sharded = rng.choice(list(HOOKS)), rng.random() < 0.5
    numel = rng.randint(1, 40)

    def make():
        ar, rs, state_cls = HOOKS[kind]
        state = state_cls(dist.group.WORLD)
        if sharded:
            return lambda g, o: (rs(state, g, o), o)[1]
        return lambda g: (ar(state, g), g)[1]

    args = (
        (_tensor(rng, (numel * ws,)), torch.empty(numel)) if sharded else (_tensor(rng, (numel,)),)
    )
    return f"hook {kind} {'rs' if sharded else 'ar'} n={numel}", make, args, ws


def ddp_case(rng: random.Random, ws: int) -> Case:
    kind = rng.choice(list(HOOKS))
    shapes = [_shape(rng) for _ in range(rng.randint(1, 10))]
    scale = rng.choice([None, None, 0.5, 2.0, 3.0, 1.0 / ws])
    extra_user = rng.random() < 0.2
    mixed = rng.random() < 0.3 and ws >= 4
    in_subgroup = [mixed and rng.random() < 0.5 for _ in shapes]

    def make():
        hook, _, state_cls = HOOKS[kind]
        world, sub = state_cls(dist.group.WORLD), state_cls(_subgroup(ws))

        def fn(*grads):
            extras = []
            for g, use_sub in zip(grads, in_subgroup):
                g.copy_(torch.sin(g))
                if scale is not None:
                    g.mul_(scale)
                if extra_user:
                    extras.append(g.sum())
                hook(sub if use_sub else world, g)
            return (*grads, *extras)

        return fn

    desc = f"ddp {kind} params={len(shapes)} scale={scale} extra_user={extra_user} mixed={mixed}"
    return desc, make, tuple(_tensor(rng, s) for s in shapes), ws


def zero_case(rng: random.Random, ws: int) -> Case:
    wire = rng.choice([torch.float32, torch.bfloat16])
    shapes = [_shape(rng) for _ in range(rng.randint(1, 6))]
    lr = rng.choice([0.1, 0.01])

    def make():
        def fn(*tensors):
            n = len(tensors) // 2
            for i, (p, g) in enumerate(zip(tensors[:n], tensors[n:])):
                avg = fcol.all_reduce((g / ws).to(wire), "sum", dist.group.WORLD).to(g.dtype)
                g.copy_(avg)
                p.copy_(fcol.broadcast(p - lr * avg, i % ws, dist.group.WORLD))
            return tensors

        return fn

    args = tuple(_tensor(rng, s) for s in shapes) * 2
    return f"zero wire={wire} params={len(shapes)}", make, args, ws


def chain_case(rng: random.Random, ws: int) -> Case:
    wire = rng.choice([None, torch.bfloat16, torch.float16])
    rs = rng.random() < 0.4
    op = rng.choice(["sum", "sum", "avg"])
    factors = [1.0 / ws, 0.5, 2.0, 0.25, 4.0, 3.0, 1.0 / 3, 1.0]
    pre = [(rng.choice(["mul", "div"]), rng.choice(factors)) for _ in range(rng.randint(0, 2))]
    post = [(rng.choice(["mul", "div"]), rng.choice(factors)) for _ in range(rng.randint(0, 2))]
    second_user = rng.random() < 0.15
    numel = rng.randint(1, 16) * ws

    def apply(t, ops):
        for how, c in ops:
            t = t * c if how == "mul" else t / c
        return t

    def make():
        def fn(x):
            y = apply(x, pre)
            side = y.sum() if second_user else None
            if wire is not None:
                y = y.to(wire)
            if rs:
                r = compat.reduce_scatter_single(y.view(-1), op, 0, dist.group.WORLD)
            else:
                r = fcol.all_reduce(y, op, dist.group.WORLD)
            r = apply(r, post)
            out = r.to(x.dtype)
            return (out, side) if second_user else out

        return fn

    kind = "rs" if rs else "ar"
    desc = f"chain wire={wire} {kind} {op} pre={pre} post={post} second_user={second_user}"
    return desc, make, (_tensor(rng, (numel,)),), ws


def zero_optimizer_case(rng: random.Random, ws: int) -> Case:
    from tests.graphs import zero_optimizer, zero_step_fn

    optimizer, kw = rng.choice(
        [
            (torch.optim.SGD, dict(momentum=0.9)),
            (torch.optim.Adam, {}),
            (torch.optim.AdamW, dict(weight_decay=0.1)),
        ]
    )
    shapes = [_shape(rng) for _ in range(rng.randint(1, 5))]
    shard, interleaved, kind = rng.random() < 0.5, rng.random() < 0.5, rng.choice(["fp32", "bf16"])
    built = {}

    def make():
        zero = zero_optimizer(ws, shapes, optimizer, shard_buckets=shard, **kw)
        built["fn"], built["args"] = zero_step_fn(
            zero, kind, interleaved, bucket_bytes=rng.choice([1, 100, 10**6])
        )
        return built["fn"]

    desc = (
        f"ZeroOptimizer {optimizer.__name__} shard_buckets={shard} interleaved={interleaved} "
        f"{kind} params={len(shapes)}"
    )
    return desc, make, lambda: built["args"](rng.randint(0, 1000)), ws


def data_parallel_case(rng: random.Random, ws: int) -> Case:
    """data_parallel-shaped: blocks of 1-3 parameter shards, each all-gathered (cast first for a
    compressed kind) under its block's mark, used, and a gradient of it reduce-scattered back to
    the shard's shape through the kind's hook, also under the mark."""
    from torch.fx.traceback import annotate

    from compiled_hooks.graph_contract import BLOCK

    blocks = [[_shape(rng) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(1, 4))]
    kind = rng.choice(list(HOOKS))

    def make():
        _, rs, state_cls = HOOKS[kind]
        state, wire = state_cls(dist.group.WORLD), KINDS[kind]

        def fn(*shards):
            it, x, grads = iter(shards), torch.zeros(()), []
            for b, shapes in enumerate(blocks):
                with annotate({BLOCK: str(b)}):
                    for _ in shapes:
                        shard = next(it)
                        full = compat.all_gather_single(
                            shard if wire is None else shard.to(wire), 0, dist.group.WORLD
                        )
                        x = x + torch.sin(full.float()).sum()
                        grad = torch.empty_like(shard)
                        rs(state, torch.cos(full.float() * x), grad)
                        grads.append(grad)
            return grads

        return fn

    args = tuple(_tensor(rng, shape) for shapes in blocks for shape in shapes)
    return f"data_parallel {kind} blocks={[len(b) for b in blocks]}", make, args, ws


def int8_case(rng: random.Random, ws: int) -> Case:
    """A DDP-shaped backward through ``int8_compress_hook``: gradients of random shapes, each
    after some compute, all-reduced or reduce-scattered (the shard returned), with or without
    error feedback, part of them in a subgroup."""
    shapes = [_shape(rng) for _ in range(rng.randint(1, 8))]
    block, feedback, sharded = rng.choice([1, 4, 32, 256]), rng.random() < 0.5, rng.random() < 0.3
    in_subgroup = [ws >= 4 and rng.random() < 0.3 for _ in shapes]

    def make():
        world = ch.QuantizedState(dist.group.WORLD, block_size=block, error_feedback=feedback)
        sub = ch.QuantizedState(_subgroup(ws), block_size=block, error_feedback=feedback)

        def fn(*grads):
            shards = []
            for i, (g, use_sub) in enumerate(zip(grads, in_subgroup)):
                state = sub if use_sub else world
                g.copy_(torch.sin(g))
                if sharded:
                    flat = torch.nn.functional.pad(
                        g.reshape(-1), (0, -g.numel() % state.world_size)
                    )
                    shards.append(flat.new_empty(flat.numel() // state.world_size))
                    ch.int8_compress_hook(state, flat, shards[-1], param=f"p{i}")
                else:
                    ch.int8_compress_hook(state, g, param=f"p{i}")
            return (*grads, *shards)

        return fn

    desc = f"int8 params={len(shapes)} block={block} feedback={feedback} sharded={sharded}"
    return desc, make, tuple(_tensor(rng, s) for s in shapes), ws


FAMILIES = [
    hook_case,
    ddp_case,
    zero_case,
    zero_optimizer_case,
    chain_case,
    data_parallel_case,
    int8_case,
]


def random_case(rng: random.Random) -> Case:
    return rng.choice(FAMILIES)(rng, rng.choice(WORLD_SIZES))


def random_options(rng: random.Random) -> dict[str, float]:
    return {
        "bucket_cap_mb": rng.choice([None, 25.0, 1e-4, 5e-4]),
        "first_bucket_cap_mb": rng.choice([1.0, 1e-4]),
        "quantized_bucket_cap_mb": rng.choice([None, 1e-4, 1e-3]),
    }
