"""ZeroOptimizer as a torch.optim.Optimizer: parameter groups, LR schedulers (no recompiles),
gradient clipping and sharded checkpoints, on gloo ranks against torch.optim fed the averaged
gradients."""

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

import compiled_hooks as ch
import passes
from compiled_hooks.zero import ZeroOptimizer, hook_with_zero_step, hook_with_zero_step_interleaved
from compiled_hooks.zero.checkpoint import flat_boxes
from tests.ranks import run_ranks

STEPS = 20
SCHEDULES = {"after_backward": hook_with_zero_step, "interleaved": hook_with_zero_step_interleaved}


def _net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 30),
        torch.nn.Tanh(),
        torch.nn.Linear(30, 17),
        torch.nn.Tanh(),
        torch.nn.Linear(17, 3),
    )


def _groups(net, decay):
    """The usual two groups: weight decay for the weights, none for the biases."""
    named = list(net.named_parameters())
    return [
        {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": decay},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
    ]


def _warmup_cosine(step):
    return (step + 1) / 5 if step < 5 else 0.5 * (1 + math.cos(math.pi * (step - 5) / (STEPS - 5)))


CONFIGS = {  # optimizer, its arguments, the weights' weight decay, the scheduler
    "adamw_lambda": (
        torch.optim.AdamW,
        dict(lr=0.01, betas=(0.9, 0.99)),
        0.1,
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine),
    ),
    "sgd_step": (
        torch.optim.SGD,
        dict(lr=0.1, momentum=0.9),
        0.01,
        lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5),
    ),
}


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 12, generator=g), torch.randn(6, 3, generator=g)


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def reference(world_size, config, max_norm=None):
    """Parameters after each step of torch's optimizer (same groups and scheduler) on the mean
    of the ranks' gradients, clipped first with clip_grad_norm_ if ``max_norm``; and the norms."""
    cls, kw, decay, scheduler = CONFIGS[config]
    net = _net()
    opt = cls(_groups(net, decay), foreach=False, **kw)
    sched = scheduler(opt)
    history, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        (sum(_loss(net, *_batch(r, step)) for r in range(world_size)) / world_size).backward()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)))
        opt.step()
        sched.step()
        history.append([p.detach().clone() for p in net.parameters()])
    return history, norms


def train_worker(rank, world_size, cases):
    """Per case (config, schedule, shard_buckets, mode, max_norm): parameters after every step
    of DDP + the ZeRO hook + the scheduler, the norms ZeroOptimizer measured, and (compiled)
    the graphs compiled after the first step. ``mode``: "cpp" (eager DDP's C++ reducer),
    "python" (its python reducer, eager), "compiled" (compiled DDP, aot_eager), "inductor" (the
    same with Inductor) or "step" (plain DDP, then ``zero.step()``); compiled with the default
    pipeline of passes installed."""
    out = {}
    for config, schedule, shard, mode, max_norm in cases:
        cls, kw, decay, scheduler = CONFIGS[config]
        torch._dynamo.config.optimize_ddp = True if mode == "cpp" else "python_reducer"
        torch._dynamo.reset()
        compiles = []

        def backend(gm, example_inputs, compiles=compiles, mode=mode):
            compiles.append(len(history))  # noqa: B023 - this iteration's, compiled within it
            return (
                torch._dynamo.lookup_backend("inductor")(gm, example_inputs)
                if mode == "inductor"
                else gm.forward
            )

        net = _net()
        zero = ZeroOptimizer(_groups(net, decay), cls, shard_buckets=shard, max_norm=max_norm, **kw)
        sched = scheduler(zero)
        ddp = DDP(net, bucket_cap_mb=0.001)
        if mode != "step":
            ddp.register_comm_hook(
                ch.DefaultState(dist.group.WORLD),
                SCHEDULES[schedule](ch.allreduce_hook, ddp, zero, shard_buckets=shard),
            )
        model = torch.compile(ddp, backend=backend) if mode in ("compiled", "inductor") else ddp
        history, norms = [], []
        for step in range(STEPS):
            zero.zero_grad()
            if mode in ("compiled", "inductor"):
                with passes.install(), ch.compiled_autograd(backend=backend):
                    _loss(model, *_batch(rank, step)).backward()
            else:
                _loss(model, *_batch(rank, step)).backward()
            if mode == "step":
                zero.step()
            sched.step()
            history.append([p.detach().clone() for p in net.parameters()])
            norms.append(float(zero.grad_norm))
        out[(config, schedule, shard, mode, max_norm)] = dict(
            history=history,
            norms=norms,
            recompiles=[c for c in compiles if c > 0],
            lrs=sched.get_last_lr(),
        )
    return out


