"""Where a :class:`~compiled_hooks.zero.ZeroOptimizer` keeps each rank's state, and how its
buckets go on the wire: two strategies behind :class:`Storage`.

- :class:`~.whole_parameters.WholeParameters` (default): each parameter is owned by one rank
  (:func:`~.layout.assign_whole_parameters`); a rank keeps one flat buffer per state name,
  laid out by the hooks' buckets (:func:`~.layout.lay_out_state`). Buckets are owner-major.
- :class:`~.even_shards.EvenShards` (``shard_buckets=True``): every parameter split evenly, flat,
  padded to a multiple of the world size; a rank keeps its slice of every parameter's state.
  Buckets are rank-major.

The optimizer owns what both share (parameter groups, the hyperparameter table, step counts)
and hands a strategy the bucket to reduce or update. Updates are traceable and make the same
graph on every rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .group_rank import group_rank
from .optim_math import Rule

__all__ = ["BucketUpdate", "Items", "State", "Storage", "clipped"]

Items = list[tuple[int, torch.Tensor]]  # (parameter index, gradient or value)
State = dict[str, torch.Tensor]


class BucketUpdate(NamedTuple):
    """One bucket's step, as :meth:`Storage.update` takes it."""

    items: Items  # (parameter index, averaged gradient), the bucket's members
    row: torch.Tensor | None  # this rank's row of the bucket, where plan_buckets laid it out
    scalars: torch.Tensor  # the step's scalars, one row per member (optim_math.step_scalars)
    clip: torch.Tensor | None  # the gradients' clipping coefficient, if any
    rules: list[Rule]  # each member's update rule
    over_row: bool  # the members' rules allow the update over this rank's row alone
    rank: torch.Tensor  # this rank's index (Storage.rank_tensor)


def clipped(g: torch.Tensor, dtype: torch.dtype, clip: torch.Tensor | None) -> torch.Tensor:
    """``g`` in ``dtype``, scaled by the clipping coefficient ``clip`` if given."""
    return g.to(dtype) if clip is None else g.to(dtype) * clip.to(dtype)


class Storage(ABC):
    """One rank's optimizer state for ``params`` (the optimizer's list, shared: rebinding its
    entries rebinds them here), state tensors named ``names``."""

    reduces_ddp_buckets: bool  # an update takes whole gradients averaged in DDP's own buckets

    def __init__(
        self, params: list[torch.Tensor], names: tuple[str, ...], group: dist.ProcessGroup
    ):
        self.params, self.group = params, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.device = params[0].device
        self._group_name = group.group_name

    @property
    @abstractmethod
    def owners(self) -> list[int] | None:
        """Whole parameters: each parameter's owner; None where every rank keeps a part."""

    def rank_tensor(self) -> torch.Tensor:
        """This rank, read when the graph runs (a 1-element tensor)."""
        return group_rank(self._group_name, self.device)

    @abstractmethod
    def bucket_nbytes(self) -> list[int]:
        """Each parameter's bytes in a bucket on the wire."""

    @abstractmethod
    def plan(self, buckets: list[list[int]], steps: list[float]) -> None:
        """Lay the state out by the hooks' ``buckets`` (``steps``: each parameter's count)."""

    @abstractmethod
    def planned_runs(self) -> Iterable[tuple[int, ...]]:
        """The planned buckets whose state lies in one run, each may be updated over this
        rank's row alone (see :meth:`update`)."""

    @abstractmethod
    def set_steps(self, steps: list[float]) -> None:
        """The step counts were restored."""

    @abstractmethod
    def containers(self) -> list[State]:
        """The live dicts of state tensors (what :meth:`state_bytes` counts and a load fills)."""

    @abstractmethod
    def set_containers(self, containers: list[State]) -> None:
        """Replace the dicts of :meth:`containers`."""

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in self.containers() for t in d.values())

    @abstractmethod
    def state_of(self, i: int) -> State:
        """Parameter ``i``'s state as this rank keeps it."""

    @abstractmethod
    def own_grad(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """Parameter ``i``'s whole averaged gradient as :meth:`update` takes it."""

    @abstractmethod
    def reduce(
        self, hook: Callable[..., Any], state: Any, items: Items
    ) -> tuple[Items, torch.Tensor | None]:
        """Average a bucket of gradients with one ``hook(state, flat)`` call (see
        :meth:`ZeroOptimizer.reduce_bucket <compiled_hooks.zero.ZeroOptimizer.reduce_bucket>`)."""

    @abstractmethod
    def norm_squares(self, items: Items) -> list[torch.Tensor]:
        """This rank's share of the squared norm of the averaged gradients ``items``."""

    @abstractmethod
    def update(self, step: BucketUpdate) -> None:
        """Apply ``step`` to its bucket and leave every rank with the new values (see
        :meth:`ZeroOptimizer.update_bucket <compiled_hooks.zero.ZeroOptimizer.update_bucket>`)."""

    @abstractmethod
    def keeps(self, i: int) -> bool:
        """Whether this rank keeps any of parameter ``i``'s state."""

    @abstractmethod
    def checkpoint_state(self, i: int) -> State:
        """Parameter ``i``'s state in this rank's part of a state dict."""

    @abstractmethod
    def load(self, i: int, values: State) -> None:
        """Load parameter ``i``'s state from ``values``: some of its state names, each at the
        parameter's shape and dtype or a :class:`~.flat_shard.FlatShard` (a rank's slice)."""

    @abstractmethod
    def gather(self, i: int, t: torch.Tensor, to: int) -> torch.Tensor | None:
        """Parameter ``i``'s whole state ``t`` (this rank's :meth:`state_of` entry) on rank ``to``;
        ``None`` elsewhere. Collective over the ranks that keep some of it."""
