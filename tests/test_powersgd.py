"""compiled_hooks.powersgd: PowerSGD against a plain single-process reference, eager and compiled."""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import compiled_hooks as ch
from compiled_hooks.powersgd import PowerSGDState, powerSGD_hook, random_q
from tests.ranks import run_ranks

START, STEPS, RANK = 2, 6, 2


def _net():
    torch.manual_seed(0)
    # 32x16 and 32x32 compress at rank 2; the 4x32 head and every bias do not.
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4))


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _local_grads(net, rank, step):
    net.zero_grad()
    x, y = _batch(rank, step)
    torch.nn.functional.mse_loss(net(x), y).backward()
    return [p.grad.clone() for p in net.parameters()]


class Reference:
    """PowerSGD for ``world_size`` simulated ranks in one process, written from the paper's
    algorithm: QR for the orthogonalization (the hook uses Gram-Schmidt; the approximation
    P Q^T does not depend on the columns' signs)."""

    def __init__(self, shapes, slots, world_size, rank, ef=True, warm=True, seed=0, min_rate=2):
        self.world_size, self.rank, self.ef, self.warm, self.seed = world_size, rank, ef, warm, seed
        self.slots, self.step = slots, 0
        self.compress = [len(s) > 1 and (s[0] + s.numel() // s[0]) * min(rank, s[0], s.numel() // s[0]) * min_rate
                         < s.numel() for s in shapes]
        self.q = {}
        self.err = {}

    def _q(self, i, shape):
        if not self.warm or i not in self.q:
            n, m = shape[0], shape.numel() // shape[0]
            self.q[i] = random_q(self.seed, self.slots[i], self.step, (m, min(n, m, self.rank)), torch.float32)
        return torch.linalg.qr(self.q[i]).Q

    def average(self, grads_per_rank):
        out = []
        for i, gs in enumerate(zip(*grads_per_rank)):
            if self.step < START:
                out.append(sum(g / self.world_size for g in gs))
            elif not self.compress[i]:
                out.append(sum(gs) / self.world_size)
            else:
                ms = [g.reshape(g.shape[0], -1) + self.err.get((i, r), 0) for r, g in enumerate(gs)]
                q = self._q(i, gs[0].shape)
                p = torch.linalg.qr(sum(m @ q for m in ms)).Q
                q = sum(m.t() @ p for m in ms) / self.world_size
                approx = p @ q.t()
                if self.ef:
                    for r, m in enumerate(ms):
                        self.err[(i, r)] = m - approx
                self.q[i] = q
                out.append(approx.view_as(gs[0]))
        self.step += 1
        return out


def _train(rank, world_size, mode, ef=True, warm=True):
    """STEPS SGD steps of DDP + powerSGD_hook; per step the averaged gradients, and every
    rank's local gradients (for the reference), and the slot of every parameter."""
    if mode != "cpp_reducer":
        torch._dynamo.config.optimize_ddp = "python_reducer"
    net = _net()
    state = PowerSGDState(dist.group.WORLD, matrix_approximation_rank=RANK, start_powerSGD_iter=START,
                          use_error_feedback=ef, warm_start=warm)
    if mode == "compiled":
        _, model = ch.compile_ddp(net, state, powerSGD_hook)
    else:
        model = DDP(net, bucket_cap_mb=0.001)
        model.register_comm_hook(state, ch.ddp_comm_hook(powerSGD_hook))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    history = []
    for step in range(STEPS):
        local = [None] * world_size
        for r in range(world_size):  # every rank's local gradients, computed here for the reference
            ref_net = _net()
            ref_net.load_state_dict(net.state_dict())
            local[r] = _local_grads(ref_net, r, step)
        opt.zero_grad(set_to_none=False)
        x, y = _batch(rank, step)
        if mode == "compiled":
            with ch.compiled_autograd():
                torch.nn.functional.mse_loss(model(x), y).backward()
        else:
            torch.nn.functional.mse_loss(model(x), y).backward()
        history.append(([p.grad.clone() for p in net.parameters()], local))
        opt.step()
    slots = [state._slot_of[p] for p in net.parameters()]
    frames = dict(torch._dynamo.utils.counters["stats"])
    return history, [p.detach().clone() for p in net.parameters()], slots, state.iter, frames


def _check(ranks, world_size, ef=True, warm=True):
    history0, params0, slots, iters, _ = ranks[0]
    assert iters == STEPS
    shapes = [p.shape for p in params0]
    ref = Reference(shapes, slots, world_size, RANK, ef=ef, warm=warm)
    for step, (grads, local) in enumerate(history0):
        expected = ref.average(local)
        for i, (g, e) in enumerate(zip(grads, expected)):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6, msg=lambda m: f"step {step} param {i}: {m}")
    for rank, (history, params, _, _, _) in enumerate(ranks):
        for a, b in zip(params, params0):
            assert torch.equal(a, b), f"rank {rank} parameters differ from rank 0's"


@pytest.mark.parametrize("world_size,mode", [(2, "cpp_reducer"), (2, "python_reducer"), (4, "python_reducer")])
def test_eager_matches_reference(world_size, mode):
    _check(run_ranks(_train, world_size, mode), world_size)


def test_compiled_matches_reference():
    _check(run_ranks(_train, 2, "compiled", timeout=400), 2)
