"""The hooks in DDP's C++ reducer (eager DDP): pending futures, values as the hooks', bad input.

``ddp_comm_hook(hook)`` hands the reducer ``hook.reduce_async``, which issues the bucket's
collective and returns at once. These tests hold one rank back and look at the other rank's
futures, compare with the same hook run to completion (a wrapper without ``reduce_async``
takes ``ddp_comm_hook``'s blocking path) and with torch's own hooks, on 2 gloo ranks.
"""

import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import compiled_hooks as ch
from compiled_hooks.powersgd import PowerSGDState, powerSGD_hook
from compiled_hooks.zero import ZeroOptimizer, hook_with_zero_step
from tests.ranks import run_ranks

HELD_BACK_S = 1.0
HOOKS = ["allreduce", "fp16", "bf16", "powerSGD"]
# int8's async form quantizes a bucket whole, the blocking form each gradient: only the
# pending-futures test runs it here (tests/hooks/test_quantized.py checks its values)
PENDING = [*HOOKS, "int8", "zero"]


def _net(hidden=1):
    torch.manual_seed(0)
    # 64x32 and the 64x64 ones compress at rank 2; the 4x64 head and every bias do not.
    layers = [torch.nn.Linear(32, 64), torch.nn.Tanh()]
    for _ in range(hidden):
        layers += [torch.nn.Linear(64, 64), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(64, 4))


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)


def _state_and_hook(name, ddp=None):
    # ZeRO's hook after the last bucket, reducing with allreduce_hook's async form
    if name == "zero":
        zero = ZeroOptimizer(ddp.module.parameters(), torch.optim.SGD, lr=0.1)
        return ch.DefaultState(dist.group.WORLD), hook_with_zero_step(ch.allreduce_hook, ddp, zero)
    if name == "powerSGD":
        return PowerSGDState(
            dist.group.WORLD, matrix_approximation_rank=2, start_powerSGD_iter=2
        ), powerSGD_hook
    if name == "allreduce":
        return ch.DefaultState(dist.group.WORLD), ch.allreduce_hook
    if name == "int8":
        return ch.QuantizedState(dist.group.WORLD, block_size=32), ch.int8_compress_hook
    return ch.LowPrecisionState(dist.group.WORLD), {
        "fp16": ch.fp16_compress_hook,
        "bf16": ch.bf16_compress_hook,
    }[name]


def _blocking(hook):
    """The same hook without its async form: ddp_comm_hook runs it to completion."""
    if "param" in hook.__code__.co_varnames:

        def run(state, grad, *, param=None):
            hook(state, grad, param=param)
    else:

        def run(state, grad):
            hook(state, grad)

    run.__name__ = hook.__name__
    return run


def _train(name, rank, steps, blocking=False, watch_step=None, net=None, bucket_cap_mb=0.001):
    """``steps`` SGD steps of eager DDP (by default one bucket per gradient) with the hook; per
    step the averaged gradients. At ``watch_step`` rank 1 starts its backward HELD_BACK_S late,
    and rank 0 records, per bucket, whether the hook's future was done when it returned."""
    net = net or _net()
    ddp = DDP(net, bucket_cap_mb=bucket_cap_mb)
    state, hook = _state_and_hook(name, ddp)
    reducer_hook = (
        hook if name == "zero" else ch.ddp_comm_hook(_blocking(hook) if blocking else hook)
    )
    calls = []

    def watched(state, bucket):
        fut = reducer_hook(state, bucket)
        calls.append(fut.done())
        return fut

    ddp.register_comm_hook(state, watched)
    # ZeRO steps in its hook
    opt = torch.optim.SGD(net.parameters(), lr=0.0 if name == "zero" else 0.1)
    grads, watched_calls = [], None
    for step in range(steps):
        opt.zero_grad()
        x, y = _batch(rank, step)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        if step == watch_step:
            dist.barrier()
            if rank == 1:
                time.sleep(HELD_BACK_S)
            calls.clear()
        loss.backward()
        if step == watch_step:
            watched_calls = list(calls)
        grads.append([p.grad.clone() for p in net.parameters()])
        opt.step()
    return grads, watched_calls


def _pending_worker(rank, world_size):
    return {name: _train(name, rank, 3, watch_step=2)[1] for name in PENDING}


@pytest.mark.slow  # a rank is held back on purpose: seconds of waiting
def test_hooks_return_pending_futures_while_a_rank_is_held_back():
    """Rank 1 starts its backward a second late (PowerSGD compressing by then): every hook call
    on rank 0 returns a future that is not done, since rank 1 has not sent its part yet. A hook
    that waited for its own collective would return a done future. hook_with_zero_step does so
    for every bucket but the last, whose call runs the optimizer step (as the original's)."""
    calls = run_ranks(_pending_worker, 2)[0]
    for name, per_bucket in calls.items():
        assert len(per_bucket) >= 3, (name, per_bucket)  # several buckets
        if name == "zero":
            per_bucket = per_bucket[:-1]
        for i, done in enumerate(per_bucket):
            assert not done, f"{name}: bucket {i}'s future was complete when the hook returned"


