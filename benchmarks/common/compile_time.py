"""What the passes cost inside a compile, counted with what they cause Inductor to do.

After the post-grad passes, Inductor propagates fake tensors again
(``FakeTensorUpdater.incremental_update``): through every node whose target or arguments
changed since the post-grad passes began, and on through its users while their values change.
A rewrite's cost includes that update, which the pipeline's own timer
(``counters["passes"]["pipeline: us"]``) does not see; but the update also covers what
Inductor's own post-grad passes changed, and every region call (``invoke_subgraph``), which it
always visits. :func:`time_fake_tensor_updates` times the whole update and, within it, the
passes' part: each node it propagates again that a :class:`passes.Pipeline` made or changed,
or that reads one it propagated again for that reason::

    graph before the pipeline:  a = f(x); b = g(a); c = h(y)
    the pipeline rewrites a:     a' = f2(x); b = g(a'); c = h(y)   (Inductor's own pass: c)
    the update propagates:       a' (the passes'), b (the passes': it reads a'), c (Inductor's)

The update's walk over the graph (hashing each node, gathering its inputs' values) is counted
in the total only: any graph pays it, with or without the passes.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

__all__ = ["UpdateTimes", "time_fake_tensor_updates"]


@dataclasses.dataclass
class UpdateTimes:
    """Seconds of Inductor's post-grad fake-tensor updates in this process."""

    total: float = 0.0  # the update's outermost calls (it recurses into subgraphs)
    passes: float = 0.0  # within them, propagating what the passes made, changed or caused
    bookkeeping: float = 0.0  # telling those apart (inside the compile, in neither of the above)
    # nodes whose propagation is the passes', by id (the node kept, so that no id is reused)
    ours: dict[int, Any] = dataclasses.field(default_factory=dict, repr=False)


_installed: list[UpdateTimes] = []


def time_fake_tensor_updates() -> UpdateTimes:
    """From now on, the time this process spends in Inductor's post-grad fake-tensor update, and
    the passes' part of it (see the module docstring). Called again, it returns the same
    :class:`UpdateTimes`: the update is timed once however often it is asked."""
    if _installed:
        return _installed[0]
    import torch._inductor.fx_utils as fx_utils
    from torch._inductor.fx_utils import FakeTensorUpdater

    from passes.pipeline import Pipeline

    times = UpdateTimes()
    update, run, dispatcher = (
        FakeTensorUpdater.incremental_update,
        Pipeline.run,
        fx_utils.enable_python_dispatcher,
    )
    depth = [0]

    def timed_update(self: Any) -> int:
        depth[0] += 1
        t0 = time.perf_counter()
        try:
            return update(self)
        finally:
            depth[0] -= 1
            if not depth[0]:
                times.total += time.perf_counter() - t0

    def watched_run(self: Any, graph: Any) -> bool:
        t0 = time.perf_counter()
        before = {id(n): (n.target, n.args, n.kwargs) for n in graph.nodes}
        times.bookkeeping += time.perf_counter() - t0
        changed = run(self, graph)
        t0 = time.perf_counter()
        for n in graph.nodes:
            was = before.get(id(n))
            if was is None or any(a is not b for a, b in zip(was, (n.target, n.args, n.kwargs))):
                times.ours[id(n)] = n
        times.bookkeeping += time.perf_counter() - t0
        return changed

    class Propagation:
        """One node's propagation inside the update (Inductor runs each under the Python
        dispatcher): timed for the passes where the node is theirs or reads one of theirs."""

        def __init__(self, node: Any) -> None:
            self.node = node

        def __enter__(self) -> Any:
            t0 = time.perf_counter()
            node = self.node
            self.ours = (
                depth[0] > 0
                and hasattr(node, "all_input_nodes")
                and (
                    id(node) in times.ours or any(id(a) in times.ours for a in node.all_input_nodes)
                )
            )
            if self.ours:
                times.ours[id(node)] = node
            self.inner = dispatcher()
            self.inner.__enter__()
            self.t0 = time.perf_counter()
            times.bookkeeping += self.t0 - t0
            return self

        def __exit__(self, *exc: Any) -> Any:
            if self.ours:
                times.passes += time.perf_counter() - self.t0
            return self.inner.__exit__(*exc)

    def propagation() -> Propagation:
        # the caller is the update (its loop's node) or its alias check (the node it checks)
        return Propagation(sys._getframe(1).f_locals.get("node"))

    FakeTensorUpdater.incremental_update = timed_update  # type: ignore[method-assign]
    Pipeline.run = watched_run  # type: ignore[method-assign]
    fx_utils.enable_python_dispatcher = propagation  # type: ignore[assignment]
    _installed.append(times)
    return times
