"""``benchmarks.common.compile_time``: the time of Inductor's fake-tensor update, which the
passes' share counts, is each outermost call's."""

import time

from benchmarks.common.compile_time import time_fake_tensor_updates


def test_the_fake_tensor_update_is_timed_once_through_its_recursion(monkeypatch):
    """Inductor's fake-tensor update recurses into each subgraph's updater: the time counts its
    outermost calls only, and every one of them."""
    from torch._inductor.fx_utils import FakeTensorUpdater

    class Updater:  # an updater, with its subgraph's updater inside
        def __init__(self, inner=None):
            self.inner = inner

    def update(self):
        time.sleep(0.1)
        if self.inner is not None:
            FakeTensorUpdater.incremental_update(self.inner)
        return 0

    monkeypatch.setattr(FakeTensorUpdater, "incremental_update", update)
    total = time_fake_tensor_updates()
    assert time_fake_tensor_updates() is total  # asked again (ddp_sync, per model): one timer
    for _ in range(2):
        FakeTensorUpdater.incremental_update(Updater(Updater(Updater())))
    assert 0.6 <= total[0] < 1.0  # two updates of 3 x 0.1 s each; counted per call, 1.2 s