def _same_values_worker(rank, world_size):
    out = {}
    for name in HOOKS:
        for cap in (0.001, 1):  # one bucket per gradient; one bucket for all
            out[name, cap] = tuple(
                _train(name, rank, 4, blocking=blocking, net=_net(hidden=2), bucket_cap_mb=cap)[0]
                for blocking in (False, True)
            )
    return out


def test_async_form_gives_the_hooks_values_bit_for_bit():
    """4 steps with each hook's async form and with the hook run to completion per bucket: the
    same gradients, bit for bit, and the same on both ranks. PowerSGD compresses from step 2;
    in one bucket, its P and Q go in one all_reduce each instead of one per gradient, and the
    two 64x64 gradients' orthogonalizations run as one batch."""
    ranks = run_ranks(_same_values_worker, 2)
    for name in ranks[0]:
        for rank, out in enumerate(ranks):
            async_grads, blocking_grads = out[name]
            for step, (a, b) in enumerate(zip(async_grads, blocking_grads)):
                for i, (ga, gb) in enumerate(zip(a, b)):
                    assert torch.equal(ga, gb), (
                        f"{name} rank {rank} step {step} param {i}: async != blocking"
                    )
                    assert torch.equal(ga, ranks[0][name][0][step][i]), (
                        f"{name} step {step}: ranks differ"
                    )


def _torch_hook_worker(rank, world_size):
    out = {}
    for name, ours, theirs in [
        ("fp16", ch.fp16_compress_hook, torch_hooks.fp16_compress_hook),
        ("allreduce", ch.allreduce_hook, torch_hooks.allreduce_hook),
    ]:
        grads = []
        for hook, state in [
            (ch.ddp_comm_hook(ours), ch.LowPrecisionState(dist.group.WORLD)),
            (theirs, dist.group.WORLD),
        ]:
            net = _net()
            ddp = DDP(net, bucket_cap_mb=0.001)
            ddp.register_comm_hook(state, hook)
            x, y = _batch(rank, 0)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        out[name] = grads
    return out


def test_same_gradients_as_torchs_hooks():
    """On 2 ranks, pre-dividing by 2 before the cast (ours) and after it (torch's) round alike,
    so fp16_compress_hook equals torch's bit for bit, and allreduce_hook equals torch's."""
    for rank, out in enumerate(run_ranks(_torch_hook_worker, 2)):
        for name, (ours, theirs) in out.items():
            for i, (a, b) in enumerate(zip(ours, theirs)):
                assert torch.equal(a, b), f"{name} rank {rank} param {i}: ours != torch's"


def _bad_input_worker(rank, world_size):
    """A state whose parameter_type is not the gradients' dtype: the hook raises on every rank
    before any collective, and the group still works (no rank issued a collective alone)."""
    out = {}
    for name, state, hook in [
        (
            "fp16",
            ch.LowPrecisionState(dist.group.WORLD, parameter_type=torch.bfloat16),
            ch.fp16_compress_hook,
        ),
        ("allreduce", None, ch.allreduce_hook),
    ]:
        ddp = DDP(_net(), bucket_cap_mb=0.001)
        ddp.register_comm_hook(state, ch.ddp_comm_hook(hook))
        x, y = _batch(rank, 0)
        try:
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            out[name] = "no error"
        except Exception as e:  # the reducer wraps the hook's exception
            out[name] = str(e)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out["sum"] = t.item()
    return out


def test_bad_input_raises_on_every_rank_before_any_collective():
    for out in run_ranks(_bad_input_worker, 2):
        assert (
            "fp16_compress_hook: grad has dtype torch.float32 but the result is torch.bfloat16"
            in out["fp16"]
        )
        assert "allreduce_hook: state must be a DefaultState, got NoneType" in out["allreduce"]
        assert out["sum"] == 3.0


@pytest.mark.parametrize("rate", [0, 2])
def test_min_compression_rate_in_the_reducer(rate):
    """Elements per step before and after compression. min_compression_rate=0 compresses every
    gradient, as torch's rule says: the 4x64 head, and each bias as an n x 1 matrix (n + 1
    elements at rank 1); 2 compresses the two larger matrices only."""
    before, after = run_ranks(_rate_worker, 2, rate)[0]
    assert before == 64 * 32 + 64 * 64 + 4 * 64 + 64 + 64 + 4
    if rate == 0:
        assert after == (64 + 32) * 2 + (64 + 64) * 2 + (4 + 64) * 2 + 65 + 65 + 5
    else:
        assert after == (64 + 32) * 2 + (64 + 64) * 2 + 4 * 64 + 64 + 64 + 4


def _rate_worker(rank, world_size, rate):
    net = _net()
    ddp = DDP(net, bucket_cap_mb=0.001)
    state = PowerSGDState(
        dist.group.WORLD,
        matrix_approximation_rank=2,
        start_powerSGD_iter=2,
        min_compression_rate=rate,
    )
    ddp.register_comm_hook(state, ch.ddp_comm_hook(powerSGD_hook))
    for step in range(3):
        x, y = _batch(rank, step)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
    return state.compression_stats()[1:]