def check(outcomes, world_size):
    for key in outcomes[0]:
        config, _, _, _, max_norm = key
        ref, ref_norms = reference(world_size, config, max_norm)
        for rank, out in enumerate(outcomes):
            got = out[key]
            for step, (params, expected) in enumerate(zip(got["history"], ref)):
                for i, (a, b) in enumerate(zip(params, expected)):
                    torch.testing.assert_close(
                        a, b, rtol=1e-6, atol=1e-7, msg=f"{key} rank {rank} step {step} param {i}"
                    )
                    # ranks agree
                    assert torch.equal(a, outcomes[0][key]["history"][step][i]), (
                        key,
                        rank,
                        step,
                        i,
                    )
            assert got["recompiles"] == [], (key, got["recompiles"])
            if max_norm is not None:
                torch.testing.assert_close(got["norms"], ref_norms, rtol=1e-6, atol=0, msg=str(key))
                # the test clips
                assert sum(n > max_norm for n in ref_norms) >= STEPS // 2, ref_norms


GROUPS = [
    ("adamw_lambda", "after_backward", False, "cpp", None),
    ("adamw_lambda", "interleaved", False, "python", None),
    ("adamw_lambda", "interleaved", True, "cpp", None),
    ("sgd_step", "after_backward", False, "python", None),
    ("sgd_step", "interleaved", True, "python", None),
]
CLIPPED = [
    ("adamw_lambda", "after_backward", shard, mode, 0.2)
    for shard in (False, True)
    for mode in ("cpp", "python", "step")
]


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_groups_and_schedulers_match_torch(world_size):
    """Two parameter groups (weight decay on the weights only) and a scheduler that changes
    the learning rate every step: AdamW + LambdaLR (warmup, then cosine) and SGD-momentum +
    StepLR, 20 steps, both schedules, whole parameters and shard_buckets, DDP's C++ and python
    reducers: torch's optimizer with the same groups and scheduler, within 1e-6."""
    check(run_ranks(train_worker, world_size, GROUPS, timeout=300), world_size)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_compiled_schedules_never_recompile(world_size):
    """Compiled DDP (aot_eager): the learning rate enters the graph as a tensor, so after the
    first step no graph is compiled again while the scheduler changes it every step."""
    cases = [
        ("adamw_lambda", "interleaved", False, "compiled", None),
        ("adamw_lambda", "after_backward", True, "compiled", None),
        ("sgd_step", "after_backward", True, "compiled", None),
        ("sgd_step", "interleaved", False, "compiled", None),
        ("adamw_lambda", "after_backward", False, "compiled", 0.2),
    ]
    check(run_ranks(train_worker, world_size, cases, timeout=600), world_size)


@pytest.mark.slow
def test_inductor_with_groups_scheduler_and_clipping():
    """The production path: Inductor with the default passes, two groups, LambdaLR and
    clipping, whole parameters after backward; torch's optimizer within 1e-6, no recompiles."""
    check(
        run_ranks(
            train_worker,
            2,
            [("adamw_lambda", "after_backward", False, "inductor", 0.2)],
            timeout=600,
        ),
        2,
    )


def test_clipping_matches_clip_grad_norm():
    """max_norm small enough to clip most steps: clip_grad_norm_ then AdamW, within 1e-6, and the
    norm ZeroOptimizer keeps in grad_norm is clip_grad_norm_'s; from the owners' rows (python
    reducer), the C++ reducer's averaged buckets, shard_buckets' slices, and ``step()`` after
    plain DDP."""
    check(run_ranks(train_worker, 2, CLIPPED, timeout=300), 2)


