"""The compiled step on one device, checked in Inductor's generated code and against eager.

The device is ``COMPILED_HOOKS_TEST_DEVICE`` (default ``cpu``; ``tools/gpu_check.sh`` sets
``cuda`` on a GPU machine, where these tests fail rather than skip without a GPU). On CUDA each
test runs on NCCL at world size 1 and on gloo with 2 ranks sharing the GPU; on CPU on 2 gloo
ranks. The generated code is C++ on CPU and Triton on CUDA; the same checks read both:

- the hooks, compiled whole (``fullgraph=True``), give the eager hooks' values;
- compiled DDP + ``bf16_compress_hook`` + the passes sends the compressed gradients as one
  bucketed all_reduce, and every kernel that writes the bucket casts to bf16 itself (no
  separate cast kernels), with the gradients of eager fp32 DDP within bf16's precision;
- compiled DDP + ``int8_compress_hook`` + the passes sends the quantized gradients as one
  bucketed all-to-all, whose copy-in kernels quantize (on CPU the kernels write each member's
  values and scales' bytes, then ``aten.cat`` copies them: Inductor has no int8 cat kernel
  there), with the gradients of eager fp32 DDP within two int8 roundings;
- ``data_parallel`` + the passes gathers each block with one collective in forward and
  reduces it with one in backward, with the values of the same model run eagerly.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import compiled_hooks as ch
from tests import output_code
from tests.ranks import run_ranks

pytestmark = pytest.mark.slow  # full Inductor compiles on every rank

DEVICE = os.environ.get("COMPILED_HOOKS_TEST_DEVICE", "cpu")
RANKS = (
    [pytest.param("nccl", 1, id="nccl-1"), pytest.param("gloo", 2, id="gloo-2")]
    if DEVICE == "cuda"
    else [pytest.param("gloo", 2, id="gloo-2")]
)
# Values of about unit size, rounded to the wire dtype before and after the sum.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.bfloat16: dict(rtol=1.6e-2, atol=2e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}


@pytest.fixture(autouse=True)
def _device_present():
    if DEVICE not in ("cpu", "cuda"):
        pytest.fail(f"COMPILED_HOOKS_TEST_DEVICE={DEVICE!r}: expected cpu or cuda")
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.fail("COMPILED_HOOKS_TEST_DEVICE=cuda, but torch sees no CUDA device")


def _device() -> torch.device:
    if DEVICE == "cuda":
        torch.cuda.set_device(0)  # gloo's ranks share the one GPU
        return torch.device("cuda", 0)
    return torch.device("cpu")


def _grads(world_size: int, device: torch.device) -> list[torch.Tensor]:
    """Every rank's gradient (the same on every rank: each can compute the exact mean)."""
    return [
        torch.randn(64, 16, generator=torch.Generator().manual_seed(r)).to(device)
        for r in range(world_size)
    ]


def hooks_worker(rank: int, world_size: int) -> dict:
    device = _device()
    group = dist.group.WORLD
    state, lp = ch.DefaultState(group), ch.LowPrecisionState(group)
    grad = _grads(world_size, device)[rank]
    rows = grad.shape[0] // world_size

    def all_hooks(g: torch.Tensor) -> dict:
        out = {}
        for name, hook, st in (
            ("fp32", ch.allreduce_hook, state),
            ("bf16", ch.bf16_compress_hook, lp),
            ("fp16", ch.fp16_compress_hook, lp),
        ):
            full = g.clone()
            hook(st, full)
            shard = g.new_empty(rows, g.shape[1])
            (ch.reduce_scatter_hook if name == "fp32" else hook)(st, g.clone(), shard)
            out[name] = (full, shard)
        return out

    eager = all_hooks(grad)
    compiled = torch.compile(all_hooks, fullgraph=True)(grad)
    return {name: [t.cpu() for t in eager[name] + compiled[name]] for name in eager}


