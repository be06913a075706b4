"""compiled_hooks.ShardedGradScaler: the original's decisions without host sync, on every rank."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchScaler

from compiled_hooks import ShardedGradScaler
from tests.hooks.test_ddp import _batch, _net
from tests.ranks import run_ranks

STEPS, INF_STEPS, INTERVAL = 10, {2: 1, 6: 0}, 3  # inject an inf at step s on rank INF_STEPS[s]


def _grads(scaled_loss, net, rank, step):
    x, y = _batch(rank, step)
    net.zero_grad()
    scaled_loss(x, y).backward()
    for p in net.parameters():  # the data-parallel average, as DDP would leave it
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    if INF_STEPS.get(step) == rank:
        next(net.parameters()).grad[0, 0] = float("inf")


def _run(rank, scaler_cls, opt_cls, compiled=False):
    net = _net()
    opt = opt_cls(
        net.parameters(), lr=0.01, **({"momentum": 0.9} if opt_cls is torch.optim.SGD else {})
    )
    scaler = scaler_cls(device="cpu", init_scale=2.0**10, growth_interval=INTERVAL)

    def scaled_loss(x, y):
        return scaler.scale(torch.nn.functional.mse_loss(net(x), y))

    def step():
        scaler.step(opt)
        scaler.update()

    if compiled:  # forward + loss scaling, and unscale + step + update, each one fullgraph region
        scaled_loss = torch.compile(scaled_loss, fullgraph=True)
        step = torch.compile(step, fullgraph=True)
    scaler.scale(torch.ones(()))  # create the scale tensor before compiling
    history = []
    for i in range(STEPS):
        _grads(scaled_loss, net, rank, i)
        step()
        history.append((scaler.get_scale(), [p.detach().clone() for p in net.parameters()]))
    return history


def equality_worker(rank, world_size):
    out = {}
    for opt_cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        out[opt_cls.__name__] = (
            _run(rank, ShardedGradScaler, opt_cls),
            _run(rank, TorchScaler, opt_cls),
        )
    return out


def _scales(history):
    return [s for s, _ in history]


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_matches_torch_sharded_grad_scaler(world_size):
    ranks = run_ranks(equality_worker, world_size)
    expected = [2.0**10, 2.0**10, 2.0**9, 2.0**9, 2.0**9, 2.0**10, 2.0**9, 2.0**9, 2.0**9, 2.0**10]
    for rank, out in enumerate(ranks):
        for name, (ours, theirs) in out.items():
            # an inf on one rank: every rank skips and halves; INTERVAL clean steps: doubles
            assert _scales(ours) == _scales(theirs) == expected, (
                rank,
                name,
                _scales(ours),
                _scales(theirs),
            )
            for step, ((_, a), (_, b)) in enumerate(zip(ours, theirs)):
                for pa, pb in zip(a, b):
                    assert torch.equal(pa, pb), f"rank {rank} {name} step {step}"
            # skipped steps leave the parameters exactly as they were; others move them
            assert all(torch.equal(x, y) for x, y in zip(ours[2][1], ours[1][1]))
            assert not torch.equal(ours[1][1][0], ours[0][1][0])
    for out in ranks[1:]:  # bitwise identical across ranks
        for name in out:
            for (_, a), (_, b) in zip(out[name][0], ranks[0][name][0]):
                assert all(torch.equal(x, y) for x, y in zip(a, b))


def compiled_worker(rank, world_size):
    compiled = _run(rank, ShardedGradScaler, torch.optim.SGD, compiled=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return compiled, _run(rank, ShardedGradScaler, torch.optim.SGD), graphs


@pytest.mark.slow
def test_compiled_fullgraph_step_matches_eager():
    for compiled, eager, graphs in run_ranks(compiled_worker, 2, timeout=400):
        # Dynamo compiled forward and step (fullgraph: no break, or it would have raised)
        assert graphs >= 2
        assert _scales(compiled) == _scales(eager)
        for (_, a), (_, b) in zip(compiled, eager):
            for x, y in zip(a, b):
                torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def fsdp2_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    out = []
    for scaler_cls in (ShardedGradScaler, TorchScaler):
        net = _net()
        for layer in net[::2]:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        opt = torch.optim.Adam(net.parameters(), lr=0.01)
        scaler = scaler_cls(device="cpu", init_scale=2.0**10, growth_interval=INTERVAL)
        history = []
        for i in range(STEPS):
            x, y = _batch(rank, i)
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(net(x), y)).backward()
            if INF_STEPS.get(i) == rank:
                next(net.parameters()).grad.to_local()[0, 0] = float("nan")
            scaler.step(opt)
            scaler.update()
            history.append(
                (scaler.get_scale(), [p.to_local().detach().clone() for p in net.parameters()])
            )
        out.append(history)
    return out


def test_fsdp2_dtensor_gradients():
    for rank, (ours, theirs) in enumerate(run_ranks(fsdp2_worker, 2, timeout=300)):
        assert _scales(ours) == _scales(theirs)
        assert _scales(ours)[2] == 2.0**9  # rank 1's nan at step 2 made this rank back off too
        for step, ((_, a), (_, b)) in enumerate(zip(ours, theirs)):
            for x, y in zip(a, b):
                assert torch.equal(x, y), f"rank {rank} step {step}"


def test_misuse_errors():
    net = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = ShardedGradScaler(device="cpu", process_group=None)
    with pytest.raises(RuntimeError, match="call scale\\(\\) first"):
        scaler.unscale_(opt)
    scaler.scale(net(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(
        RuntimeError,
        match="unscale_\\(\\) has already been called on this optimizer since the last update",
    ):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) is being called after step\\(\\)"):
        scaler.unscale_(opt)
    with pytest.raises(
        RuntimeError, match="step\\(\\) has already been called since the last update"
    ):
        scaler.step(opt)
    scaler.update()
    with pytest.raises(RuntimeError, match="No inf checks were recorded prior to update"):
        scaler.update()
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        scaler.step(opt, closure=lambda: 0.0)
    with pytest.raises(TypeError, match="supports SGD, Adam, AdamW"):
        scaler.step(torch.optim.Adagrad(net.parameters()))
    with pytest.raises(ValueError, match="dampening"):
        scaler.step(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, dampening=0.1))
    with pytest.raises(ValueError, match="growth factor must be > 1.0"):
        ShardedGradScaler(growth_factor=1.0)
    with pytest.raises(ValueError, match="backoff factor"):
        ShardedGradScaler(backoff_factor=1.5)
    with pytest.raises(RuntimeError, match="source state dict is empty"):
        scaler.load_state_dict({})
    state = scaler.state_dict()
    assert state == {
        "scale": 2.0**16,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "_growth_tracker": 1,
    }
    other = ShardedGradScaler(device="cpu", process_group=None)
    other.load_state_dict(state)
    assert other.state_dict() == state


def test_disabled_is_a_pass_through():
    scaler = ShardedGradScaler(enabled=False)
    t = torch.ones(2)
    assert scaler.scale(t) is t and scaler.get_scale() == 1.0 and scaler.state_dict() == {}


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: scale on the GPU, gradients on CPU"
)
def test_cpu_offloaded_gradients_with_scale_on_gpu():
    net = torch.nn.Linear(4, 4)  # parameters and gradients stay on CPU (FSDP's CPU offload)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = ShardedGradScaler(device="cuda", process_group=None)
    scaler._lazy_init(torch.device("cuda"))
    loss = net(torch.ones(1, 4)).sum()
    (loss * scaler._scale.cpu()).backward()
    net.weight.grad[0, 0] = float("nan")
    before = net.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(net.weight, before) and scaler.get_scale() == 2.0**15
