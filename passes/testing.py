"""Helpers for graph snapshot tests of communication code, usable in your own tests.

``trace(fn, *args, world_size=8)`` traces ``fn`` into the kind of ATen graph Inductor's
post-grad passes see (fake tensors, Inductor's decompositions, functional collectives with
their ``wait_tensor``, functionalized with writes to inputs as ``copy_`` at the end), against
a fake process group: no processes, no communication, about a
second. ``graph_str(gm)`` prints that graph as stable, normalized text for
``expecttest.TestCase.assertExpectedInline``::

    gm = trace(lambda g: bf16_compress_hook(state, g), torch.randn(16))
    self.assertExpectedInline(graph_str(gm), '''...''')
    fold_collective_scaling(gm.graph)

The fake group stays the default process group after ``trace`` returns, so passes can
resolve its size and backend; a later ``trace`` with another ``world_size`` replaces it. If
a real default group exists, ``trace`` uses it (its size must equal ``world_size``, or pass
``world_size=None``), which lets a multi-rank test trace, rewrite and run the same graph.

``partitioned_graphs(step)`` compiles a training step and returns the forward and backward
graphs AOTAutograd's partitioner made (what is saved, what the backward recomputes), and
``gathered_bytes_alive(graph)`` follows the all-gathered tensors through a graph: how many of
their bytes are alive after each node.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.fx_passes.post_grad import remove_noop_ops
from torch.func import functionalize
from torch.fx.experimental.proxy_tensor import make_fx

from compiled_hooks import compat
from compiled_hooks.graph_contract import BUCKET_UNPACK

from .core.graph_text import graph_diff, graph_str
from .core.traversal import aliases, is_alias

__all__ = [
    "trace",
    "graph_diff",
    "graph_str",
    "fake_process_group",
    "partitioned_graphs",
    "gathered_bytes_alive",
    "saved_for_backward",
]


def fake_process_group(world_size: int) -> dist.ProcessGroup:
    """Make a fake default process group of ``world_size`` ranks (rank 0), replacing a fake
    one of another size; a real default group is never replaced."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        backend = dist.get_backend()
        if backend != "fake":
            if dist.get_world_size() != world_size:
                raise ValueError(
                    f"trace: a {backend} process group of size {dist.get_world_size()} is "
                    f"initialized; world_size={world_size} cannot be traced in this process (pass "
                    "world_size=None)."
                )
            return _world()
        if dist.get_world_size() == world_size:
            return _world()
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    return _world()


def _world() -> dist.ProcessGroup:
    world = dist.group.WORLD
    assert world is not None, "the default group is initialized"
    return world


def trace(fn: Callable[..., Any], *args: Any, world_size: int | None = 8) -> torch.fx.GraphModule:
    """Trace ``fn(*args)`` to a post-grad-style ATen graph with a ``world_size``-rank group."""
    if world_size is None:
        if not dist.is_initialized():
            raise ValueError("trace: world_size=None needs an initialized default process group")
    else:
        fake_process_group(world_size)
    # Functionalized like AOTAutograd's output: in-place updates of inputs become a copy_
    # epilogue at the end of the graph, which is where Inductor's post-grad passes find them.
    with torch.fx.traceback.preserve_node_meta():  # keeps torch.fx.traceback.annotate's marks
        gm = make_fx(
            functionalize(fn, remove="mutations_and_views"),
            tracing_mode="fake",
            decomposition_table=select_decomp_table(),
        )(*args)
    remove_noop_ops(gm.graph)
    gm.recompile()
    return gm


def partitioned_graphs(
    step: Callable[[Callable[..., Any]], Any],
) -> list[tuple[str, torch.fx.GraphModule]]:
    """``step(compile)`` runs a training step with ``compile`` (``torch.compile`` with a backend
    that partitions forward and backward like Inductor, with its decompositions and its
    ``joint_custom_pre_pass``, and runs them as traced); every ``("forward" | "backward",
    graph)`` compiled, in order."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._functorch.aot_autograd import aot_module_simplified

    def partition(joint: torch.fx.GraphModule, inputs: Any, **kwargs: Any) -> Any:
        for joint_pass in compat.post_passes(compat.inductor_config.joint_custom_pre_pass):
            joint_pass(joint.graph)
        return min_cut_rematerialization_partition(joint, inputs, **kwargs)

    graphs: list[tuple[str, torch.fx.GraphModule]] = []

    def keep(kind: str) -> Callable[..., Any]:
        def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            graphs.append((kind, gm))
            return make_boxed_func(gm.forward)

        return compiler

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=keep("forward"),
            bw_compiler=keep("backward"),
            partition_fn=partition,
            decompositions=select_decomp_table(),
        )

    step(lambda fn, **kw: torch.compile(fn, backend=backend, **kw))
    return graphs


_GATHERS = (torch.ops._c10d_functional.all_gather_into_tensor.default,)


def _gathered(node: torch.fx.Node) -> bool:
    """``node`` is an all-gather's output, or a piece a bucket's copy-out made of one."""
    if node.op != "call_function":
        return False
    source = node.args[0] if node.target is operator.getitem else None
    return node.target in _GATHERS or (
        isinstance(source, torch.fx.Node) and source.target is BUCKET_UNPACK
    )


def gathered_bytes_alive(graph: torch.fx.Graph) -> list[int]:
    """After each node of ``graph``, the bytes of all-gather outputs (and of the pieces a
    bucket's copy-out makes of them) still alive: an output lives from the node that makes it to
    the last use of it or of any view of it; one the graph returns (a forward saving it for
    backward) lives to the end."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    alive = [0] * len(nodes)
    for node in nodes:
        if not _gathered(node):
            continue
        last = max(
            (
                index[user] if user.op != "output" else len(nodes) - 1
                for n in aliases(node)
                for user in n.users
            ),
            default=index[node],
        )
        v = node.meta["val"]
        for i in range(index[node], last + 1):
            alive[i] += v.numel() * v.element_size()
    return alive


def saved_for_backward(forward: torch.fx.Graph, outputs: int = 1) -> tuple[int, int]:
    """``(gathered, other)``: the bytes a partitioned forward graph returns for backward after
    its first ``outputs`` values, split into gathered parameters (all-gather outputs, and the
    pieces a bucket's copy-out makes of them) and
    everything else. A saved view counts as the value it views, once; graph inputs and their
    views (parameters' shards, the batch) are left out, since they are held anyway."""
    saved = next(iter(forward.find_nodes(op="output"))).args[0][outputs:]
    bases = set()
    for node in saved:
        while isinstance(node, torch.fx.Node) and is_alias(node) and node.args:
            node = node.args[0]
        if isinstance(node, torch.fx.Node) and node.op != "placeholder":
            bases.add(node)
    gathered = other = 0
    for node in bases:
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        nbytes = value.numel() * value.element_size()
        if _gathered(node):
            gathered += nbytes
        else:
            other += nbytes
    return gathered, other
