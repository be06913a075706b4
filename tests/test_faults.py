"""Failures are loud and shared: a dead rank makes the others raise, not hang; and long
compiled runs keep every rank's parameters bitwise identical."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import compiled_hooks as ch
import passes
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


def dying_worker(rank, world_size, compiled):
    """Two healthy steps, then rank 1 exits (code 3) and rank 0 runs a third step: rank 0
    returns what it raised and how long that took."""
    if compiled:
        net = _mlp()
        _, model = ch.compile_ddp(
            net, ch.LowPrecisionState(dist.group.WORLD), ch.bf16_compress_hook
        )
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        for p in net.parameters():
            p.grad = torch.zeros_like(p)

        def step(i):
            with passes.install():
                _train_step(model, opt, net, rank, i)
    else:
        state = ch.DefaultState(dist.group.WORLD)

        def step(i):
            ch.allreduce_hook(state, torch.ones(1024))

    step(0)
    step(1)  # healthy steps, compiled code warm
    if rank == 1:
        os._exit(3)  # dies mid-training, before the next step's collectives
    t0 = time.monotonic()
    try:
        step(2)
    except Exception as e:  # reported to the test
        return f"{type(e).__name__}: {str(e)[:300]}", time.monotonic() - t0
    return "no error", time.monotonic() - t0


@pytest.mark.parametrize(
    "compiled",
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["eager_hook", "compiled_ddp"],
)
def test_dead_rank_makes_the_others_raise(compiled):
    survivor, dead = rank_outcomes(
        dying_worker, 2, compiled, timeout=120, teardown=False, pg_timeout_s=PG_TIMEOUT_S
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
