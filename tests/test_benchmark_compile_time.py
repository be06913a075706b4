"""``benchmarks.common.compile_time``: the time of Inductor's fake-tensor update is each
outermost call's, and its passes' part is the propagation of what a pipeline made or changed
and of what that changed downstream, not of what another pass changed."""

import inspect
import time

import pytest
import torch
from torch._inductor.fx_utils import FakeTensorUpdater
from torch._inductor.virtualized import V
from torch.fx.experimental.proxy_tensor import make_fx

from benchmarks.common import compile_time
from passes.pipeline import Pipeline

PAUSE = 0.05  # what each propagation of the slow op below takes


@torch.library.custom_op("compile_time_test::slow", mutates_args=())
def slow(x: torch.Tensor, k: float) -> torch.Tensor:
    return x * k


@slow.register_fake
def _(x, k):
    time.sleep(PAUSE)
    return torch.empty_like(x)


@pytest.fixture
def restored(monkeypatch):
    """No timer installed yet, and what a timer wraps undone afterwards."""
    import torch._inductor.fx_utils as fx_utils

    monkeypatch.setattr(compile_time, "_installed", [])
    update = FakeTensorUpdater.incremental_update
    monkeypatch.setattr(FakeTensorUpdater, "incremental_update", update)
    monkeypatch.setattr(Pipeline, "run", Pipeline.run)
    monkeypatch.setattr(fx_utils, "enable_python_dispatcher", fx_utils.enable_python_dispatcher)
    return monkeypatch


@pytest.fixture
def times(restored):
    """A fresh timer around torch's own update."""
    return compile_time.time_fake_tensor_updates()


def test_the_fake_tensor_update_is_timed_once_through_its_recursion(restored):
    """Inductor's fake-tensor update recurses into each subgraph's updater: the time counts its
    outermost calls only, and every one of them."""

    class Updater:  # an updater, with its subgraph's updater inside
        def __init__(self, inner=None):
            self.inner = inner

    def fake_update(self):
        time.sleep(0.1)
        if self.inner is not None:
            FakeTensorUpdater.incremental_update(self.inner)
        return 0

    restored.setattr(FakeTensorUpdater, "incremental_update", fake_update)
    total = compile_time.time_fake_tensor_updates()
    assert compile_time.time_fake_tensor_updates() is total  # asked again: one timer
    for _ in range(2):
        FakeTensorUpdater.incremental_update(Updater(Updater(Updater())))
    assert 0.6 <= total.total < 1.0  # two updates of 3 x 0.1 s each; counted per call, 1.2 s


def test_the_passes_part_is_what_the_pipeline_changed_and_its_users(times):
    """Three chains of two slow ops. Another pass (Inductor's own) changes the first chain's
    head, the pipeline the second's; the third stays. Whatever the update propagates of one
    changed chain (each torch release differs), it propagates of the other: the passes' part is
    half the update, one head at least."""
    op = torch.ops.compile_time_test.slow.default

    def f(x):
        return op(op(x, 1.0), 2.0), op(op(x, 3.0), 4.0), op(op(x, 5.0), 6.0)

    gm = make_fx(f, tracing_mode="fake")(torch.ones(8))
    fake_mode = next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"].fake_mode
    # torch 2.11's updater takes the graph, later ones the graph module
    takes_graph = "graph" in inspect.signature(FakeTensorUpdater.__init__).parameters
    updater = FakeTensorUpdater(gm.graph if takes_graph else gm)
    # torch 2.11's updater tells arguments apart by their id: keep the old ones from reuse
    kept = [n.args for n in gm.graph.nodes]
    heads = [n for n in gm.graph.nodes if n.target is op and n.args[1] in (1.0, 3.0)]
    heads[0].args = (heads[0].args[0], 1.5)  # Inductor's own change, before the pipeline

    def rewrite(graph):
        head = next(n for n in graph.nodes if n.target is op and n.args[1] == 3.0)
        head.args = (head.args[0], 3.5)
        return True

    Pipeline([rewrite], verify=False, check_ranks=False).run(gm.graph)
    with V.set_fake_mode(fake_mode):
        updater.incremental_update()
    assert kept
    assert times.passes >= PAUSE
    assert abs(times.total - 2 * times.passes) < PAUSE / 2
    assert times.total < 5 * PAUSE  # the third chain is not propagated
    assert times.bookkeeping < PAUSE