def test_every_scheduler_drives_the_step_tensors():
    """Every torch scheduler sets hyperparameters through param_groups; each value the step
    reads lands in the optimizer's table (OneCycleLR also cycles Adam's beta1)."""
    from compiled_hooks.zero.optim_math import COLUMNS
    from tests.graphs import zero_optimizer

    schedulers = {
        "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, _warmup_cosine),
        "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
        "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10),
        "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(
            o, max_lr=[0.1, 0.05], total_steps=10
        ),
        "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0),
        "CyclicLR": lambda o: torch.optim.lr_scheduler.CyclicLR(
            o, 0.01, 0.1, step_size_up=2, cycle_momentum=False
        ),
    }
    for name, make in schedulers.items():
        zero = zero_optimizer(2, [(4,), (3,)], torch.optim.AdamW)
        zero.add_param_group(
            {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.05, "weight_decay": 0.0}
        )
        sched = make(zero)
        seen = set()
        for _ in range(4):
            sched.step(1.0) if name == "ReduceLROnPlateau" else sched.step()
            for g, group in enumerate(zero.param_groups):
                row = dict(zip(COLUMNS, zero._table[g].tolist()))
                assert row["lr"] == group["lr"] and row["beta1"] == group["betas"][0], (
                    name,
                    g,
                    row,
                    group,
                )
                assert row["weight_decay"] == group["weight_decay"]
                seen.add(row["lr"])
        assert len(seen) > 2, (name, seen)


def test_flat_boxes_cover_a_flat_range():
    """A flat range of a tensor as boxes: each box a contiguous run, together exactly the range."""
    for shape in [(7,), (4, 5), (3, 4, 5), (2, 1, 3, 4)]:
        full = torch.arange(math.prod(shape)).view(shape)
        for lo in range(0, full.numel() + 1, 3):
            for hi in range(lo, full.numel() + 1, 4):
                covered = []
                for offsets, sizes, first in flat_boxes(shape, lo, hi):
                    box = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                    assert box.reshape(-1).tolist() == list(range(first, first + box.numel())), (
                        shape,
                        lo,
                        hi,
                    )
                    covered += box.reshape(-1).tolist()
                assert covered == list(range(lo, hi)), (shape, lo, hi)


# -- checkpoints -------------------------------------------------------------------------------


def _zero_run(shard, net=None):
    net = net or _net()
    zero = ZeroOptimizer(_groups(net, 0.1), torch.optim.AdamW, shard_buckets=shard, lr=0.01)
    ddp = DDP(net, bucket_cap_mb=0.001)
    ddp.register_comm_hook(
        ch.DefaultState(dist.group.WORLD),
        hook_with_zero_step(ch.allreduce_hook, ddp, zero, shard_buckets=shard),
    )
    return net, zero, ddp


def _train(ddp, zero, rank, steps, data_ranks):
    for step in steps:
        zero.zero_grad()
        _loss(ddp, *_batch(rank % data_ranks, step)).backward()


class Allocations(TorchDispatchMode):
    """The bytes of every floating-point tensor an op creates (views excluded; DCP's own
    coordination pickles plans into byte tensors), and the largest."""

    def __init__(self):
        super().__init__()
        self.total = self.largest = self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and isinstance(out, torch.Tensor) and out.is_floating_point():
            self.total += out.numel() * out.element_size()
            self.largest = max(self.largest, out.numel() * out.element_size())
            self.ops += 1
        return out


