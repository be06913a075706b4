"""Where a :class:`~compiled_hooks.zero.ZeroOptimizer` keeps each rank's state, and how its
buckets go on the wire: two strategies behind :class:`Storage`.

- :class:`WholeParameters` (default): each parameter is owned by one rank
  (:func:`~.layout.assign_whole_parameters`); a rank keeps one flat buffer per state name,
  laid out by the hooks' buckets (:func:`~.layout.lay_out_state`). Buckets are owner-major.
- :class:`EvenShards` (``shard_buckets=True``): every parameter split evenly, flat, padded to a
  multiple of the world size; a rank keeps its slice of every parameter's state. Buckets are
  rank-major.

The optimizer owns what both share (parameter groups, the hyperparameter table, step counts)
and hands a strategy the bucket to reduce or update. Updates are traceable and make the same
graph on every rank.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from ..ops import group_rank
from .buckets import broadcast_rows, own_row, owner_major, rank_major
from .flat_shard import FlatShard
from .layout import Piece, Run, assign_whole_parameters, lay_out_state
from .optim_math import Rule, apply, direction_rule, update

__all__ = ["EvenShards", "Storage", "WholeParameters"]

Items = list[tuple[int, torch.Tensor]]  # (parameter index, gradient or value)
State = dict[str, torch.Tensor]


def _clipped(g: torch.Tensor, dtype: torch.dtype, clip: Optional[torch.Tensor]) -> torch.Tensor:
    return g.to(dtype) if clip is None else g.to(dtype) * clip.to(dtype)


class Storage(ABC):
    """One rank's optimizer state for ``params`` (the optimizer's list, shared: rebinding its
    entries rebinds them here), state tensors named ``names``."""

    owners: Optional[list[int]]  # whole parameters: each parameter's owner; None where all share
    reduces_ddp_buckets: bool  # an update takes whole gradients averaged in DDP's own buckets

    def __init__(self, params: list[torch.Tensor], names: tuple[str, ...], group: dist.ProcessGroup):
        self.params, self.group = params, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.device = params[0].device
        self._group_name = group.group_name

    def rank_tensor(self) -> torch.Tensor:
        """This rank, read when the graph runs (a 1-element tensor)."""
        return group_rank(self._group_name, self.device)

    @abstractmethod
    def bucket_nbytes(self) -> list[int]:
        """Each parameter's bytes in a bucket on the wire."""

    def plan(self, buckets: list[list[int]], steps: list[float]) -> None:
        """Lay the state out by the hooks' ``buckets`` (``steps``: each parameter's count)."""

    def planned_runs(self) -> Iterable[tuple[int, ...]]:
        """The planned buckets whose state lies in one run, each may be updated over this
        rank's row alone (see :meth:`update`)."""
        return ()

    def note_stepped(self, key: tuple[int, ...]) -> None:
        """An update of the parameters ``key`` ran."""

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
    def reduce(self, hook: Callable[..., Any], state: Any, items: Items) -> tuple[Items, Optional[torch.Tensor]]:
        """Average a bucket of gradients with one ``hook(state, flat)`` call (see
        :meth:`ZeroOptimizer.reduce_bucket <compiled_hooks.zero.ZeroOptimizer.reduce_bucket>`)."""

    @abstractmethod
    def norm_squares(self, items: Items) -> list[torch.Tensor]:
        """This rank's share of the squared norm of the averaged gradients ``items``."""

    @abstractmethod
    def update(self, items: Items, row: Optional[torch.Tensor], scalars: torch.Tensor, clip: Optional[torch.Tensor],
               rules: list[Rule], over_row: bool, rank: torch.Tensor) -> None:
        """Apply the update to the bucket ``items`` and leave every rank with the new values
        (see :meth:`ZeroOptimizer.update_bucket <compiled_hooks.zero.ZeroOptimizer.update_bucket>`).
        ``scalars``: one row per member; ``over_row``: the members' rules allow the update over
        this rank's ``row`` alone; ``rank``: :meth:`rank_tensor`."""

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
    def gather(self, i: int, t: torch.Tensor, to: int) -> Optional[torch.Tensor]:
        """Parameter ``i``'s whole state ``t`` (this rank's :meth:`state_of` entry) on rank ``to``;
        ``None`` elsewhere. Collective over the ranks that keep some of it."""


