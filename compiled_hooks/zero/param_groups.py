"""A :class:`~compiled_hooks.zero.ZeroOptimizer`'s parameter groups: the parameters a group may
hold, and a group whose hyperparameters reach the traced step.

Hyperparameters are tensors when the step runs: ``param_groups`` hold the usual Python values,
and setting one (``group["lr"] = x``, as every torch LR scheduler does) also writes it into the
optimizer's float64 table (one row per group, :data:`~.optim_math.COLUMNS`), so a schedule
changes values, never the compiled graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .optim_math import COLUMNS, UNSUPPORTED

__all__ = ["Group", "checked_params", "groups_state"]

# the group keys the step reads: COLUMNS, and what its form depends on
WATCHED = frozenset(COLUMNS) | {"betas", "nesterov", "decoupled_weight_decay", *UNSUPPORTED}


class Group(dict):
    """A parameter group. Setting a hyperparameter also writes it into the optimizer's table
    (``on_change(index)``, which raises for a value the step cannot take: such a value is
    refused and not kept)."""

    def __init__(self, values: dict[str, Any], on_change: Callable[[int], None], index: int):
        super().__init__(values)
        self._on_change, self._index = on_change, index

    def __setitem__(self, key: str, value: Any) -> None:
        had, old = key in self, self.get(key)
        super().__setitem__(key, value)
        if key not in WATCHED:
            return
        try:
            self._on_change(self._index)
        except Exception:
            if had:
                super().__setitem__(key, old)
            else:
                super().__delitem__(key)
            raise

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]


def checked_params(params: Any, index: int, groups: list[dict[str, Any]]) -> list[torch.Tensor]:
    """The parameters of a new group ``index`` (a tensor or an iterable of them): each a
    floating-point tensor that requires grad and is in no group of ``groups``, and at least one.
    Raises ``TypeError`` or ``ValueError`` naming the parameter."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    seen = {id(p) for g in groups for p in g["params"]}
    for j, p in enumerate(params):
        where = f"parameter {j} of group {index}"
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"ZeroOptimizer: {where} is a {type(p).__name__}, not a tensor")
        if not p.requires_grad:
            raise ValueError(
                f"ZeroOptimizer: {where} (shape {tuple(p.shape)}) does not require grad; "
                "leave it out of the optimizer"
            )
        if not p.is_floating_point():
            raise TypeError(
                f"ZeroOptimizer: {where} has dtype {p.dtype}; only floating point is supported"
            )
        if id(p) in seen:
            raise ValueError(f"ZeroOptimizer: {where} appears more than once")
        seen.add(id(p))
    if not params:
        raise ValueError(f"ZeroOptimizer: parameter group {index} is empty")
    return params


def groups_state(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``param_groups`` as a state dict holds them: values, and parameters by index."""
    groups, start = [], 0
    for group in param_groups:
        n = len(group["params"])
        values = {k: v for k, v in group.items() if k != "params"}
        groups.append({**values, "params": list(range(start, start + n))})
        start += n
    return groups