@pytest.mark.parametrize("backend,world_size", RANKS)
def test_hooks_compiled_whole_match_eager(backend, world_size):
    mean = torch.stack(_grads(world_size, torch.device("cpu"))).mean(0)
    for rank, out in enumerate(run_ranks(hooks_worker, world_size, backend=backend, timeout=600)):
        for name, (full, shard, compiled_full, compiled_shard) in out.items():
            tol = TOL[{"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]]
            torch.testing.assert_close(full, mean, **tol, msg=f"{name} all_reduce, rank {rank}")
            torch.testing.assert_close(
                shard,
                mean.chunk(world_size)[rank],
                **tol,
                msg=f"{name} reduce_scatter, rank {rank}",
            )
            torch.testing.assert_close(
                compiled_full, full, **tol, msg=f"{name} compiled all_reduce, rank {rank}"
            )
            torch.testing.assert_close(
                compiled_shard, shard, **tol, msg=f"{name} compiled reduce_scatter, rank {rank}"
            )


LAYERS = 6


def _mlp(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(32, 32) for _ in range(LAYERS)]).to(device)


def _compiled_ddp_step(state, hook, collective: str) -> tuple[str, list, list]:
    """One step of the MLP in compiled DDP with ``hook`` and the passes: the generated code of
    the graph that issues ``collective``, this rank's gradients, and eager fp32 DDP's."""
    from torch._inductor.utils import run_and_get_code

    import passes

    torch._inductor.config.fx_graph_cache = False  # the passes run on every compile
    device = _device()
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(dist.get_rank())).to(device)
    reference = nn.parallel.DistributedDataParallel(_mlp(device))
    reference(x).square().mean().backward()
    net = _mlp(device)
    _, model = ch.compile_ddp(net, state, hook)

    def step() -> None:
        with ch.compiled_autograd():
            model(x).square().mean().backward()

    with passes.install():
        _, codes = run_and_get_code(step)
    code = next(c for c in codes if output_code.collective_calls(c, collective))
    grads = [p.grad.cpu() for p in net.parameters()]
    return code, grads, [p.grad.cpu() for p in reference.parameters()]


def ddp_worker(rank: int, world_size: int) -> dict:
    state = ch.LowPrecisionState(dist.group.WORLD)
    backward, grads, reference = _compiled_ddp_step(state, ch.bf16_compress_hook, "all_reduce")
    buckets = output_code.collective_calls(backward, "all_reduce")
    kernels = output_code.kernels(backward)
    writers = output_code.bucket_writers(backward, buckets[0])
    return {
        "collectives": len(buckets),
        "writers": writers,
        "casting": [w for w in writers if output_code.casts_to(kernels[w], "bfloat16")],
        "grads": grads,
        "reference": reference,
    }


@pytest.mark.parametrize("backend,world_size", RANKS)
def test_compiled_ddp_sends_one_bucket_cast_in_its_copy_in_kernels(backend, world_size):
    for rank, out in enumerate(run_ranks(ddp_worker, world_size, backend=backend, timeout=600)):
        assert out["collectives"] == 1, out  # 2 * LAYERS gradients, one bucket
        assert out["writers"] and out["casting"] == out["writers"], out
        for i, (g, ref) in enumerate(zip(out["grads"], out["reference"])):
            torch.testing.assert_close(
                g, ref, **TOL[torch.bfloat16], msg=f"rank {rank} parameter {i}"
            )