class WholeParameters(Storage):
    """Each parameter owned by one rank; buckets owner-major, read back by row. Where the
    optimizer allows it (``over_row``) and the bucket's state lies in one run, the update runs
    over this rank's row only."""

    reduces_ddp_buckets = True

    def __init__(self, params: list[torch.Tensor], names: tuple[str, ...], group: dist.ProcessGroup):
        super().__init__(params, names, group)
        ready = list(reversed(range(len(params))))
        assigned = assign_whole_parameters([params[i].numel() for i in ready], self.world_size)
        self.owners = [0] * len(params)
        self.pieces: list[list[Piece]] = [[] for _ in params]  # see lay_out_state
        for j, i in enumerate(ready):
            self.owners[i], self.pieces[i] = assigned.owner[j], [(assigned.offset[j], params[i].numel())]
        self.buffers = {k: torch.zeros(max(assigned.load), dtype=params[0].dtype, device=self.device) for k in names}
        self.runs: dict[tuple[int, ...], Run] = {}  # after plan: the planned buckets' runs of state
        self.bucket_of: dict[int, tuple[int, ...]] = {}
        self.buckets: list[list[int]] = []  # the hooks' buckets, as plan got them
        self.uniform_steps = True  # every planned bucket's members have one step count

    def bucket_nbytes(self) -> list[int]:
        return [p.numel() * p.element_size() for p in self.params]

    def plan(self, buckets: list[list[int]], steps: list[float]) -> None:
        """A bucket whose owner rows are nearly equal gets a run of state holding this rank's
        row at an offset the same on every rank; the other members fill the shorter rows'
        tails. The buffers keep their size. This rank's state moves along."""
        layout = lay_out_state([p.numel() for p in self.params], self.owners, buckets, self.world_size)
        owned = {i: self.state_of(i) for i in range(len(self.params)) if self.owners[i] == self.rank}
        self.buffers = {k: torch.zeros(layout.size, dtype=buf.dtype, device=buf.device)
                        for k, buf in self.buffers.items()}
        self.pieces = layout.pieces
        for i, state in owned.items():
            self.store(i, state)
        self.buckets = [list(b) for b in buckets]
        self.runs = dict(layout.runs)
        self.bucket_of = {i: key for key in self.runs for i in key}
        self.set_steps(steps)

    def planned_runs(self) -> Iterable[tuple[int, ...]]:
        return self.runs.keys()

    def set_steps(self, steps: list[float]) -> None:
        self.uniform_steps = all(len({steps[i] for i in key}) == 1 for key in self.runs)

    def note_stepped(self, key: tuple[int, ...]) -> None:
        """The planned buckets' members keep one step count each as long as every update covers
        whole planned buckets; an update of part of one ends that (the update over own rows
        then stays off, until a load or :meth:`plan` finds the counts equal again)."""
        if key in self.runs or not self.runs or not self.uniform_steps:
            return
        buckets = {self.bucket_of[i] for i in key if i in self.bucket_of}
        if sum(len(b) for b in buckets) != len({i for i in key if i in self.bucket_of}):
            self.uniform_steps = False

    def containers(self) -> list[State]:
        return [self.buffers]

    def set_containers(self, containers: list[State]) -> None:
        self.buffers, = containers

    def state_of(self, i: int) -> State:
        """Shaped like the parameter: views, except where the state lies in several pieces (a
        copy)."""
        state = {}
        for k, buf in self.buffers.items():
            parts = [buf[lo:lo + n] for lo, n in self.pieces[i]]
            state[k] = (parts[0] if len(parts) == 1 else torch.cat(parts)).view_as(self.params[i])
        return state

    def store(self, i: int, state: State) -> None:
        """Write parameter ``i``'s whole ``state`` into this rank's buffers, at its pieces."""
        at = 0
        for lo, n in self.pieces[i]:
            self._write(lo, {k: state[k].reshape(-1)[at:at + n] for k in self.buffers})
            at += n

    def _write(self, lo: int, new_state: State) -> None:
        """Write ``new_state`` (flat, one per buffer) into the buffers at ``lo``.

        Traced (``torch.compiler.is_compiling()``), an ``index_put_`` rather than
        ``buf[lo:hi].copy_``: a traced slice write becomes a ``slice_scatter`` of the whole
        buffer, and Inductor fuses a bucket's chain of them into kernels that each loop over the
        whole buffer, while an ``index_put`` it turns back into an in-place write of the slice
        (its index an ``arange`` computed in the kernel, never stored). Eager, the slice write:
        there an ``index_put_`` materializes the index and scatters."""
        if not new_state:  # SGD without momentum keeps no state
            return
        n = next(iter(new_state.values())).numel()
        traced = torch.compiler.is_compiling()
        index = (torch.arange(lo, lo + n, device=self.device),) if traced else None
        for k, buf in self.buffers.items():
            if traced:
                buf.index_put_(index, new_state[k])
            else:
                buf[lo:lo + n].copy_(new_state[k])

    def own_grad(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        return grad

    def reduce(self, hook: Callable[..., Any], state: Any, items: Items) -> tuple[Items, Optional[torch.Tensor]]:
        """Owner-major; ``g`` is the member's averaged gradient on its owner (elsewhere it is
        not used: only owners' updates are kept); ``row`` is this rank's row, the ``g`` views
        of it."""
        flat, place = owner_major([g for _, g in items], [self.owners[i] for i, _ in items], self.world_size)
        hook(state, flat)
        own = own_row(flat, self.world_size, self.rank_tensor)
        return [(i, own[at:at + g.numel()].view_as(g)) for (i, g), (_, at) in zip(items, place)], own

    def norm_squares(self, items: Items) -> list[torch.Tensor]:
        rank = self.rank_tensor().reshape(())
        return [torch.where(rank == self.owners[i], g.float().square().sum(), 0.0) for i, g in items]

    def update(self, items: Items, row: Optional[torch.Tensor], scalars: torch.Tensor, clip: Optional[torch.Tensor],
               rules: list[Rule], over_row: bool, rank: torch.Tensor) -> None:
        """Given ``row`` of a bucket :meth:`plan` laid out, ``over_row`` and one step count
        among the members: each rank computes the direction over its own row only, and every
        rank applies the broadcast rows to its parameters (:meth:`_update_row`). Otherwise
        every rank computes the update of every member, keeps the state of those it owns, and
        every rank's row of new values is broadcast from that rank."""
        key = tuple(i for i, _ in items)
        self.note_stepped(key)
        if row is not None and over_row and key in self.runs and self.uniform_steps:
            self._update_row(key, row if clip is None else row * clip.to(row.dtype), rank, scalars, rules[0])
            return
        new_values = []
        for (i, g), s, rule in zip(items, scalars.unbind(0), rules):
            p = self.params[i]
            new, new_state = update(p, _clipped(g, p.dtype, clip), self.state_of(i), s, rule)
            self._write_owned(i, new_state, (rank == self.owners[i]).reshape(()))
            new_values.append(new.reshape(-1))
        members = [new.view_as(self.params[i]) for i, new in zip(key, new_values)]
        flat, place = owner_major(members, [self.owners[i] for i in key], self.world_size)
        self._apply_rows(key, place, own_row(flat, self.world_size, rank), lambda j, p, new: new)

    def _update_row(self, key: tuple[int, ...], row: torch.Tensor, rank: torch.Tensor, scalars: torch.Tensor,
                    rule: Rule) -> None:
        """The update over this rank's row::

            u, new = direction(row, s[start:start+L], step)    # this rank's row only
            s[start:start+L] = where(arange(L) < this rank's row length, new, s[start:start+L])
            p <- p * decay - scale * broadcast_rows(u)[owner(p), place(p)]

        (the ``where`` only where rows differ: a shorter row's tail holds other state, see
        :func:`~.layout.lay_out_state`; ``decay`` and ``scale`` are each member's own, from its
        group's learning rate)."""
        run = self.runs[key]
        per_member = scalars.unbind(0)
        state = {k: buf[run.start:run.start + run.length] for k, buf in self.buffers.items()}
        rule_fn = direction_rule(rule)
        assert rule_fn is not None, "over_row is given only for rules with a direction"
        direction, new_state = rule_fn(row.to(self.params[key[0]].dtype), state, per_member[0], rule)
        if run.lengths is not None:
            lengths = torch.tensor(run.lengths, device=self.device).index_select(0, rank)
            mine = torch.arange(run.length, device=self.device) < lengths
            new_state = {k: torch.where(mine, t, state[k]) for k, t in new_state.items()}
        self._write(run.start, new_state)
        self._apply_rows(key, run.place, direction, lambda j, p, u: apply(p, u, per_member[j], rule))

    def _apply_rows(self, members: tuple[int, ...], place: list[tuple[int, int]], own: torch.Tensor,
                    combine: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Broadcast every rank's row ``own`` (owner-major) from that rank and write
        ``combine(j, param, its part of the rows)`` into each parameter of ``members`` (``j``:
        its position in the bucket)."""
        rows = broadcast_rows(own, self.group, self.world_size)
        for j, (i, (r, at)) in enumerate(zip(members, place)):
            p = self.params[i]
            p.copy_(combine(j, p, rows[r, at:at + p.numel()].view_as(p)))

    def _write_owned(self, i: int, new_state: State, owned: torch.Tensor) -> None:
        """Write parameter ``i``'s new state at its pieces where this rank owns it (``owned``, a
        0-dim bool read at run time)."""
        at = 0
        for lo, n in self.pieces[i]:
            self._write(lo, {k: torch.where(owned, new_state[k].reshape(-1)[at:at + n], buf[lo:lo + n])
                             for k, buf in self.buffers.items()})
            at += n

    def keeps(self, i: int) -> bool:
        return self.owners[i] == self.rank

    def checkpoint_state(self, i: int) -> State:
        return self.state_of(i) if self.keeps(i) else {}

    def load(self, i: int, values: State) -> None:
        """Missing names load as zeros."""
        for name, value in values.items():
            if isinstance(value, FlatShard):
                raise ValueError(f"ZeroOptimizer.load_state_dict: state {name!r} of parameter {i} is another "
                                 f"rank's slice ({value}); use torch.distributed.checkpoint to reshard")
        if values:
            self.store(i, {k: values[k] if k in values else torch.zeros_like(self.params[i]) for k in self.buffers})

    def gather(self, i: int, t: torch.Tensor, to: int) -> Optional[torch.Tensor]:
        """Point-to-point from the owner."""
        owner, here = self.owners[i], self.rank == to
        if owner == to:
            return t.clone() if here else None
        if self.rank == owner:
            dist.send(t.contiguous(), dst=dist.get_global_rank(self.group, to), group=self.group)
        elif here:
            full = torch.empty_like(t)
            dist.recv(full, src=dist.get_global_rank(self.group, owner), group=self.group)
            return full
        return None


class EvenShards(Storage):
    """Every parameter split evenly in ``world_size`` chunks (flat, padded); buckets rank-major,
    so a rank's row holds its slice of every member, and it updates those slices."""

    owners = None
    reduces_ddp_buckets = False

    def __init__(self, params: list[torch.Tensor], names: tuple[str, ...], group: dist.ProcessGroup):
        super().__init__(params, names, group)
        self.chunks = [math.ceil(p.numel() / self.world_size) for p in params]
        self.state = [{k: torch.zeros(c, dtype=p.dtype, device=self.device) for k in names}
                      for p, c in zip(params, self.chunks)]

    def bucket_nbytes(self) -> list[int]:
        return [self.world_size * c * p.element_size() for c, p in zip(self.chunks, self.params)]

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
        return list(own_row(flat, self.world_size, self.rank_tensor).split([self.chunks[i] for i, _ in items]))

    def _own_slice(self, i: int, t: torch.Tensor) -> torch.Tensor:
        return self._own_slices([(i, t)], rank_major([t], [self.chunks[i]], self.world_size))[0]

    def own_grad(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        return self._own_slice(i, grad)

    def reduce(self, hook: Callable[..., Any], state: Any, items: Items) -> tuple[Items, Optional[torch.Tensor]]:
        """Rank-major; ``g`` is this rank's slice; no row."""
        flat = rank_major([g for _, g in items], [self.chunks[i] for i, _ in items], self.world_size)
        hook(state, flat)
        return list(zip((i for i, _ in items), self._own_slices(items, flat))), None

    def norm_squares(self, items: Items) -> list[torch.Tensor]:
        return [g.float().square().sum() for _, g in items]

    def update(self, items: Items, row: Optional[torch.Tensor], scalars: torch.Tensor, clip: Optional[torch.Tensor],
               rules: list[Rule], over_row: bool, rank: torch.Tensor) -> None:
        """Each rank updates its slices; the bucket's slices are broadcast from every rank."""
        new_values = []
        for (i, g), s, rule in zip(items, scalars.unbind(0), rules):
            p = self._own_slice(i, self.params[i].detach())
            state = self.state[i]
            new, new_state = update(p, _clipped(g, p.dtype, clip), state, s, rule)
            for k, t in state.items():
                t.copy_(new_state[k])
            new_values.append(new.reshape(-1))
        rows = broadcast_rows(torch.cat(new_values), self.group, self.world_size)
        offset = 0
        for (i, _), new in zip(items, new_values):
            p = self.params[i]
            p.copy_(rows[:, offset:offset + new.numel()].reshape(-1)[: p.numel()].view_as(p))
            offset += new.numel()

    def keeps(self, i: int) -> bool:
        return True

    def checkpoint_state(self, i: int) -> State:
        """A :class:`~.flat_shard.FlatShard` of this rank's slice."""
        lo, hi = self.bounds(i)
        shape = tuple(self.params[i].shape)
        return {k: FlatShard(t[:hi - lo], shape, lo) for k, t in self.state[i].items()}

    def load(self, i: int, values: State) -> None:
        for name, value in values.items():
            target = self.state[i][name]
            if not isinstance(value, FlatShard):
                target.copy_(self._own_slice(i, value))
            elif tuple(value.shape) != tuple(self.params[i].shape) or value.lo != self.bounds(i)[0]:
                raise ValueError(f"ZeroOptimizer.load_state_dict: state {name!r} of parameter {i} is another "
                                 f"rank's slice ({value}); use torch.distributed.checkpoint to reshard")
            else:
                target[:value.local.numel()].copy_(value.local)

    def gather(self, i: int, t: torch.Tensor, to: int) -> Optional[torch.Tensor]:
        """A gather of every rank's slice."""
        here = self.rank == to
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if here else None
        dist.gather(t.contiguous(), parts, dst=dist.get_global_rank(self.group, to), group=self.group)
        p = self.params[i]
        return torch.cat(parts)[: p.numel()].view_as(p) if parts is not None else None
