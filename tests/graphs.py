"""Functions whose traced graphs look like what the passes meet: one hook call
(hook-shaped), or a backward that reduces one gradient after another (DDP-shaped: gradient
compute, then the hook, results written to the gradients at the end)."""

import torch
import torch.distributed as dist

import compiled_hooks as ch

HOOKS = {
    "fp32": (ch.allreduce_hook, ch.reduce_scatter_hook, ch.DefaultState),
    "bf16": (ch.bf16_compress_hook, ch.bf16_compress_hook, ch.LowPrecisionState),
    "fp16": (ch.fp16_compress_hook, ch.fp16_compress_hook, ch.LowPrecisionState),
}


def hook_fn(kind: str, sharded: bool, group=None):
    """``fn(grad)`` or ``fn(grad, output)`` calling the ``kind`` hook once."""
    ar_hook, rs_hook, state_cls = HOOKS[kind]
    state = state_cls(group or dist.group.WORLD)
    if sharded:
        def fn(grad, output):
            rs_hook(state, grad, output)
            return output
    else:
        def fn(grad):
            ar_hook(state, grad)
            return grad
    return fn


def hook_args(sharded: bool, world_size: int, numel: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(numel * world_size if sharded else numel, generator=g)
    return (grad, torch.empty(numel)) if sharded else (grad,)


def ddp_fn(kind: str, group=None):
    """``fn(*grads)``: each gradient is produced (sin), then reduced by the ``kind`` hook."""
    hook, _, state_cls = HOOKS[kind]
    state = state_cls(group or dist.group.WORLD)

    def fn(*grads):
        for g in grads:
            g.copy_(torch.sin(g))
            hook(state, g)
        return grads
    return fn


def ddp_args(shapes, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, generator=g) for s in shapes)