def ddp_int8_worker(rank: int, world_size: int) -> dict:
    state = ch.QuantizedState(dist.group.WORLD)
    backward, grads, reference = _compiled_ddp_step(
        state, ch.int8_compress_hook, "all_to_all_single"
    )
    exchanges = output_code.collective_calls(backward, "all_to_all_single")
    kernels = output_code.kernels(backward)
    writers = {
        w
        for piece in output_code.cat_inputs(backward, exchanges[0])
        for w in output_code.bucket_writers(backward, piece)
    }
    return {
        # gloo sends the all-gather as an all-to-all too
        "collectives": len(exchanges)
        + len(output_code.collective_calls(backward, "all_gather_into_tensor")),
        "writers": sorted(writers),
        # kernels that quantize, or (on CPU, where pack is a cat) that write the scales' bytes
        # from their bits, reading int32 alone
        "computing": sorted(
            w
            for w in writers
            if output_code.quantizes(kernels[w])
            or output_code.input_types(kernels[w]) <= {"int32_t", "i32"}
        ),
        "grads": grads,
        "reference": reference,
    }


@pytest.mark.parametrize("backend,world_size", RANKS)
def test_compiled_ddp_int8_quantizes_in_its_copy_in_kernels(backend, world_size):
    for rank, out in enumerate(
        run_ranks(ddp_int8_worker, world_size, backend=backend, timeout=600)
    ):
        assert out["collectives"] == 2, out  # one exchange and one gather for the bucket
        # no kernel copies values: every kernel that writes the members quantizes, or writes
        # the scales' bytes from their bits, reading no float
        assert out["writers"] and out["computing"] == out["writers"], out
        for i, (g, ref) in enumerate(zip(out["grads"], out["reference"])):
            # two int8 roundings (the exchange, the gather), each within absmax / 254
            atol = 2 * ref.abs().max().item() / 127
            torch.testing.assert_close(g, ref, rtol=0, atol=atol, msg=f"rank {rank} param {i}")


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 48), nn.Linear(48, 16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([_Block() for _ in range(2)])

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return x


BLOCKS = 3  # the root (inp), blocks.0, blocks.1


def data_parallel_worker(rank: int, world_size: int) -> dict:
    from torch._inductor.utils import run_and_get_code
    from torch.distributed.device_mesh import init_device_mesh

    import passes
    from compiled_hooks.fsdp import data_parallel

    torch._inductor.config.fx_graph_cache = False
    device = _device()
    mesh = init_device_mesh(device.type, (world_size,))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)).to(device)
    eager = data_parallel(_Net().to(device), mesh, reshard_after_forward=False)
    eager(x).square().mean().backward()
    model = data_parallel(_Net().to(device), mesh, reshard_after_forward=False)
    with passes.install():
        _, codes = run_and_get_code(
            lambda: torch.compile(model, fullgraph=True)(x).square().mean().backward()
        )
    forward, backward = codes
    # gloo: all-gathers and reduce-scatters go out as all_to_alls (all_gather_as_all_to_all,
    # reduce_scatter_as_all_to_all); NCCL keeps its own collectives.
    gather, reduce = (
        ("all_to_all_single",) * 2
        if backend_of(mesh) == "gloo"
        else ("all_gather_into_tensor", "reduce_scatter_tensor")
    )
    return {
        "gathers": len(output_code.collective_calls(forward, gather)),
        "reductions": len(output_code.collective_calls(backward, reduce)),
        # each rank's shards: full_tensor() gathers through the functional all-gather, which
        # faults on gloo with a CUDA tensor (gloo's allgather_coalesced has no device form)
        "grads": [p.grad.to_local().cpu() for p in model.parameters()],
        "reference": [p.grad.to_local().cpu() for p in eager.parameters()],
    }


def backend_of(mesh) -> str:
    return str(dist.get_backend(mesh.get_group(0))).lower()


@pytest.mark.parametrize("backend,world_size", RANKS)
def test_data_parallel_one_collective_per_block(backend, world_size):
    for rank, out in enumerate(
        run_ranks(data_parallel_worker, world_size, backend=backend, timeout=600)
    ):
        assert (out["gathers"], out["reductions"]) == (BLOCKS, BLOCKS), out
        for i, (g, ref) in enumerate(zip(out["grads"], out["reference"])):
            torch.testing.assert_close(
                g, ref, **TOL[torch.float32], msg=f"rank {rank} parameter {i}"
            )
