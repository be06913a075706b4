"""A compiled ``data_parallel`` step restarts from Inductor's caches: a second job on the same
cache dir, or a fresh job that loads ``torch.compiler.save_cache_artifacts()``, compiles no
graph again (AOTAutograd's and the FX graph cache's counters), ranks sharing one cache dir each
load their own graphs, and the rank guard passes when ranks start from different cache
states."""

import os

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh

import passes
from compiled_hooks.fsdp import data_parallel
from tests.fsdp.test_data_parallel import Net
from tests.ranks import run_ranks

pytestmark = pytest.mark.slow  # every job compiles or loads a whole model's step
TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


def step_job(rank, world_size, cache_dirs, loads, save):
    """One compiled step of ``Net`` under ``data_parallel`` and the passes (the rank guard on),
    on this rank's cache dir, after loading the artifacts file ``loads[rank]`` (None: nothing);
    each rank saves the artifacts of its compile to ``save`` + its rank (None: none). What the
    caches and the guard counted, and the loss."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dirs[rank]
    counters.clear()
    if loads[rank] is not None:
        with open(loads[rank], "rb") as f:
            assert torch.compiler.load_cache_artifacts(f.read()) is not None
    model = data_parallel(Net(), init_device_mesh("cpu", (world_size,)))
    tokens = torch.randint(0, 10, (4, 6), generator=torch.Generator().manual_seed(rank))
    with passes.install(check_ranks=True):
        loss = torch.compile(model, fullgraph=True)(tokens).square().mean()
        loss.backward()
    if save is not None:
        artifacts = torch.compiler.save_cache_artifacts()
        assert artifacts is not None
        with open(f"{save}{rank}", "wb") as f:
            f.write(artifacts[0])
    dist.barrier()
    return {
        "aot": dict(counters["aot_autograd"]),
        "fx": dict(counters["inductor"]),
        "checked": counters["rank_guard"]["graphs checked"],
        "loss": loss.item(),
    }


def compiled_nothing(out):
    """Every graph came from the caches: AOTAutograd hit, and its forward and backward were
    the FX graph cache's."""
    aot, fx = out["aot"], out["fx"]
    return (
        aot.get("autograd_cache_hit", 0) >= 1
        and not any(aot.get(k) for k in ("autograd_cache_miss", "autograd_cache_bypass"))
        and fx.get("fxgraph_cache_hit", 0) >= 2
        and not any(fx.get(k) for k in ("fxgraph_cache_miss", "fxgraph_cache_bypass"))
    )


def test_restarts_and_shipped_artifacts_compile_nothing(tmp_path):
    """A cold job (both ranks on one cache dir) saves its artifacts. Then, in one job: rank 0
    restarts on that dir, which serves every graph; rank 1 loads its shipped artifacts into an
    empty dir, which serves every graph too. And where ranks start from different cache states
    (rank 0 on a restarted dir, rank 1 on an empty one), the rank guard checks and passes."""
    first, fresh, cold = (str(tmp_path / d) for d in ("first", "fresh", "cold"))
    shipped = str(tmp_path / "artifacts.bin.")  # rank r's file: this and r
    cold_job = run_ranks(step_job, 2, [first, first], [None, None], shipped, timeout=400)
    for out in cold_job:
        assert out["aot"].get("autograd_cache_miss", 0) >= 1, out  # it compiled
        assert not out["aot"].get("autograd_cache_bypass"), out  # and could be cached
    restarted, shipped_to = run_ranks(
        step_job, 2, [first, fresh], [None, f"{shipped}1"], None, timeout=400
    )
    for before, after in zip(cold_job, (restarted, shipped_to)):
        assert compiled_nothing(after), after
        assert after["loss"] == before["loss"], (before, after)
    warm0, cold1 = run_ranks(step_job, 2, [first, cold], [None, None], None, timeout=400)
    assert compiled_nothing(warm0) and not compiled_nothing(cold1), (warm0, cold1)
    assert warm0["checked"] == cold1["checked"] >= 1, (warm0, cold1)  # checked, and it passed


def uneven_job(rank, world_size, cache_dir):
    """One compiled step of ``Net`` (shards of 7 and 6 rows) on ``cache_dir``, shared by the
    ranks: what AOTAutograd's cache counted, and the loss."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    counters.clear()
    model = data_parallel(Net(), init_device_mesh("cpu", (world_size,)))
    tokens = torch.randint(0, 10, (4, 6), generator=torch.Generator().manual_seed(rank))
    loss = torch.compile(model, fullgraph=True)(tokens).square().mean()
    loss.backward()
    return {"aot": dict(counters["aot_autograd"]), "loss": loss.item()}


def test_ranks_sharing_a_cache_dir_load_their_own_graphs(tmp_path):
    """Each rank's graph holds its own shard shape (7 rows on rank 0, 6 on rank 1), which its
    graph's plain shard inputs key (torch 2.13 to 2.15 key a DTensor input by its global spec
    alone, the same on both ranks: see ``compat.key_dtensors_by_rank``)."""
    shared = str(tmp_path / "shared")
    cold = run_ranks(uneven_job, 2, shared, timeout=400)
    warm = run_ranks(uneven_job, 2, shared, timeout=400)
    for before, after in zip(cold, warm):
        assert after["aot"].get("autograd_cache_hit", 0) >= 1, after
        assert not after["aot"].get("autograd_cache_miss"), after
        assert after["loss"] == before["loss"], (before, after)
    assert cold[0]["loss"] != cold[1]["loss"]  # the ranks' steps differ: each ran its own
