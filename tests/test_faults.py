"""Failures are loud and shared: a dead rank makes the others raise, not hang; and long
compiled runs keep every rank's parameters bitwise identical."""

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import compiled_hooks as ch
import passes
from compiled_hooks.fsdp import data_parallel
from compiled_hooks.zero import ZeroOptimizer, hook_with_zero_step_interleaved
from tests.fsdp.test_data_parallel import Net
from tests.hooks.test_ddp import _batch
from tests.hooks.test_ddp import _net as _mlp
from tests.ranks import rank_outcomes, run_ranks

PG_TIMEOUT_S = 10


def _train_step(model, opt, net, rank, step):
    x, y = _batch(rank, step)
    opt.zero_grad(set_to_none=False)
    with ch.compiled_autograd():
        torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _dying_step(kind, rank):
    """``(step, phases, model)``: one training step of ``kind`` as a function of the step index,
    the phases at which rank 1 can exit in it ("before": between steps; "forward", "backward":
    from a hook of the model's inside that phase, eager ``data_parallel`` only), and that model
    (None for the others)."""
    if kind == "eager_hook":
        state = ch.DefaultState(dist.group.WORLD)
        return (lambda i: ch.allreduce_hook(state, torch.ones(1024))), {"before"}, None
    if kind == "compiled_ddp":
        net = _mlp()
        _, model = ch.compile_ddp(
            net, ch.LowPrecisionState(dist.group.WORLD), ch.bf16_compress_hook
        )
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        for p in net.parameters():
            p.grad = torch.zeros_like(p)

        def ddp_step(i):
            with passes.install():
                _train_step(model, opt, net, rank, i)

        return ddp_step, {"before"}, None
    if kind == "zero":
        net = _mlp()
        zero = ZeroOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-3)
        ddp, model = ch.compile_ddp(net)
        hook = hook_with_zero_step_interleaved(ch.allreduce_hook, ddp, zero)
        ddp.register_comm_hook(ch.DefaultState(dist.group.WORLD), hook)
        for p in net.parameters():
            p.grad = torch.zeros_like(p)

        def zero_step(i):
            x, y = _batch(rank, i)
            zero.zero_grad(set_to_none=False)
            with passes.install(), ch.compiled_autograd():
                torch.nn.functional.mse_loss(model(x), y).backward()

        return zero_step, {"before"}, None
    compiled = kind == "data_parallel_compiled"
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = data_parallel(Net(), mesh)
    run = torch.compile(model, fullgraph=True) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tokens = torch.randint(0, 10, (4, 6), generator=torch.Generator().manual_seed(rank))

    def dp_step(i):
        with passes.install():
            run(tokens).square().mean().backward()
        opt.step()
        opt.zero_grad()

    return dp_step, ({"before"} if compiled else {"before", "forward", "backward"}), model


def dying_worker(rank, world_size, kind, where):
    """Two healthy steps, then rank 1 exits (code 3) at ``where`` in the third (eager
    ``data_parallel``: as its second block starts its forward, or as the gradient reaches that
    block's output in backward) while rank 0 runs it: rank 0 returns what it raised and how
    long after the step's start."""
    step, phases, model = _dying_step(kind, rank)
    assert where in phases, (kind, where)
    step(0)
    step(1)  # healthy steps, compiled code warm
    if rank == 1:
        if where == "before":
            os._exit(3)  # dies mid-training, before the next step's collectives
        block = model.blocks[1]
        if where == "forward":
            block.register_forward_pre_hook(lambda *_: os._exit(3))
        else:

            def exit_in_backward(module, args, out):
                out.register_hook(lambda grad: os._exit(3))

            block.register_forward_hook(exit_in_backward)
    t0 = time.monotonic()
    try:
        step(2)
    except Exception as e:  # reported to the test
        return f"{type(e).__name__}: {str(e)[:300]}", time.monotonic() - t0
    return "no error", time.monotonic() - t0


@pytest.mark.parametrize(
    "kind, where",
    [
        ("eager_hook", "before"),
        ("data_parallel_eager", "forward"),
        ("data_parallel_eager", "backward"),
        pytest.param("compiled_ddp", "before", marks=pytest.mark.slow),
        pytest.param("data_parallel_compiled", "before", marks=pytest.mark.slow),
        pytest.param("zero", "before", marks=pytest.mark.slow),
    ],
)
def test_dead_rank_makes_the_others_raise(kind, where):
    survivor, dead = rank_outcomes(
        dying_worker, 2, kind, where, timeout=180, teardown=False, pg_timeout_s=PG_TIMEOUT_S
    )
    assert dead.status == "died" and dead.exitcode == 3, (survivor, dead)
    assert survivor.status == "ok", (survivor, dead)
    message, elapsed = survivor.result
    assert message != "no error", "rank 0 completed a step without its peer"
    assert elapsed < PG_TIMEOUT_S + 20, f"rank 0 raised only after {elapsed:.0f}s: {message}"


def determinism_worker(rank, world_size, steps):
    torch._inductor.config.fx_graph_cache = False  # so the passes run (and count) here
    net = _mlp()
    _, model = ch.compile_ddp(net, ch.LowPrecisionState(dist.group.WORLD), ch.bf16_compress_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    start = [p.detach().clone() for p in net.parameters()]
    with passes.install():
        for i in range(steps):
            _train_step(model, opt, net, rank, i)
    bucketed = sum(v for k, v in torch._dynamo.utils.counters["passes"].items() if "bucketed" in k)
    return start, [p.detach().clone() for p in net.parameters()], bucketed


@pytest.mark.slow
def test_hundred_compiled_steps_stay_bitwise_identical():
    (start, end0, bucketed), (_, end1, _) = run_ranks(determinism_worker, 2, 100, timeout=400)
    assert bucketed >= 1  # the passes were in the compiled step
    for a, b, s in zip(end0, end1, start):
        assert torch.equal(a, b)
        assert not torch.equal(a, s)
