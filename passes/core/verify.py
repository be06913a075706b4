"""Differential verification: run a graph before and after a pass and compare the values.

``Pipeline(..., verify=True)`` (or ``install(verify=True)``, or ``PASSES_VERIFY=1`` in the
environment) calls :func:`check_rewrite` after every pass that changed the graph. Both graphs
run on the same random inputs made from the placeholders' metadata (floats from a fixed-seed
normal distribution, integers and booleans as zeros so that indices stay valid), with every
collective *simulated* for N ranks that hold identical values, seen from rank 0:
``all_reduce`` sum is ``N * x`` and avg is ``x``, ``reduce_scatter`` gives rank 0's shard,
``all_to_all`` N copies of it unreduced, ``all_gather`` repeats, ``broadcast`` and ``wait`` are
the identity, ``group_rank`` is 0, the int8 hook's residuals are zeros and never kept. So
verification never communicates (it is safe at compile time on any number of ranks, whatever
each rank compiles), and it checks exactly what the passes rewrite: the arithmetic and the data
layout around the collectives.

A mismatch raises :class:`PassVerificationError` naming the pass, the first output that
differs, the first node (by name, present in both graphs) whose value differs, and the graph
text around it, before and after. Tolerances depend on dtypes: within four roundings of the
least precise floating dtype among the graph's collectives and the output, relative to the
values' magnitude; integers and booleans must be equal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Interpreter, Node

from compiled_hooks.graph_contract import GROUP_RANK, POWERSGD_COUNT

from .graph_text import graph_str
from .groups import group_info
from .ops import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    BROADCAST,
    BROADCAST_,
    COLLECTIVES,
    REDUCE_SCATTER,
    WAIT,
)
from .record import record
from .traversal import ancestors

__all__ = ["PassVerificationError", "check_rewrite", "simulate", "random_inputs", "copy_graph"]


class PassVerificationError(AssertionError):
    """A pass changed what a graph computes."""


class CannotVerify(Exception):
    """The graph holds something the simulation does not model; nothing is claimed."""


def copy_graph(graph: Graph) -> Graph:
    """An independent copy of ``graph`` (node names and ``meta`` kept)."""
    new = Graph(owning_module=graph.owning_module)
    out = new.graph_copy(graph, {})
    new.output(out)
    return new


def _group_size(group_name: Any) -> int:
    info = group_info(group_name)
    if info is None:
        raise CannotVerify(f"unknown process group {group_name!r}")
    return info.size


def _all_reduce(x, op, group):
    n = _group_size(group)
    if op == "sum":
        return x * n
    if op in ("avg", "max", "min"):
        return x.clone()
    raise CannotVerify(f"all_reduce op {op!r}")


def _reduce_scatter(x, op, n, group):
    shard = x.chunk(n, dim=0)[0].clone()
    if op == "sum":
        return shard * n
    if op in ("avg", "max", "min"):
        return shard
    raise CannotVerify(f"reduce_scatter op {op!r}")


def _all_to_all(x, output_split_sizes, input_split_sizes, group):
    """Rank 0's part of every rank's input: their first piece along dim 0, N times."""
    n = _group_size(group)
    first = x[: input_split_sizes[0]] if input_split_sizes else x.chunk(n, dim=0)[0]
    return torch.cat([first] * n)


_SIMULATED: dict[Any, Callable[..., Any]] = {
    ALL_REDUCE: _all_reduce,
    REDUCE_SCATTER: _reduce_scatter,
    ALL_TO_ALL: _all_to_all,
    WAIT: lambda x: x,
    ALL_GATHER: lambda x, n, group: torch.cat([x] * n),
    BROADCAST: lambda x, src, group: x.clone(),
    BROADCAST_: lambda x, src, group: x,
    GROUP_RANK: lambda group, device: torch.zeros(1, dtype=torch.int64, device=device),
    # PowerSGD's step counter: never run (it would count a step of the state); its Q is a fixed
    # function of the slot, the same in both graphs.
    POWERSGD_COUNT: lambda grad, state_id, slot, rows, cols: torch.randn(
        rows, cols, generator=torch.Generator().manual_seed(slot), dtype=grad.dtype
    ).to(grad.device),
}


class _Simulator(Interpreter):
    def __init__(self, gm: GraphModule):
        super().__init__(gm, garbage_collect_values=False)
        self.values: dict[str, Any] = {}

    def call_function(self, target, args, kwargs):
        if target in _SIMULATED:
            return _SIMULATED[target](*args, **kwargs)
        if getattr(target, "namespace", None) in ("_c10d_functional", "c10d"):
            raise CannotVerify(f"collective {target} is not simulated")
        return super().call_function(target, args, kwargs)

    def run_node(self, n: Node) -> Any:
        value = super().run_node(n)
        if isinstance(value, torch.Tensor):
            self.values[n.name] = value.detach().clone()
        return value


def _hint(s: Any) -> int:
    if isinstance(s, torch.SymInt):
        hint = s.node.hint
        if hint is None:
            raise CannotVerify("a size without a hint")
        return int(hint)
    return int(s)


def random_inputs(graph: Graph, seed: int = 0) -> list[Any]:
    """Inputs for ``graph``'s placeholders from their ``meta["val"]``."""
    gen = torch.Generator().manual_seed(seed)
    inputs: list[Any] = []
    for node in graph.find_nodes(op="placeholder"):
        v = node.meta.get("val")
        if isinstance(v, torch.Tensor):
            shape, stride = [_hint(s) for s in v.shape], [_hint(s) for s in v.stride()]
            t = torch.empty_strided(shape, stride, dtype=v.dtype, device="cpu")
            if v.dtype.is_floating_point:
                t.copy_(torch.randn(shape, generator=gen, dtype=torch.float32))
            else:
                t.zero_()
            inputs.append(t.to(v.device))
        elif isinstance(v, (int, torch.SymInt)):
            inputs.append(_hint(v))
        elif all(u.op == "output" for u in node.users):
            # an opaque object (a DTensor's mesh) passed through
            inputs.append(None)
        else:
            raise CannotVerify(f"placeholder {node.name} has no example value")
    return inputs


