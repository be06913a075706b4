"""One profiled training step, as a timeline: when the compute ran, and when each collective
was issued, moved by the backend's thread and waited for.

    events = profiled_steps(step, 5)      # torch.profiler over 5 steps, each marked STEP
    print("\\n".join(timeline(events)))   # the last of them

What a step's table cannot say, this shows: whether the wire was busy all along (the step is
its collectives' time) or idle while the cores computed, and which waits the step sat in.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = ["STEP", "MATMULS", "COLLECTIVES", "profiled_steps", "waits", "timeline"]

STEP = "benchmark step"
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")
COLLECTIVES = (
    "_c10d_functional::all_reduce_",
    "_c10d_functional::reduce_scatter_tensor",
    "_c10d_functional::all_to_all_single",
    "_c10d_functional::all_gather_into_tensor",
    "c10d::allreduce_",
)


def profiled_steps(step: Callable[[], object], steps: int) -> list:
    """The profiler's CPU events of ``steps`` calls of ``step``, each after a barrier and under
    the label :data:`STEP`."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            dist.barrier()
            with record_function(STEP):
                step()
    return list(prof.events())


def waits(events: list) -> list:
    """The ``wait_tensor`` ops of ``events`` (not their kernels, which repeat the name)."""
    return [
        e
        for e in events
        if e.name == "_c10d_functional::wait_tensor"
        and (e.cpu_parent is None or e.cpu_parent.name != e.name)
    ]


def _busy_ms(spans: list[tuple[float, float]]) -> float:
    """The length of the union of ``spans`` (µs), in ms."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


def timeline(events: list) -> list[str]:
    """The last :data:`STEP` of ``events``, in ms from its start: a summary line (the step, the
    compiled forward, the end of the last matmul, the time the step sat in waits, and the time
    the backend's thread was busy), then per collective when the graph issued it, when the
    backend's thread moved it (``gloo:...`` / ``nccl:...`` events, on their own threads) and
    when the graph waited for it."""
    step = [e for e in events if e.name == STEP][-1]
    t0, t1 = step.time_range.start, step.time_range.end

    def span(e) -> str:
        return f"{(e.time_range.start - t0) / 1e3:.1f}-{(e.time_range.end - t0) / 1e3:.1f}"

    inside = sorted(
        (e for e in events if t0 <= e.time_range.start and e.time_range.end <= t1),
        key=lambda e: e.time_range.start,
    )
    issued = [e for e in inside if e.name in COLLECTIVES and e.name.startswith("_c10d_functional")]
    moved = [e for e in inside if e.name.split(":")[0] in ("gloo", "nccl")]
    waited = waits(inside)
    forward = [span(e) for e in inside if e.name == "CompiledFunction"]
    matmuls = [e.time_range.end for e in inside if e.name in MATMULS]
    last_matmul = f"{(max(matmuls) - t0) / 1e3:.1f}" if matmuls else "-"
    in_waits = _busy_ms([(e.time_range.start, e.time_range.end) for e in waited])
    backend = _busy_ms([(e.time_range.start, e.time_range.end) for e in moved])
    lines = [
        f"step {(t1 - t0) / 1e3:.1f} ms; compiled forward {', '.join(forward) or '-'}; last "
        f"matmul ends {last_matmul}; in waits {in_waits:.1f}; backend busy {backend:.1f}"
    ]
    lines += [
        f"collective {i}: issued {span(a)}, backend {span(m) if m else '-'}, waited "
        f"{span(w) if w else '-'}"
        for i, (a, m, w) in enumerate(itertools.zip_longest(issued, moved[: len(issued)], waited))
        if a is not None
    ]
    return lines
