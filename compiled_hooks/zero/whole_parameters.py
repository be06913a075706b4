"""The default storage of a :class:`~compiled_hooks.zero.ZeroOptimizer`: whole parameters, each
owned by one rank (:func:`~.layout.assign_whole_parameters`). A rank keeps one flat buffer per
state name, laid out by the hooks' buckets (:func:`~.layout.lay_out_state`); buckets go on the
wire owner-major (:func:`~.buckets.owner_major`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from .buckets import broadcast_rows, own_row, owner_major
from .flat_shard import FlatShard
from .layout import Piece, Run, assign_whole_parameters, lay_out_state
from .optim_math import Rule, apply, direction_rule, update
from .storage import BucketUpdate, Items, State, Storage, clipped

__all__ = ["WholeParameters"]


class WholeParameters(Storage):
    """Each parameter owned by one rank; buckets owner-major, read back by row. Where the
    optimizer allows it (``over_row``) and the bucket's state lies in one run, the update runs
    over this rank's row only."""

    reduces_ddp_buckets = True

    def __init__(
        self, params: list[torch.Tensor], names: tuple[str, ...], group: dist.ProcessGroup
    ):
        super().__init__(params, names, group)
        ready = list(reversed(range(len(params))))
        assigned = assign_whole_parameters([params[i].numel() for i in ready], self.world_size)
        self._owners = [0] * len(params)
        self.pieces: list[list[Piece]] = [[] for _ in params]  # see lay_out_state
        for j, i in enumerate(ready):
            self._owners[i], self.pieces[i] = (
                assigned.owner[j],
                [(assigned.offset[j], params[i].numel())],
            )
        self.buffers = {
            k: torch.zeros(max(assigned.load), dtype=params[0].dtype, device=self.device)
            for k in names
        }
        self.runs: dict[tuple[int, ...], Run] = {}  # after plan: the planned buckets' runs of state
        self.bucket_of: dict[int, tuple[int, ...]] = {}
        self.buckets: list[list[int]] = []  # the hooks' buckets, as plan got them
        self.uniform_steps = True  # every planned bucket's members have one step count

    @property
    def owners(self) -> list[int]:
        return self._owners

    def bucket_nbytes(self) -> list[int]:
        return [p.numel() * p.element_size() for p in self.params]

    def plan(self, buckets: list[list[int]], steps: list[float]) -> None:
        """A bucket whose owner rows are nearly equal gets a run of state holding this rank's
        row at an offset the same on every rank; the other members fill the shorter rows'
        tails. The buffers keep their size. This rank's state moves along."""
        layout = lay_out_state(
            [p.numel() for p in self.params], self._owners, buckets, self.world_size
        )
        owned = {
            i: self.state_of(i) for i in range(len(self.params)) if self._owners[i] == self.rank
        }
        self.buffers = {
            k: torch.zeros(layout.size, dtype=buf.dtype, device=buf.device)
            for k, buf in self.buffers.items()
        }
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
        (self.buffers,) = containers

    def state_of(self, i: int) -> State:
        """Shaped like the parameter: views, except where the state lies in several pieces (a
        copy)."""
        state = {}
        for k, buf in self.buffers.items():
            parts = [buf[lo : lo + n] for lo, n in self.pieces[i]]
            state[k] = (parts[0] if len(parts) == 1 else torch.cat(parts)).view_as(self.params[i])
        return state

    def store(self, i: int, state: State) -> None:
        """Write parameter ``i``'s whole ``state`` into this rank's buffers, at its pieces."""
        at = 0
        for lo, n in self.pieces[i]:
            self._write(lo, {k: state[k].reshape(-1)[at : at + n] for k in self.buffers})
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
                buf[lo : lo + n].copy_(new_state[k])

    def own_grad(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        return grad

    def reduce(
        self, hook: Callable[..., Any], state: Any, items: Items
    ) -> tuple[Items, torch.Tensor | None]:
        """Owner-major; ``g`` is the member's averaged gradient on its owner (elsewhere it is
        not used: only owners' updates are kept); ``row`` is this rank's row, the ``g`` views
        of it."""
        flat, place = owner_major(
            [g for _, g in items], [self._owners[i] for i, _ in items], self.world_size
        )
        hook(state, flat)
        own = own_row(flat, self.world_size, self.rank_tensor)
        return [
            (i, own[at : at + g.numel()].view_as(g)) for (i, g), (_, at) in zip(items, place)
        ], own

    def norm_squares(self, items: Items) -> list[torch.Tensor]:
        rank = self.rank_tensor().reshape(())
        return [
            torch.where(rank.eq(self._owners[i]), g.float().square().sum(), 0.0) for i, g in items
        ]

    def update(self, step: BucketUpdate) -> None:
        """Given ``row`` of a bucket :meth:`plan` laid out, ``over_row`` and one step count
        among the members: each rank computes the direction over its own row only, and every
        rank applies the broadcast rows to its parameters (:meth:`_update_row`). Otherwise
        every rank computes the update of every member, keeps the state of those it owns, and
        every rank's row of new values is broadcast from that rank."""
        items, row, scalars, clip, rules, over_row, rank = step
        key = tuple(i for i, _ in items)
        self.note_stepped(key)
        if row is not None and over_row and key in self.runs and self.uniform_steps:
            self._update_row(
                key, row if clip is None else row * clip.to(row.dtype), rank, scalars, rules[0]
            )
            return
        new_values = []
        for (i, g), s, rule in zip(items, scalars.unbind(0), rules):
            p = self.params[i]
            new, new_state = update(p, clipped(g, p.dtype, clip), self.state_of(i), s, rule)
            self._write_owned(i, new_state, rank.eq(self._owners[i]).reshape(()))
            new_values.append(new.reshape(-1))
        members = [new.view_as(self.params[i]) for i, new in zip(key, new_values)]
        flat, place = owner_major(members, [self._owners[i] for i in key], self.world_size)
        self._apply_rows(key, place, own_row(flat, self.world_size, rank), lambda j, p, new: new)

    def _update_row(
        self,
        key: tuple[int, ...],
        row: torch.Tensor,
        rank: torch.Tensor,
        scalars: torch.Tensor,
        rule: Rule,
    ) -> None:
        """The update over this rank's row::

            u, new = direction(row, s[start:start+L], step)    # this rank's row only
            s[start:start+L] = where(arange(L) < this rank's row length, new, s[start:start+L])
            p <- p * decay - scale * broadcast_rows(u)[owner(p), place(p)]

        (the ``where`` only where rows differ: a shorter row's tail holds other state, see
        :func:`~.layout.lay_out_state`; ``decay`` and ``scale`` are each member's own, from its
        group's learning rate)."""
        run = self.runs[key]
        per_member = scalars.unbind(0)
        state = {k: buf[run.start : run.start + run.length] for k, buf in self.buffers.items()}
        rule_fn = direction_rule(rule)
        assert rule_fn is not None, "over_row is given only for rules with a direction"
        direction, new_state = rule_fn(
            row.to(self.params[key[0]].dtype), state, per_member[0], rule
        )
        if run.lengths is not None:
            lengths = torch.tensor(run.lengths, device=self.device).index_select(0, rank)
            mine = torch.arange(run.length, device=self.device) < lengths
            new_state = {k: torch.where(mine, t, state[k]) for k, t in new_state.items()}
        self._write(run.start, new_state)
        self._apply_rows(
            key, run.place, direction, lambda j, p, u: apply(p, u, per_member[j], rule)
        )

    def _apply_rows(
        self,
        members: tuple[int, ...],
        place: list[tuple[int, int]],
        own: torch.Tensor,
        combine: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        """Broadcast every rank's row ``own`` (owner-major) from that rank and write
        ``combine(j, param, its part of the rows)`` into each parameter of ``members`` (``j``:
        its position in the bucket)."""
        rows = broadcast_rows(own, self.group, self.world_size)
        for j, (i, (r, at)) in enumerate(zip(members, place)):
            p = self.params[i]
            p.copy_(combine(j, p, rows[r, at : at + p.numel()].view_as(p)))

    def _write_owned(self, i: int, new_state: State, owned: torch.Tensor) -> None:
        """Write parameter ``i``'s new state at its pieces where this rank owns it (``owned``, a
        0-dim bool read at run time)."""
        at = 0
        for lo, n in self.pieces[i]:
            self._write(
                lo,
                {
                    k: torch.where(owned, new_state[k].reshape(-1)[at : at + n], buf[lo : lo + n])
                    for k, buf in self.buffers.items()
                },
            )
            at += n

    def keeps(self, i: int) -> bool:
        return self._owners[i] == self.rank

    def checkpoint_state(self, i: int) -> State:
        return self.state_of(i) if self.keeps(i) else {}

    def load(self, i: int, values: State) -> None:
        """Missing names load as zeros."""
        for name, value in values.items():
            if isinstance(value, FlatShard):
                raise ValueError(
                    f"ZeroOptimizer.load_state_dict: state {name!r} of parameter {i} is another "
                    f"rank's slice ({value}); use torch.distributed.checkpoint to reshard"
                )
        if values:
            self.store(
                i,
                {
                    k: values[k] if k in values else torch.zeros_like(self.params[i])
                    for k in self.buffers
                },
            )

    def gather(self, i: int, t: torch.Tensor, to: int) -> torch.Tensor | None:
        """Point-to-point from the owner."""
        owner, here = self._owners[i], self.rank == to
        if owner == to:
            return t.clone() if here else None
        if self.rank == owner:
            dist.send(t.contiguous(), dst=dist.get_global_rank(self.group, to), group=self.group)
        elif here:
            full = torch.empty_like(t)
            dist.recv(full, src=dist.get_global_rank(self.group, owner), group=self.group)
            return full
        return None
