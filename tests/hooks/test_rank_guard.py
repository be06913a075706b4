"""The rank-divergence guard (``passes.install(check_ranks=True)``) on real gloo ranks.

Three ways ranks end up compiling different collectives: (a) the order of two all_reduces
depends on the rank, (b) one rank's all_reduce is bigger, (c) one rank recompiles (a new input
shape) while the others run the graph all of them checked before. With the guard, every rank
raises ``RankDivergenceError`` naming the first differing collective on each side, within 60 s,
and every process exits with code 0. Without it, the same programs abort inside gloo or time out
(a group timeout of 10 s keeps that short), which is what proves the guard is what helps.
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch._dynamo.utils import counters

import passes
from tests.ranks import rank_outcomes, run_ranks

pytestmark = pytest.mark.slow  # every test compiles on several ranks

# Without the guard, a short group timeout ends the ranks that wait in a collective that never
# comes. With it, the group's timeout is also how long a rank checking a new graph waits for the
# others to reach it (compiling, on a loaded machine, may take longer than 10 s), so the guarded
# runs get a long one; the test bounds their time by itself.
GROUP_TIMEOUT = {False: datetime.timedelta(seconds=10), True: datetime.timedelta(seconds=120)}


CASES = ("order", "size", "recompile")  # (c) last: it leaves its group blocked until a rank exits


def _diverge(rank: int, world_size: int, case: str, guard: bool):
    """Run ``case`` on a group of its own; (name of what was raised, message, seconds)."""
    group = dist.new_group(list(range(world_size)), timeout=GROUP_TIMEOUT[guard])

    @torch.compile(dynamic=False)
    def step(a, b):
        if case == "order" and rank % 2:
            b = fc.all_reduce(b, "sum", group)
            a = fc.all_reduce(a, "sum", group)
        else:
            a = fc.all_reduce(a, "sum", group)
            b = fc.all_reduce(b, "sum", group)
        return a + 1, b * 2

    a, b = torch.ones(8), torch.ones(4)
    if case == "size" and rank == 1:
        a = torch.ones(9)
    start = time.monotonic()
    try:
        with passes.install(check_ranks=guard):
            for i in range(4):
                if case == "recompile" and rank == 1 and i == 3:
                    a = torch.ones(16)  # a new shape on one rank only: a recompile there
                out = step(a, b)
    except Exception as e:  # noqa: BLE001 - the test looks at what each rank raised
        return type(e).__name__, str(e), time.monotonic() - start
    return "no error", out[0].tolist(), time.monotonic() - start


def _diverge_all(rank: int, world_size: int):
    return {case: _diverge(rank, world_size, case, True) for case in CASES}


@pytest.mark.parametrize("world_size", [2, 4])
def test_guard_raises_on_every_rank(world_size):
    outcomes = rank_outcomes(_diverge_all, world_size, timeout=240, teardown=False)
    for rank, o in enumerate(outcomes):
        assert o.status == "ok" and o.exitcode == 0, (rank, o)
    for case, expected in [
        ("order", "all_reduce(sum) float32[4]"),
        ("size", "all_reduce(sum) float32[9]"),
        ("recompile", "all_reduce(sum) float32[16]"),
    ]:
        messages = set()
        for rank, o in enumerate(outcomes):
            name, message, seconds = o.result[case]
            assert name == "RankDivergenceError", (case, rank, name, message)
            assert seconds < 60, (case, rank, seconds)
            messages.add(message)
        (message,) = messages  # every rank names the same difference
        assert (
            "rank 1: " + expected in message and "rank 0: all_reduce(sum) float32[8]" in message
        ), message
        assert "test_rank_guard.py" in message, message  # the user's source line


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_without_the_guard_gloo_aborts_or_times_out(case, world_size):
    outcomes = rank_outcomes(_diverge, world_size, case, False, timeout=90, teardown=False)
    # measured on torch 2.13: a rank aborts inside gloo ("collective mismatch", SIGABRT) and the
    # others read "Connection reset by peer", or (order, 4 ranks) every rank waits until the
    # group's timeout (10 s here, 30 min by default); no rank can tell which collective differed
    stuck = [o for o in outcomes if o.status in ("died", "hung") or "Timed out" in str(o.result[1])]
    assert stuck, outcomes
    assert not any(o.status == "ok" and o.result[0] == "RankDivergenceError" for o in outcomes), (
        outcomes
    )


def _agree(rank: int, world_size: int, cache_dirs: list):
    """Two all_reduces for 4 steps under the guard, each rank with its own Inductor cache dir;
    (the outputs, FX graph cache hits, misses, seconds spent in the first call)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dirs[rank]
    counters.clear()

    @torch.compile(dynamic=False)
    def step(a, b):
        return fc.all_reduce(a, "sum", dist.group.WORLD) + 1, fc.all_reduce(
            b * rank, "sum", dist.group.WORLD
        )

    with passes.install(check_ranks=True):
        outs = [step(torch.ones(8), torch.ones(4)) for _ in range(4)]
    inductor = counters["inductor"]
    return (
        [o.tolist() for o in outs[-1]],
        inductor["fxgraph_cache_hit"],
        inductor["fxgraph_cache_miss"],
        counters["rank_guard"]["graphs checked"],
    )


def test_no_false_positive_when_one_rank_hits_the_fx_graph_cache(tmp_path):
    warm, cold = str(tmp_path / "warm"), str(tmp_path / "cold")
    run_ranks(_agree, 2, [warm, warm])  # fills the cache rank 0 uses next
    (out0, hits0, misses0, checked0), (out1, hits1, misses1, checked1) = run_ranks(
        _agree, 2, [warm, cold]
    )
    assert (hits0, misses0) == (1, 0) and (hits1, misses1) == (0, 1), (
        hits0,
        misses0,
        hits1,
        misses1,
    )
    assert checked0 == checked1 == 1  # the cached graph carries its check, and it passed
    assert out0 == out1 == [[3.0] * 8, [1.0] * 4]
