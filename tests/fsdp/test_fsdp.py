"""compiled_hooks.fsdp.register_comm_hook on FSDP2, mirroring FSDP's comm-hook test suite
(test/distributed/fsdp/test_fsdp_comm_hooks.py) on CPU + 2 gloo ranks. FSDP1's strategies map to
FSDP2 layouts: FULL_SHARD / SHARD_GRAD_OP to fully_shard with reshard_after_forward True / False,
NO_SHARD to replicate (torch.distributed._composable.replicate_with_fsdp)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import compiled_hooks as ch
from compiled_hooks.fsdp import ALREADY, ROOT_ONLY, get_comm_hook, register_comm_hook
from tests.ranks import run_ranks

LAYOUTS = ["reshard_after_forward", "keep_unsharded", "replicate"]


def wrap(module, mesh, layout, mp=None):
    """FSDP2 in the layout standing for one FSDP1 sharding strategy."""
    mp = mp or MixedPrecisionPolicy()
    if layout == "replicate":
        return replicate(module, mesh=mesh, mp_policy=mp)
    return fully_shard(
        module, mesh=mesh, reshard_after_forward=layout == "reshard_after_forward", mp_policy=mp
    )


class Net(nn.Module):
    def __init__(self, has_wrapping, mesh, layout, mp=None):
        torch.manual_seed(0)
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.out = nn.Linear(8, 4)
        if has_wrapping:
            wrap(self.net[2], mesh, layout, mp)
            wrap(self.net, mesh, layout, mp)
        wrap(self, mesh, layout, mp)

    def forward(self, x):
        return self.out(torch.relu(self.net(x)))


def _raises(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return type(e), str(e)
    return None, "no exception"


def fsdp_worker(rank, world_size, layout):
    mesh = init_device_mesh("cpu", (world_size,))
    replicated = layout == "replicate"
    out = {}

    # default behaviour: the 1 x N linear layer with the rank as input averages gradients
    for name, hook in [
        ("fsdp default", None),
        ("plain hook", ch.allreduce_hook if replicated else ch.reduce_scatter_hook),
    ]:
        net = nn.Linear(1, world_size, bias=False)
        wrap(net, mesh, layout)
        if hook is not None:
            register_comm_hook(net, ch.DefaultState(dist.group.WORLD), hook)
        for _ in range(4):
            net.zero_grad()
            net(torch.tensor([float(rank)])).sum().backward()
        out[name] = net.weight.grad.to_local().clone()

    # registration rules
    model = Net(True, mesh, layout)
    subs = [
        m for m in model.modules() if m is not model and hasattr(m, "set_custom_reduce_scatter")
    ]
    out["default hook"] = [
        get_comm_hook(m) for m in model.modules() if hasattr(m, "set_custom_reduce_scatter")
    ]
    state = ch.LowPrecisionState(dist.group.WORLD)
    register_comm_hook(model, state, ch.bf16_compress_hook)
    out["registered"] = all(
        get_comm_hook(m) == (ch.bf16_compress_hook, state) for m in [model, *subs]
    )
    out["twice"] = _raises(lambda: register_comm_hook(model, state, ch.bf16_compress_hook))
    model = Net(True, mesh, layout)
    model(torch.randn(2, 8)).sum().backward()  # FSDP2 knows its root after the first forward
    out["non-root"] = _raises(
        lambda: register_comm_hook(subs_of(model)[1], state, ch.bf16_compress_hook)
    )
    model = Net(True, mesh, layout)
    subs_of(model)[1]._comm_hook = ch.bf16_compress_hook
    out["sub-module has one"] = _raises(
        lambda: register_comm_hook(model, state, ch.bf16_compress_hook)
    )
    model = Net(True, mesh, layout)
    register_comm_hook(subs_of(model)[0], state, ch.bf16_compress_hook)  # root not known yet
    out["non-root found late"] = _raises(lambda: model(torch.randn(2, 8)).sum().backward())
    wrong_hook = ch.reduce_scatter_hook if replicated else ch.allreduce_hook
    out["wrong hook"] = _raises(
        lambda: register_comm_hook(Net(False, mesh, layout), state, wrong_hook)
    )
    out["with reduce_dtype"] = _raises(
        lambda: register_comm_hook(
            Net(False, mesh, layout, MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)),
            state,
            ch.bf16_compress_hook,
        )
    )

    # low-precision hooks == FSDP2 mixed precision with reduce_dtype
    x = torch.rand(16, 8, generator=torch.Generator().manual_seed(rank))
    for has_wrapping in (True, False):
        for hook, dtype in [
            (ch.fp16_compress_hook, torch.float16),
            (ch.bf16_compress_hook, torch.bfloat16),
        ]:
            # compiled in the slow tier's layouts only: the first Inductor compile of each rank
            # process is the costliest part of the fast tier (docs/testing.md)
            compiles = (False, True) if layout != LAYOUTS[0] else (False,)
            for compile in compiles if dtype is torch.bfloat16 and has_wrapping else (False,):
                with_hook = Net(has_wrapping, mesh, layout)
                register_comm_hook(
                    with_hook, ch.LowPrecisionState(dist.group.WORLD), hook, compile=compile
                )
                with_mp = Net(has_wrapping, mesh, layout, MixedPrecisionPolicy(reduce_dtype=dtype))
                opt_hook = torch.optim.SGD(with_hook.parameters(), lr=0.1)
                opt_mp = torch.optim.SGD(with_mp.parameters(), lr=0.1)
                with_hook(x).sum().backward()
                with_mp(x).sum().backward()
                grads = [
                    (a.grad.to_local().clone(), b.grad.to_local().clone())
                    for a, b in zip(with_hook.parameters(), with_mp.parameters())
                ]
                opt_hook.step()
                opt_mp.step()
                params = [
                    (a.to_local().detach().clone(), b.to_local().detach().clone())
                    for a, b in zip(with_hook.parameters(), with_mp.parameters())
                ]
                out[f"mp {dtype} wrapping={has_wrapping} compile={compile}"] = (grads, params)
    out["compiled graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    if replicated:  # accumulating without communication would leave earlier micro-batches unreduced
        model = Net(False, mesh, layout)
        register_comm_hook(model, ch.DefaultState(dist.group.WORLD), ch.allreduce_hook)
        model.set_requires_all_reduce(False)
        out["no all-reduce"] = _raises(lambda: model(x).sum().backward())
    return out


def subs_of(model):
    return [
        m for m in model.modules() if m is not model and hasattr(m, "set_custom_reduce_scatter")
    ]


@pytest.fixture(
    scope="module",
    params=[LAYOUTS[0], *(pytest.param(layout, marks=pytest.mark.slow) for layout in LAYOUTS[1:])],
)
def outcomes(request):
    return run_ranks(fsdp_worker, 2, request.param, timeout=300)


def test_default_behaviour_averages_and_no_double_division(outcomes):
    for rank, out in enumerate(outcomes):
        mean = sum(range(2)) / 2  # the mean of the ranks, not the mean / N
        for name in ("fsdp default", "plain hook"):
            assert torch.equal(out[name], torch.full_like(out[name], mean)), (rank, name, out[name])


def test_registration_rules(outcomes):
    for out in outcomes:
        assert all(entry == (None, None) for entry in out["default hook"])
        assert out["registered"]
        assert out["twice"] == (AssertionError, ALREADY)
        assert out["non-root"] == (AssertionError, ROOT_ONLY)
        assert out["sub-module has one"] == (AssertionError, ALREADY)
        assert out["non-root found late"] == (AssertionError, ROOT_ONLY)
        kind, msg = out["wrong hook"]
        assert (
            kind is TypeError
            and ("hook(state, grad)" if "no all-reduce" in out else "hook(state, grad, output)")
            in msg
        )
        if "no all-reduce" in out:
            kind, msg = out["no all-reduce"]
            assert kind is NotImplementedError and "set_requires_all_reduce(False)" in msg
        assert (
            out["with reduce_dtype"][0] is ValueError
            and "reduce_dtype" in out["with reduce_dtype"][1]
        )


def test_low_precision_hooks_match_mixed_precision(outcomes):
    keys = [k for k in outcomes[0] if k.startswith("mp ")]
    compiled = any("compile=True" in k for k in keys)
    assert len(keys) == (5 if compiled else 4)
    # compile=True really compiled the hook
    assert all(out["compiled graphs"] >= compiled for out in outcomes)
    for rank, out in enumerate(outcomes):
        for key in keys:
            grads, params = out[key]
            for i, (a, b) in enumerate(grads):
                assert a.dtype == torch.float32  # the state's parameter type
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"rank {rank} {key} grad {i}")
            for i, (a, b) in enumerate(params):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"rank {rank} {key} param {i}")


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="FSDP1 needs an accelerator: 2 CUDA devices and NCCL"
)
def test_fsdp1_accepts_the_hooks():
    for per_rank in run_ranks(fsdp1_worker, 2, timeout=300, backend="nccl"):
        for strategy, ours, theirs in per_rank:
            for i, (a, b) in enumerate(zip(ours, theirs)):
                assert a.dtype == b.dtype == torch.float32
                # the project's hooks pre-divide before the fp16 cast; for normal values exact
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{strategy} param {i}")


def fsdp1_worker(rank, world_size):
    """FSDP1 with this project's hooks gives the eager originals' gradients (CUDA + NCCL)."""
    from torch.distributed.algorithms._comm_hooks import default_hooks as eager
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    torch.cuda.set_device(rank)
    results = []
    for strategy in (
        ShardingStrategy.FULL_SHARD,
        ShardingStrategy.SHARD_GRAD_OP,
        ShardingStrategy.NO_SHARD,
    ):
        grads = []
        for state_cls, hook in (
            (ch.LowPrecisionState, ch.fp16_compress_hook),
            (eager.LowPrecisionState, eager.fp16_compress_hook),
        ):
            torch.manual_seed(0)
            model = FSDP(
                nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).cuda(),
                sharding_strategy=strategy,
                device_id=rank,
            )
            model.register_comm_hook(state_cls(dist.group.WORLD), hook)
            x = torch.rand(4, 8, generator=torch.Generator().manual_seed(rank)).cuda()
            model(x).sum().backward()
            grads.append([p.grad.detach().cpu() for p in model.parameters()])
        results.append((str(strategy), *grads))
    return results
