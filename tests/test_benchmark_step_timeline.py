"""A profiled step's timeline (``step_timeline.timeline``), from events made here: the profiler's
events carry a name, a time range in µs and a CPU parent, which is all it reads."""

import types

from benchmarks.common.step_timeline import STEP, timeline


def event(name, start_ms, end_ms, parent=None):
    span = types.SimpleNamespace(start=start_ms * 1e3, end=end_ms * 1e3)
    return types.SimpleNamespace(name=name, time_range=span, cpu_parent=parent)


def test_a_step_with_two_collectives():
    wait = event("_c10d_functional::wait_tensor", 160, 180)
    events = [
        event(STEP, 0, 50),  # an earlier step: only the last one is shown
        event(STEP, 100, 200),
        event("CompiledFunction", 100, 110),
        event("aten::mm", 110, 150),
        event("_c10d_functional::all_to_all_single", 120, 121),
        event("gloo:all_to_all", 121, 170),
        event("_c10d_functional::reduce_scatter_tensor", 150, 151),
        event("gloo:reduce_scatter", 165, 190),  # overlaps the first: busy 121-190
        wait,
        event("_c10d_functional::wait_tensor", 165, 175, parent=wait),  # the op's kernel
        event("_c10d_functional::wait_tensor", 185, 195),
        event("aten::mm", 205, 210),  # after the step
    ]
    assert timeline(events) == [
        "step 100.0 ms; compiled forward 0.0-10.0; last matmul ends 50.0; in waits 30.0; "
        "backend busy 69.0",
        "collective 0: issued 20.0-21.0, backend 21.0-70.0, waited 60.0-80.0",
        "collective 1: issued 50.0-51.0, backend 65.0-90.0, waited 85.0-95.0",
    ]
