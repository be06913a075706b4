"""The ``shard_buckets`` storage of a :class:`~compiled_hooks.zero.ZeroOptimizer`: every
parameter split evenly in ``world_size`` flat chunks (padded); a rank keeps its chunk of every
parameter's state, and buckets go on the wire rank-major (:func:`~.buckets.rank_major`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from .buckets import broadcast_rows, own_row, rank_major
from .flat_shard import FlatShard
from .optim_math import update
from .storage import BucketUpdate, Items, State, Storage, clipped

__all__ = ["EvenShards"]


class EvenShards(Storage):
    """Every parameter split evenly in ``world_size`` chunks (flat, padded); buckets rank-major,
    so a rank's row holds its slice of every member, and it updates those slices."""

    reduces_ddp_buckets = False

    def __init__(
        self, params: list[torch.Tensor], names: tuple[str, ...], group: dist.ProcessGroup
    ):
        super().__init__(params, names, group)
        self.chunks = [math.ceil(p.numel() / self.world_size) for p in params]
        self.state = [
            {k: torch.zeros(c, dtype=p.dtype, device=self.device) for k in names}
            for p, c in zip(params, self.chunks)
        ]

    @property
    def owners(self) -> None:
        return None

    def bucket_nbytes(self) -> list[int]:
        return [self.world_size * c * p.element_size() for c, p in zip(self.chunks, self.params)]

    def plan(self, buckets: list[list[int]], steps: list[float]) -> None:
        """The layout does not depend on the buckets."""

    def planned_runs(self) -> Iterable[tuple[int, ...]]:
        return ()

    def set_steps(self, steps: list[float]) -> None:
        """The update does not depend on the step counts."""

    def containers(self) -> list[State]:
        return self.state

    def set_containers(self, containers: list[State]) -> None:
        self.state = containers

    def state_of(self, i: int) -> State:
        """This rank's flat slice."""
        return self.state[i]

    def bounds(self, i: int) -> tuple[int, int]:
        """The elements ``lo .. hi`` of parameter ``i`` (flat) this rank keeps, its slice
        without the padding."""
        n = self.params[i].numel()
        lo = min(self.rank * self.chunks[i], n)
        return lo, min(lo + self.chunks[i], n)

    def _own_slices(self, items: Items, flat: torch.Tensor) -> list[torch.Tensor]:
        return list(
            own_row(flat, self.world_size, self.rank_tensor).split(
                [self.chunks[i] for i, _ in items]
            )
        )

    def _own_slice(self, i: int, t: torch.Tensor) -> torch.Tensor:
        return self._own_slices([(i, t)], rank_major([t], [self.chunks[i]], self.world_size))[0]

    def own_grad(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        return self._own_slice(i, grad)

    def reduce(
        self, hook: Callable[..., Any], state: Any, items: Items
    ) -> tuple[Items, torch.Tensor | None]:
        """Rank-major; ``g`` is this rank's slice; no row."""
        flat = rank_major(
            [g for _, g in items], [self.chunks[i] for i, _ in items], self.world_size
        )
        hook(state, flat)
        return list(zip((i for i, _ in items), self._own_slices(items, flat))), None

    def norm_squares(self, items: Items) -> list[torch.Tensor]:
        return [g.float().square().sum() for _, g in items]

    def update(self, step: BucketUpdate) -> None:
        """Each rank updates its slices; the bucket's slices are broadcast from every rank."""
        new_values = []
        for (i, g), s, rule in zip(step.items, step.scalars.unbind(0), step.rules):
            p = self._own_slice(i, self.params[i].detach())
            state = self.state[i]
            new, new_state = update(p, clipped(g, p.dtype, step.clip), state, s, rule)
            for k, t in state.items():
                t.copy_(new_state[k])
            new_values.append(new.reshape(-1))
        rows = broadcast_rows(torch.cat(new_values), self.group, self.world_size)
        offset = 0
        for (i, _), new in zip(step.items, new_values):
            p = self.params[i]
            p.copy_(rows[:, offset : offset + new.numel()].reshape(-1)[: p.numel()].view_as(p))
            offset += new.numel()

    def keeps(self, i: int) -> bool:
        return True

    def checkpoint_state(self, i: int) -> State:
        """A :class:`~.flat_shard.FlatShard` of this rank's slice."""
        lo, hi = self.bounds(i)
        shape = tuple(self.params[i].shape)
        return {k: FlatShard(t[: hi - lo], shape, lo) for k, t in self.state[i].items()}

    def load(self, i: int, values: State) -> None:
        for name, value in values.items():
            target = self.state[i][name]
            if not isinstance(value, FlatShard):
                target.copy_(self._own_slice(i, value))
            elif tuple(value.shape) != tuple(self.params[i].shape) or value.lo != self.bounds(i)[0]:
                raise ValueError(
                    f"ZeroOptimizer.load_state_dict: state {name!r} of parameter {i} is another "
                    f"rank's slice ({value}); use torch.distributed.checkpoint to reshard"
                )
            else:
                target[: value.local.numel()].copy_(value.local)

    def gather(self, i: int, t: torch.Tensor, to: int) -> torch.Tensor | None:
        """A gather of every rank's slice."""
        here = self.rank == to
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if here else None
        dist.gather(
            t.contiguous(), parts, dst=dist.get_global_rank(self.group, to), group=self.group
        )
        p = self.params[i]
        return torch.cat(parts)[: p.numel()].view_as(p) if parts is not None else None