def save_worker(rank, world_size, root):
    """2 ranks: 5 steps, a DCP checkpoint (model + ZeroOptimizer) per layout, 5 more steps.
    Returns the parameters after steps 6 and 10, and what saving allocated."""
    out = {}
    for shard in (False, True):
        net, zero, ddp = _zero_run(shard)
        _train(ddp, zero, rank, range(5), world_size)
        state = {"model": get_model_state_dict(net)}
        with Allocations() as allocated:
            state["optim"] = get_optimizer_state_dict(net, zero)
            dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{root}/{shard}", thread_count=1))
        # exp_avg, exp_avg_sq
        full_state = 2 * sum(p.numel() * p.element_size() for p in net.parameters())
        # the one-file checkpoint: consolidated on rank 0, loaded by plain AdamW, one step on
        zero.consolidate_state_dict(to=0)
        plain = None
        if rank == 0:
            plain = copy.deepcopy(net)
            opt = torch.optim.AdamW(_groups(plain, 0.1), lr=0.01, foreach=False)
            opt.load_state_dict(zero.state_dict())
            opt.zero_grad()
            (sum(_loss(plain, *_batch(r, 5)) for r in range(world_size)) / world_size).backward()
            opt.step()
            plain = [p.detach().clone() for p in plain.parameters()]
        _train(ddp, zero, rank, range(5, 6), world_size)
        after_6 = [p.detach().clone() for p in net.parameters()]
        _train(ddp, zero, rank, range(6, 10), world_size)
        out[shard] = dict(
            after_6=after_6,
            consolidated_then_plain=plain,
            after_10=[p.detach().clone() for p in net.parameters()],
            allocated=(allocated.total, allocated.largest, allocated.ops),
            full_state=full_state,
            own_state=zero.state_bytes(),
        )
    return out


def _load(net, optimizer, path):
    state = {"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, optimizer)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(net, state["model"])
    set_optimizer_state_dict(net, optimizer, state["optim"])


def load_worker(rank, world_size, root, steps):
    """Load each checkpoint into a freshly initialized model and train ``steps`` more: with the
    ZeRO hook at 2 or 4 ranks (the other layout at 4: resharded), with plain AdamW at 1 rank
    (the two saving ranks' batches averaged). Data: the saving ranks' batches, rank % 2."""
    out = {}
    for shard in (False, True):
        net = _net(seed=1 + rank)
        if world_size == 1:
            opt = torch.optim.AdamW(_groups(net, 0.1), lr=0.01, foreach=False)
            _load(net, opt, f"{root}/{shard}")
            for step in steps:
                opt.zero_grad()
                (sum(_loss(net, *_batch(r, step)) for r in range(2)) / 2).backward()
                opt.step()
        else:
            net, zero, ddp = _zero_run(shard if world_size == 2 else not shard, net)
            _load(net, zero, f"{root}/{shard}")
            _train(ddp, zero, rank, steps, 2)
        out[shard] = [p.detach().clone() for p in net.parameters()]
    return out


def test_dcp_checkpoint_resumes_bitwise_and_reshards(tmp_path):
    """Train 5 steps at 2 ranks, save with torch.distributed.checkpoint; loaded at 2 ranks and
    trained 5 more, bitwise the uninterrupted run; loaded at 1 rank into plain AdamW and at 4
    ranks into the other layout, and consolidated on rank 0 into plain AdamW's load_state_dict, one
    step later within 1e-6 of it. Saving allocates no more than
    this rank's own part of the state (no rank gathers the whole of it)."""
    saved = run_ranks(save_worker, 2, str(tmp_path), timeout=300)
    resumed = run_ranks(load_worker, 2, str(tmp_path), range(5, 10), timeout=300)
    single = run_ranks(load_worker, 1, str(tmp_path), range(5, 6), timeout=300)
    wider = run_ranks(load_worker, 4, str(tmp_path), range(5, 6), timeout=300)
    for shard in (False, True):
        for rank in range(2):
            for a, b in zip(resumed[rank][shard], saved[rank][shard]["after_10"]):
                assert torch.equal(a, b), (shard, rank)
        for got in [single[0][shard], saved[0][shard]["consolidated_then_plain"]] + [
            w[shard] for w in wider
        ]:
            for a, b in zip(got, saved[0][shard]["after_6"]):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"shard_buckets={shard}")
        for rank in range(2):
            total, largest, ops = saved[rank][shard]["allocated"]
            own, full = saved[rank][shard]["own_state"], saved[rank][shard]["full_state"]
            assert ops > 0, "the allocation counter saw nothing"
            assert total <= own < full, (shard, rank, total, own, full)
