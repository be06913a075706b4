"""Graphs as stable text: ``graph_str(gm)``, one line per node, for snapshot tests
(:mod:`passes.testing`) and the verifier's reports (:mod:`passes.core.verify`)."""

from __future__ import annotations

import difflib
from typing import Any

import torch

from compiled_hooks import compat

__all__ = ["graph_diff", "graph_str"]

_DTYPES = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "b8",
}


def _type_str(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"{_DTYPES.get(v.dtype, str(v.dtype))}{list(v.shape)}"
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_type_str(x) for x in v) + ")"
    return ""


def _group_str(name: str) -> str:
    try:
        return f"group(size={compat.group_size_by_name(name)})"
    except Exception:  # noqa: BLE001 - not a group name after all
        return repr(name)


def _arg_str(a: Any, group_arg: bool = False) -> str:
    if isinstance(a, torch.fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg_str(x) for x in a)
        return f"[{inner}]"
    if isinstance(a, torch.dtype):
        return _DTYPES.get(a, str(a))
    if group_arg and isinstance(a, str):
        return _group_str(a)
    if isinstance(a, str):
        return repr(a)
    return str(a)


def _target_str(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        ns, name = target.namespace, target._schema.name.split("::")[-1]
        ns = {"_c10d_functional": "c10d"}.get(ns, ns)
        return f"{ns}.{name}" + (
            "" if target._overloadname in ("default", "Tensor") else f".{target._overloadname}"
        )
    return getattr(target, "__name__", str(target))


def graph_str(gm: torch.fx.GraphModule | torch.fx.Graph) -> str:
    """One line per node, ``name: dtype[shape] = op(args)``: no memory addresses, no
    stack traces, group names as ``group(size=N)``; stable across runs and processes."""
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    lines = []
    for n in graph.nodes:
        if n.op == "placeholder":
            lines.append(f"{n.name}: {_type_str(n.meta.get('val'))} = input")
        elif n.op == "output":
            lines.append(f"return {_arg_str(n.args[0])}")
        else:
            is_collective = (
                isinstance(n.target, torch._ops.OpOverload)
                and n.target.namespace == "_c10d_functional"
            )
            args = [
                _arg_str(a, group_arg=is_collective and i == len(n.args) - 1)
                for i, a in enumerate(n.args)
            ]
            args += [f"{k}={_arg_str(v)}" for k, v in n.kwargs.items()]
            lines.append(
                f"{n.name}: {_type_str(n.meta.get('val'))} = "
                f"{_target_str(n.target)}({', '.join(args)})"
            )
    return "\n".join(lines)


def graph_diff(
    before: torch.fx.GraphModule | torch.fx.Graph, after: torch.fx.GraphModule | torch.fx.Graph
) -> str:
    """What a rewrite changed, as :func:`graph_str` lines: ``-`` removed, ``+`` added, in graph
    order; ``...`` between runs of changes. For snapshots where only the difference matters."""
    lines = difflib.unified_diff(
        graph_str(before).splitlines(), graph_str(after).splitlines(), n=0, lineterm=""
    )
    out: list[str] = []
    for line in lines:
        if line.startswith(("---", "+++")):
            continue
        if line.startswith("@@"):
            if out:
                out.append("...")
            continue
        out.append(line)
    return "\n".join(out)
