"""Functions whose traced graphs look like what the passes meet: one hook call
(hook-shaped), a backward that reduces one gradient after another (DDP-shaped: gradient
compute, then the hook, results written to the gradients at the end), or a compiled
``data_parallel`` step's partitioned forward and backward."""

from unittest import mock

import torch
import torch.distributed as dist

import compiled_hooks as ch
from passes.core.ops import ALL_GATHER, REDUCE_SCATTER
from passes.testing import partitioned_graphs

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


def zero_step_fn(zero, kind: str, interleaved: bool, bucket_bytes: int = 1):
    """``fn(*grads, *params, *state)``: the ZeRO hooks' backward for ``zero`` (a ZeroOptimizer
    built on the fake group): gradients reduced by the ``kind`` hook in gradient-ready order in
    buckets of ``bucket_bytes`` (default: one parameter each), each bucket updated and broadcast
    either as soon as it is reduced or after the last one. The optimizer's tensors are rebound
    to the traced inputs (step counts, hyperparameter table, state), as Dynamo makes them."""
    from compiled_hooks.zero import ZeroStep

    hook, _, state_cls = HOOKS[kind]
    state = state_cls(dist.group.WORLD)
    n = len(zero.params)
    # built first: it lays out zero's state by its buckets (ZeroOptimizer.plan_buckets)
    core = ZeroStep(
        hook, zero, interleaved, bucket_bytes=bucket_bytes, first_bucket_bytes=bucket_bytes
    )
    owned = zero.storage.containers()

    def fn(*args):
        # as Dynamo traces the hooks
        with mock.patch("torch.compiler.is_compiling", return_value=True):
            return _fn(*args)

    def _fn(*args):
        grads, params, flat_state = args[:n], args[n : 2 * n], list(args[2 * n :])
        zero.params[:] = params  # the storage shares the list
        zero._index = {id(p): i for i, p in enumerate(params)}
        zero._steps, zero._table = flat_state.pop(0), flat_state.pop(0)
        for d in owned:
            for k in d:
                d[k] = flat_state.pop(0)
        for i in reversed(range(n)):
            core.add(state, i, torch.sin(grads[i]))  # the gradient's last backward op
        core.finish(state)
        return None

    def args(seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        grads = [torch.randn(p.shape, generator=g) for p in zero.params]
        params = [torch.randn(p.shape, generator=g) for p in zero.params]
        state = [zero._steps.clone(), zero._table.clone()] + [
            t.clone() for d in owned for t in d.values()
        ]
        return (*grads, *params, *state)

    return fn, args


def zero_optimizer(
    world_size: int, shapes, optimizer=torch.optim.Adam, shard_buckets: bool = False, **kw
):
    """A ZeroOptimizer on the fake ``world_size``-rank group over fresh parameters of ``shapes``."""
    from compiled_hooks.zero import ZeroOptimizer
    from passes.testing import fake_process_group

    fake_process_group(world_size)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    return ZeroOptimizer(params, optimizer, shard_buckets=shard_buckets, lr=0.1, **kw)


def mlp(layers: int = 4) -> torch.nn.Sequential:
    """``layers`` x (Linear(64, 64), ReLU), seeded: the small model of the schedule tests."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *[m for _ in range(layers) for m in (torch.nn.Linear(64, 64), torch.nn.ReLU())]
    )


def data_parallel_graphs(model, tokens) -> list[tuple[str, torch.fx.GraphModule]]:
    """The partitioned graphs of one step of ``torch.compile(model, fullgraph=True)`` (a
    ``data_parallel`` module, on the fake process group it was sharded on): ``("forward", gm)``,
    ``("backward", gm)``, and more only where the step broke the graph."""
    return partitioned_graphs(
        lambda compile: compile(model, fullgraph=True)(tokens).float().sum().backward()
    )


def gather_reduce_counts(gm: torch.fx.GraphModule) -> list[int]:
    """``[all-gathers, reduce-scatters]`` in ``gm``."""
    return [sum(n.target is op for n in gm.graph.nodes) for op in (ALL_GATHER, REDUCE_SCATTER)]