def simulate(graph: Graph, inputs: list[Any]) -> tuple[list[Any], dict[str, Any]]:
    """Run ``graph`` on copies of ``inputs`` with simulated collectives; returns the outputs
    followed by the inputs as the graph left them (its in-place writes), and every node's value."""
    gm = GraphModule(graph.owning_module or torch.nn.Module(), graph)
    args = [a.clone() if isinstance(a, torch.Tensor) else a for a in inputs]
    sim = _Simulator(gm)
    out = sim.run(*args)
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    return outs + args, sim.values


def _least_precise(graph: Graph) -> torch.dtype | None:
    dtypes = []
    for n in graph.nodes:
        if n.op == "call_function" and n.target in COLLECTIVES:
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor) and v.dtype.is_floating_point:
                dtypes.append(v.dtype)
    return max(dtypes, key=lambda d: torch.finfo(d).eps) if dtypes else None


def _mismatch(ref: Any, got: Any, wire: torch.dtype | None) -> str | None:
    if not isinstance(ref, torch.Tensor) or not isinstance(got, torch.Tensor):
        return None if ref == got else f"{got!r} != {ref!r}"
    if ref.shape != got.shape or ref.dtype != got.dtype:
        return f"{got.dtype}{list(got.shape)} != {ref.dtype}{list(ref.shape)}"
    if not ref.dtype.is_floating_point:
        return None if torch.equal(ref, got) else "integer values differ"
    ref64, got64 = ref.double(), got.double()
    finite, nan = torch.isfinite(ref64), torch.isnan(ref64)
    infinite = ~finite & ~nan
    if (
        not torch.equal(finite, torch.isfinite(got64))
        or not torch.equal(nan, torch.isnan(got64))
        or not torch.equal(ref64[infinite], got64[infinite])
    ):
        return "non-finite values differ"
    eps = max(torch.finfo(ref.dtype).eps, torch.finfo(wire).eps if wire is not None else 0.0) / 2
    r, g = ref64[finite], got64[finite]
    if r.numel() == 0:
        return None
    bound = 4 * eps * (r.abs() + r.abs().mean())
    err = (g - r).abs()
    if bool((err <= bound).all()):
        return None
    return f"max abs diff {err.max().item():.3g} (allowed there {bound[err.argmax()].item():.3g})"


def _snippet(graph: Graph, name: str | None, context: int = 4) -> str:
    lines = graph_str(graph).splitlines()
    if name is None or len(lines) <= 2 * context + 8:
        return "\n".join(lines)
    idx = next((i for i, line in enumerate(lines) if line.startswith(f"{name}:")), None)
    if idx is None:
        return "\n".join(lines)
    lo, hi = max(0, idx - context), min(len(lines), idx + context + 1)
    return "\n".join((["..."] if lo else []) + lines[lo:hi] + (["..."] if hi < len(lines) else []))


def check_rewrite(pass_name: str, before: Graph, after: Graph, seed: int = 0) -> bool:
    """Raise :class:`PassVerificationError` if ``after`` computes other values than ``before``.
    Returns False (and counts why) when the graph holds something the simulation cannot run."""
    try:
        inputs = random_inputs(before, seed)
        ref, ref_values = simulate(before, inputs)
        got, got_values = simulate(after, inputs)
    except CannotVerify as e:
        record(pass_name, f"verify skipped: {e}")
        return False
    wire = _least_precise(before)
    (output,) = after.find_nodes(op="output")
    out_args = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    for i, (r, g) in enumerate(zip(ref, got)):
        problem = _mismatch(r, g, wire)
        if problem is None:
            continue
        if i < len(out_args) and isinstance(out_args[i], Node):
            where, suspects = f"output {i} ({out_args[i].name})", ancestors([out_args[i]])
        else:
            where, suspects = f"input {i - len(out_args)} (written in place)", set(after.nodes)
        first = next(
            (
                n.name
                for n in after.nodes
                if n in suspects
                and n.name in ref_values
                and n.name in got_values
                and _mismatch(ref_values[n.name], got_values[n.name], wire)
            ),
            None,
        )
        raise PassVerificationError(
            f"pass {pass_name} changed the graph's values: {where}: {problem}.\nFirst node whose "
            f"value differs: {first or 'none found by name'}.\n--- before {pass_name} "
            f"---\n{_snippet(before, first)}\n--- after {pass_name} ---\n{_snippet(after, first)}"
        )
    record(pass_name, "verified")
    return True
