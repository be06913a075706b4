"""ddp_comm_hook in both of DDP's modes, on 2 gloo ranks."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import compiled_hooks as ch
from tests.ranks import run_ranks

# unit roundoff of the wire dtype
EPS = {"bf16": 2.0**-8, "fp16": 2.0**-11}


def assert_within_rounding(g, ref, wire, msg):
    """|g - mean| <= 2 eps (mean_r |g_r| + |mean|): one rounding per rank's cast, one per sum."""
    mean, abs_mean = ref
    bound = 2 * EPS[wire] * (abs_mean + mean.abs()) + 1e-12
    err = (g - mean).abs()
    assert (err <= bound).all(), (
        f"{msg}: max error {err.max():.3g}, worst ratio {(err / bound).max():.3g}"
    )


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 4),
    )


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def _mean_grads(net, x, y, world_size):
    """fp32 reference: this rank's local gradients averaged across ranks by hand."""
    ref = copy.deepcopy(net)
    ref.zero_grad()
    _loss(ref, x, y).backward()
    grads = []
    for p in ref.parameters():
        parts = [torch.empty_like(p.grad) for _ in range(world_size)]
        dist.all_gather(parts, p.grad)
        stacked = torch.stack(parts)
        grads.append((stacked.mean(0), stacked.abs().mean(0)))
    return grads


def eager_worker(rank, world_size, mode):
    if mode == "python_reducer":
        torch._dynamo.config.optimize_ddp = "python_reducer"
    out = {}
    for name, state_cls, hook in [
        ("none", None, None),
        ("allreduce", ch.DefaultState, ch.allreduce_hook),
        ("bf16", ch.LowPrecisionState, ch.bf16_compress_hook),
        ("fp16", ch.LowPrecisionState, ch.fp16_compress_hook),
    ]:
        net = _net()
        ddp = DDP(net, bucket_cap_mb=0.001)  # several buckets
        if hook is not None:
            ddp.register_comm_hook(state_cls(dist.group.WORLD), ch.ddp_comm_hook(hook))
        x, y = _batch(rank, 0)
        ref = _mean_grads(net, x, y, world_size)
        _loss(ddp, x, y).backward()
        out[name] = ([p.grad.clone() for p in net.parameters()], ref)
    return out


@pytest.mark.parametrize("mode", ["cpp_reducer", "python_reducer"])
def test_eager_ddp(mode):
    ranks = run_ranks(eager_worker, 2, mode)
    for name in ranks[0]:
        for rank, out in enumerate(ranks):
            grads, ref = out[name]
            for i, (g, r) in enumerate(zip(grads, ref)):
                assert torch.equal(g, ranks[0][name][0][i]), (
                    f"{name}: rank {rank} differs from rank 0"
                )
                if name in ("none", "allreduce"):
                    torch.testing.assert_close(g, r[0], rtol=1e-6, atol=1e-7)
                else:
                    assert_within_rounding(g, r, name, f"{name} param {i}")
        if name == "allreduce":  # same as DDP's own averaging, bit for bit (2 ranks: g/2 summed)
            for g, g0 in zip(ranks[0][name][0], ranks[0]["none"][0]):
                assert torch.equal(g, g0)


def compiled_worker(rank, world_size, steps):
    net = _net()
    ddp, model = ch.compile_ddp(net, ch.LowPrecisionState(dist.group.WORLD), ch.bf16_compress_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    history = []
    for step in range(steps):
        x, y = _batch(rank, step)
        ref = _mean_grads(net, x, y, world_size)
        opt.zero_grad()
        with ch.compiled_autograd():
            _loss(model, x, y).backward()
        history.append(([p.grad.clone() for p in net.parameters()], ref))
        opt.step()
    counters = dict(torch._dynamo.utils.counters["compiled_autograd"])
    return history, [p.detach().clone() for p in net.parameters()], counters


@pytest.mark.slow
def test_compiled_ddp_bf16_hook():
    ranks = run_ranks(compiled_worker, 2, 4, timeout=300)
    (hist0, params0, counters0), (hist1, params1, _) = ranks
    assert counters0.get("captures", 0) >= 1, counters0  # the backward really was compiled
    for step, ((g0, ref), (g1, _)) in enumerate(zip(hist0, hist1)):
        for i, (a, b, r) in enumerate(zip(g0, g1, ref)):
            assert torch.equal(a, b), f"step {step} param {i}: ranks disagree"
            assert_within_rounding(a, r, "bf16", f"step {step} param {i} vs fp32 mean")
    for a, b in zip(params0, params1):
        assert torch.equal(a, b)
    assert not torch.equal(params0[0], _net()[0].weight)  # the optimizer did move them
