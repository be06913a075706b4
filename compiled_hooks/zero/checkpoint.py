"""A :class:`~compiled_hooks.zero.ZeroOptimizer`'s checkpoints, in three forms:

- this rank's part (:func:`local_state`), without communication: every parameter's step, and
  the state this rank keeps, for ``torch.distributed.checkpoint`` (DCP) to save from every rank
  and reshard on load (a ``shard_buckets`` slice is a :class:`~.flat_shard.FlatShard`);
- the whole state on one rank (:func:`consolidated_state`), in ``torch.optim`` form, for a
  one-file checkpoint;
- loading any of them, or a plain ``torch.optim`` state dict (:func:`load_state`).

Parameters map by position, as in ``torch.optim``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from .flat_shard import FlatShard, flat_boxes
from .storage import Storage

__all__ = [
    "LocalState",
    "FlatShard",
    "consolidated_state",
    "flat_boxes",
    "load_state",
    "local_entry",
    "local_state",
]


def local_entry(storage: Storage, steps: torch.Tensor, i: int) -> dict[str, Any]:
    """Parameter ``i``'s entry in this rank's part: its step, and the state this rank keeps of
    it (whole parameters: all of it on the owner, nothing elsewhere; ``shard_buckets``: a
    :class:`~.flat_shard.FlatShard` of this rank's slice)."""
    return {"step": steps[i].to(torch.float32).cpu(), **storage.checkpoint_state(i)}


class LocalState(Mapping):
    """``optimizer.state``, read-only: parameter -> its :func:`local_entry` (``index_of``: a
    parameter's index in ``storage``, raising for one the optimizer does not hold)."""

    def __init__(
        self, storage: Storage, steps: torch.Tensor, index_of: Callable[[torch.Tensor], int]
    ):
        self.storage, self.steps, self.index_of = storage, steps, index_of

    def __getitem__(self, param: torch.Tensor) -> dict[str, Any]:
        return local_entry(self.storage, self.steps, self.index_of(param))

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.storage.params)

    def __len__(self) -> int:
        return len(self.storage.params)


def local_state(
    storage: Storage, steps: torch.Tensor, groups: list[dict[str, Any]]
) -> dict[str, Any]:
    """This rank's part: ``{"state": {index: entry}, "param_groups": groups}``."""
    return {
        "state": {i: local_entry(storage, steps, i) for i in range(len(storage.params))},
        "param_groups": groups,
    }


@torch.no_grad()
def consolidated_state(
    storage: Storage, steps: torch.Tensor, groups: list[dict[str, Any]], to: int
) -> dict[str, Any] | None:
    """The whole state, full tensors at the parameters' shapes, on rank ``to`` of the group
    (``None`` elsewhere). Collective: every rank of the group calls it. Parameters that never
    stepped have no entry, as in ``torch.optim``."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i in range(len(storage.params)):
        step = float(steps[i])
        if step == 0:
            continue
        full = {"step": torch.tensor(step, dtype=torch.float32)}
        for k, t in storage.state_of(i).items():
            whole = storage.gather(i, t, to)
            if whole is not None:
                full[k] = whole
        state[i] = full
    return {"state": state, "param_groups": groups} if storage.rank == to else None


@torch.no_grad()
def load_state(
    storage: Storage,
    steps: torch.Tensor,
    param_groups: list[dict[str, Any]],
    state_dict: dict[str, Any],
) -> None:
    """Load ``state_dict`` (any of the three forms, or a ``torch.optim`` one) into ``storage``
    and ``steps``, and its hyperparameters into ``param_groups`` (set one by one, checked as a
    scheduler's changes are). Each rank takes what it keeps."""
    groups = state_dict.get("param_groups", [])
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in param_groups]:
        raise ValueError(
            f"ZeroOptimizer.load_state_dict: expected parameter groups of "
            f"{[len(g['params']) for g in param_groups]} parameters, got "
            f"{[len(g['params']) for g in groups]}"
        )
    position = {key: i for i, key in enumerate(key for g in groups for key in g["params"])}
    unknown = [key for key in state_dict["state"] if key not in position]
    if unknown:
        raise ValueError(
            f"ZeroOptimizer.load_state_dict: state for parameters {unknown[:5]} that no group lists"
        )
    for group, saved in zip(param_groups, groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    # Loaded into fresh tensors, then copied into the live ones: the state dict's tensors may be
    # views of the live ones (DCP loads into this optimizer's own state_dict()).
    live = storage.containers()
    fresh = [{k: torch.zeros_like(t) for k, t in d.items()} for d in live]
    storage.set_containers(fresh)
    steps.zero_()
    for key, saved in state_dict["state"].items():
        _load_entry(storage, steps, position[key], saved)
    for old, new in zip(live, fresh):
        for k, t in old.items():
            t.copy_(new[k])
    storage.set_containers(live)
    storage.set_steps(steps.tolist())


def _load_entry(storage: Storage, steps: torch.Tensor, i: int, saved: dict[str, Any]) -> None:
    p = storage.params[i]
    names = list(storage.state_of(i))
    if "step" in saved:
        steps[i] = float(saved["step"])
    elif any(k in saved for k in names):  # torch's SGD keeps no step count
        steps[i] = 1.0
    if not storage.keeps(i):
        return
    values = {}
    for k in names:
        value = saved.get(k)
        if value is None:
            if float(steps[i]) > 0:
                raise ValueError(
                    f"ZeroOptimizer.load_state_dict: parameter {i} stepped but its state {k!r} is "
                    "missing on the rank that keeps it (a rank's part of a state dict loads only "
                    "on that rank; use torch.distributed.checkpoint to reshard)"
                )
            continue
        if not isinstance(value, FlatShard):
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(
                    f"ZeroOptimizer.load_state_dict: state {k!r} of parameter {i} has shape "
                    f"{tuple(value.shape)}, expected {tuple(p.shape)}"
                )
            value = value.to(device=p.device, dtype=p.dtype)
        values[k] = value
    storage.load(i, values)
