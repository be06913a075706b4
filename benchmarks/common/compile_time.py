"""What the passes cost inside a compile, counted with what they cause Inductor to do.

After the post-grad passes, Inductor propagates fake tensors again through every node a pass
made or changed (``FakeTensorUpdater.incremental_update``): a rewrite's cost includes that
update, which the pipeline's own timer (``counters["passes"]["pipeline: us"]``) does not see.
"""

from __future__ import annotations

import time

__all__ = ["time_fake_tensor_updates"]


def time_fake_tensor_updates() -> list[float]:
    """From now on, the seconds this process spends in Inductor's post-grad fake-tensor update
    (its outermost calls: it recurses into subgraphs), as ``[total]``. An upper bound of the
    passes' part: the update also covers what Inductor's own post-grad passes changed. Called
    again, it returns the same ``[total]``: the update is timed once however often it is asked."""
    from torch._inductor.fx_utils import FakeTensorUpdater

    update = FakeTensorUpdater.incremental_update
    installed = getattr(update, "seconds", None)
    if installed is not None:
        return installed
    total, depth = [0.0], [0]

    def timed(self: FakeTensorUpdater) -> int:
        depth[0] += 1
        t0 = time.perf_counter()
        try:
            return update(self)
        finally:
            depth[0] -= 1
            if not depth[0]:
                total[0] += time.perf_counter() - t0

    timed.seconds = total  # type: ignore[attr-defined]
    FakeTensorUpdater.incremental_update = timed  # type: ignore[method-assign]
    return total
