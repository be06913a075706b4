"""How the passes' own time grows with the graph: traced DDP-shaped graphs of K compressed hook
calls.

    python -m benchmarks.pass_time [--calls 890 3670] [--world-size 8]

Each graph is what a compiled DDP backward with ``bf16_compress_hook`` looks like to the passes
(:func:`ddp_backward`: every gradient computed, then reduced by the hook), traced with a fake
process group (no processes). For each size: the node count, every pass's time in
``default_pipeline()`` order and the pipeline's total, as ``Pipeline.run`` reports them in
``counters["passes"]`` (the total includes its sort and order check; medians of ``--repeat`` fresh
copies, each run after a full garbage collection, the sizes taking turns), and between the
smallest and the largest graph the growth exponent ``log(t2/t1) / log(n2/n1)`` (1.0 is linear),
and the pipeline's time per node at every size (flat where it is linear). Beside them, the
reference a pass cannot beat: one walk over the same graph's nodes (:func:`walk`), whose
exponent shows what the machine's caches make of a linear visit at these sizes.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import time

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

import compiled_hooks as ch
import passes
from passes.core.verify import copy_graph
from passes.testing import fake_process_group, trace


def ddp_backward(*grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each gradient computed (``sin``), then reduced in place by ``bf16_compress_hook``."""
    state = ch.LowPrecisionState(dist.group.WORLD)
    for g in grads:
        g.copy_(torch.sin(g))
        ch.bf16_compress_hook(state, g)
    return grads


WALK = "(a walk over every node)"


def walk(graph: torch.fx.Graph) -> None:
    """What any pass does at least: visit every node and read its target, users and value."""
    for node in graph.nodes:
        node.meta.get("val")
        _ = node.target, len(node.users)


def measure(
    sizes: list[int], world_size: int, repeat: int
) -> list[tuple[int, int, dict[str, float]]]:
    """``(calls, nodes, median seconds per name)`` for each size in ``sizes``. The sizes take
    turns within every repeat, so a drift of the machine's speed hits all of them alike."""
    fake_process_group(world_size)
    pipeline = passes.default_pipeline()
    names = [p.__name__ for p in pipeline.passes] + ["pipeline"]
    graphs = [
        trace(ddp_backward, *(torch.randn(64) for _ in range(calls)), world_size=world_size).graph
        for calls in sizes
    ]
    times = [{name: [] for name in [*names, WALK]} for _ in sizes]
    for _ in range(repeat):
        for gm_graph, t in zip(graphs, times):
            graph = copy_graph(gm_graph)
            counters["passes"].clear()
            gc.collect()  # an earlier copy's garbage is not collected inside this run
            start = time.perf_counter()
            walk(graph)
            t[WALK].append(time.perf_counter() - start)
            pipeline.run(graph)
            for name in names:
                t[name].append(counters["passes"][f"{name}: us"] / 1e6)
    return [
        (calls, len(g.nodes), {name: statistics.median(ts) for name, ts in t.items()})
        for calls, g, t in zip(sizes, graphs, times)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, nargs="+", default=[890, 3670])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = measure(args.calls, args.world_size, args.repeat)
    names = list(rows[0][2])
    print(
        f"pass time on traced DDP graphs with bf16_compress_hook (world {args.world_size}, median "
        f"of {args.repeat}):"
    )
    print(f"{'hook calls':>10} {'nodes':>7} " + " ".join(f"{n:>27}" for n in names))
    for calls, nodes, t in rows:
        print(f"{calls:>10} {nodes:>7} " + " ".join(f"{t[n]:>26.3f}s" for n in names))
    print(
        "pipeline per node: "
        + ", ".join(f"{t['pipeline'] / nodes * 1e6:.1f} us at {nodes}" for _, nodes, t in rows)
    )
    if len(rows) > 1:
        (_, n1, t1), (_, n2, t2) = rows[0], rows[-1]
        print(
            "growth exponent "
            + ", ".join(
                f"{n}: {math.log(t2[n] / t1[n]) / math.log(n2 / n1):.2f}"
                for n in names
                if t1[n] > 0 and t2[n] > 0
            )
        )


if __name__ == "__main__":
    main()
