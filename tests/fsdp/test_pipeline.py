"""data_parallel stages under torch's pipeline parallelism, unchanged (``PipelineStage`` and the
schedules): 4 ranks, pp 2 x dp 2, an MLP of 4 blocks per pipeline (8 for the interleaved
schedule, two stages per rank), 4 micro-batches, fp32 SGD, 3 steps, against FSDP2 stages doing
the same; DCP checkpoints of the stages both ways."""

import functools
import os
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from compiled_hooks.fsdp import data_parallel, data_parallel_state
from tests.fsdp.test_data_parallel import rel
from tests.ranks import run_ranks

WIDTH, BLOCKS_PER_STAGE, MICRO_BATCHES = 16, 2, 4
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


def pp_dp_mesh(tp=False):
    if tp:
        return init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))


def stages(library, mesh, schedule, compiled=None):
    """This rank's stage modules (torchtitan's order: split, then TP where ``mesh`` has a
    ``"tp"`` dimension, then shard each stage, then compile), their ``PipelineStage``s and the
    schedule. ``library``: ``"fsdp2"`` or ``"data_parallel"``; ``compiled``: None, ``"whole"``
    (each stage) or ``"block"``."""
    per_rank = 2 if schedule == "interleaved" else 1
    count = 2 * per_rank
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(count * BLOCKS_PER_STAGE)
    ]
    pp_rank = mesh["pp"].get_local_rank()
    indices = [pp_rank + k * 2 for k in range(per_rank)]
    modules = []
    for i in indices:
        module = nn.Sequential(*blocks[i * BLOCKS_PER_STAGE : (i + 1) * BLOCKS_PER_STAGE])
        if "tp" in mesh.mesh_dim_names:
            plan = {"0.0": ColwiseParallel(), "1.0": RowwiseParallel()}
            parallelize_module(module, mesh["tp"], plan)
        if library == "fsdp2":
            for block in module:
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(module, mesh=mesh["dp"])
        else:
            data_parallel(module, mesh["dp"], blocks=list(module))
        if compiled == "whole":
            module.compile(fullgraph=True)
        elif compiled == "block":
            for block in module:
                block.compile(fullgraph=True)
        modules.append(module)
    group = mesh["pp"].get_group()
    pipeline = [
        PipelineStage(m, i, count, torch.device("cpu"), group=group)
        for m, i in zip(modules, indices)
    ]

    def loss_fn(out, target):
        return (out - target).square().mean()

    run = SCHEDULES[schedule](
        pipeline if per_rank > 1 else pipeline[0], n_microbatches=MICRO_BATCHES, loss_fn=loss_fn
    )
    return modules, run


def pipeline_step(run, mesh, x, y):
    """One step of the schedule ``run``: the first stage takes the input, the last the target."""
    if mesh["pp"].get_local_rank() == 0:
        run.step(x)
    else:
        run.step(target=y)


def reduce_scatters(step):
    """The reduce-scatters one ``step()`` issues (a functional collective counted once, not
    again as the c10d op it dispatches to)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    return sum(
        1
        for e in prof.events()
        if "reduce_scatter" in e.name
        and (e.cpu_parent is None or "reduce_scatter" not in e.cpu_parent.name)
    )


def train_worker(rank, world_size, schedule, compiled, tp=False):
    import passes

    mesh = pp_dp_mesh(tp)
    params, counts = {}, {}
    # reduce-scatters left as such in compiled graphs (not gloo's all-to-alls), to count them
    with passes.install(options={"reduce_scatter_backends": ()}):
        for library in ("fsdp2", "data_parallel"):
            modules, run = stages(library, mesh, schedule, compiled if library != "fsdp2" else None)
            opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.5)
            g = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
            for step in range(3):
                x, y = torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)
                one_step = functools.partial(pipeline_step, run, mesh, x, y)
                if step == 2:
                    counts[library] = reduce_scatters(one_step)
                else:
                    one_step()
                opt.step()
                opt.zero_grad()
            params[library] = [p.full_tensor() for m in modules for p in m.parameters()]
            blocks = sum(len(m) for m in modules)
    diff = max(rel(b, a) for a, b in zip(params["fsdp2"], params["data_parallel"]))
    return diff, counts, blocks


def check(results):
    for diff, counts, blocks in results:
        assert diff <= 1e-4, diff
        assert counts == {"fsdp2": blocks, "data_parallel": blocks}, counts


def test_gpipe_eager_matches_fsdp2_one_reduce_scatter_per_block():
    """GPipe, eager stages: within 1e-4 of FSDP2's stages, and each rank's step sends one
    reduce-scatter per block it holds, as FSDP2's does (4 micro-batches)."""
    check(run_ranks(train_worker, 4, "gpipe", None, timeout=300))


