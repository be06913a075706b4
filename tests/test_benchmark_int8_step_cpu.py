"""``int8_step_cpu.by_category``, from events made here: a name, a CPU parent and a self CPU time
in µs, which is all it reads."""

import types

import pytest

from benchmarks.int8_step_cpu import (
    CAT,
    CATEGORIES,
    DEQUANTIZE,
    KERNELS,
    MATMUL,
    REST,
    WAITS,
    by_category,
)


def event(name, self_ms, parent=None):
    return types.SimpleNamespace(name=name, self_cpu_time_total=self_ms * 1e3, cpu_parent=parent)


def test_each_event_counts_for_its_outermost_categorized_op():
    graph = event("## Call CompiledFxGraph abc ##", 1.0)
    dequantize = event("compiled_hooks::dequantize_packed", 0.5, graph)
    events = [
        graph,  # the graph's own Python: the rest
        dequantize,
        event("aten::mul_", 3.0, dequantize),
        event("aten::view", 0.25, event("aten::unsqueeze", 0.5, dequantize)),  # two levels down
        event("aten::copy_", 2.0, graph),
        event("aten::cat", 1.5, graph),
        event("graph_1_cpp_fused_3", 4.0, graph),
        event("aten::mm", 6.0),
        event("aten::addmm", 2.0, event("CompiledFunction", 0.0)),
        event("_c10d_functional::wait_tensor", 0.5),
        event("aten::empty", 0.25),
    ]
    ms = by_category(events, steps=2)
    assert list(ms) == CATEGORIES
    assert ms == pytest.approx(
        {
            DEQUANTIZE: (0.5 + 3.0 + 0.25) / 2,
            CAT: 1.5 / 2,
            KERNELS: 4.0 / 2,
            MATMUL: 8.0 / 2,
            WAITS: 0.5 / 2,
            REST: (1.0 + 2.0 + 0.0 + 0.25) / 2,
        }
    )