# every schedule eager and compiled, but the fast tier's GPipe eager
SLOW_RUNS = [
    (schedule, compiled)
    for schedule in sorted(SCHEDULES)
    for compiled in (None, "whole", "block")
    if (schedule, compiled) != ("gpipe", None)
]


@pytest.mark.slow
@pytest.mark.parametrize("schedule, compiled", SLOW_RUNS)
def test_schedules_match_fsdp2_one_reduce_scatter_per_block(schedule, compiled):
    check(run_ranks(train_worker, 4, schedule, compiled, timeout=900))


@pytest.mark.slow
def test_gpipe_with_tensor_parallelism_matches_fsdp2_on_8_ranks():
    """pp 2 x dp 2 x tp 2, each stage's two blocks column- then row-parallel over ``tp``,
    eager: within 1e-4 of FSDP2 + TP stages, one reduce-scatter per block per step."""
    check(run_ranks(train_worker, 8, "gpipe", None, True, timeout=900))


def test_a_stage_is_an_fsdp_module_that_keeps_its_gathered_parameters():
    """On a mesh sibling of ``"pp"``, the root is an ``FSDPModule`` (what the schedules look
    for), keeps its gathered parameters by default (torchtitan's default under PP), and every
    backward accumulates; elsewhere neither."""
    from passes.testing import fake_process_group

    fake_process_group(4)
    stage = data_parallel(nn.Sequential(nn.Linear(4, 4)), pp_dp_mesh()["dp"])
    plain = data_parallel(nn.Sequential(nn.Linear(4, 4)), init_device_mesh("cpu", (4,)))
    assert isinstance(stage, FSDPModule) and not isinstance(plain, FSDPModule)
    assert (data_parallel_state(stage).reshard, data_parallel_state(plain).reshard) == (False, True)
    reduces = [data_parallel_state(m).reduction.accumulation.reduces for m in (stage, plain)]
    assert reduces == [False, True]
    assert type(stage[0:1]) is nn.Sequential  # FSDPModule.__new__ finds the module's class
    with pytest.raises(NotImplementedError, match="has no FSDP2 state"):
        stage.set_modules_to_forward_prefetch([])


def checkpoint_worker(rank, world_size, saver, loader, path):
    """``saver``'s stages train a step and save with DCP; ``loader``'s load: the model state,
    as full tensors, of both."""
    mesh = pp_dp_mesh()
    # a checkpoint per stage, saved by the stage's data-parallel ranks
    stage_path, dp = f"{path}/{mesh['pp'].get_local_rank()}", mesh["dp"].get_group()
    states = []
    for library in (saver, loader):
        modules, run = stages(library, mesh, "gpipe")
        module = modules[0]
        if library == saver:
            pipeline_step(run, mesh, torch.randn(8, WIDTH), torch.randn(8, WIDTH))
            torch.optim.SGD(module.parameters(), lr=0.5).step()
            dcp.save(get_model_state_dict(module), checkpoint_id=stage_path, process_group=dp)
        else:
            state = get_model_state_dict(module)
            dcp.load(state, checkpoint_id=stage_path, process_group=dp)
            set_model_state_dict(module, state)
        states.append({k: v.full_tensor() for k, v in get_model_state_dict(module).items()})
    return all(torch.equal(states[0][k], states[1][k]) for k in states[0]), sorted(states[0])


@pytest.mark.slow
@pytest.mark.parametrize("saver, loader", [("fsdp2", "data_parallel"), ("data_parallel", "fsdp2")])
def test_dcp_checkpoints_of_stages_load_both_ways_bitwise(saver, loader):
    with tempfile.TemporaryDirectory() as path:
        for same, keys in run_ranks(checkpoint_worker, 4, saver, loader, os.path.join(path, "c")):
            assert same and keys == ["0.0.bias", "0.0.weight", "1.0.bias", "1.0.weight"], keys


def test_a_stage_moved_remakes_its_accumulators_like_its_parameters():
    """A stage makes its accumulators when it is built; ``.to()`` makes them again like the
    parameters (here in float64), and refuses while a sum is held."""
    from passes.testing import fake_process_group

    fake_process_group(4)
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    stage = data_parallel(module, pp_dp_mesh()["dp"], blocks=list(module))
    leaves = data_parallel_state(stage).reduction.accumulation.leaves
    assert {acc.dtype for acc, _ in leaves.values()} == {torch.float32}
    stage.to(torch.float64)
    assert {acc.dtype for acc, _ in leaves.values()} == {torch.float64}
    read = stage[0]._data_parallel_accumulators  # what a traced forward reads: the new ones
    assert all(read[n][0] is leaves[f"0.{n}"][0] for n in ("weight", "bias"))
    leaves["0.weight"][0].grad = torch.zeros(4, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="holds accumulated gradients"):
        stage.to(torch.float32)
