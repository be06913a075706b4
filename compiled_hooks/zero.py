"""ZeRO-1 for compiled (and eager) DDP: a sharded optimizer whose step runs inside the gradient
hooks, with a graph that is the same on every rank.

The eager original (``torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook`` on top of
``ZeroRedundancyOptimizer(overlap_with_ddp=True)``) learns DDP's bucket layout at run time, so
its first iterations update nothing, and it needs NCCL. Here the layout is fixed when the
optimizer is built, so parameters change from the first step, on any backend.

Rank independence. Ranks that trace different graphs issue collectives in different orders
(gloo aborts with "collective mismatch" or hangs), so nothing traced branches on the rank: the
rank is *data*, read when the graph runs by ``torch.ops.compiled_hooks.group_rank``.

Gradients are reduced in buckets (DDP's: its C++ reducer's own buckets in eager mode; in
compiled mode, gradients packed in gradient-ready order up to DDP's ``bucket_cap_mb``, the
first up to 1 MB), one ``hook`` call per bucket, so a step issues about as many collectives as
DDP plus one broadcast per rank per bucket:

- ``shard_buckets=False``: whole parameters, assigned greedily by size (largest first, ties in
  gradient-ready order) to the least-loaded rank. A bucket is laid out owner-major: row r holds
  the gradients of the members rank r owns, every row padded to the longest (the hooks close a
  full bucket where its rows are nearly equal, see :class:`ZeroStep`); each rank reads its own
  row of the averaged bucket. Where the optimizer reads the parameter only as
  ``param * decay - delta`` (AdamW; Adam and SGD without weight decay) and the bucket's rows
  are balanced, the state is laid out by the hooks' buckets (:meth:`ZeroOptimizer.plan_buckets`,
  :func:`lay_out_state`: each bucket's run of state holds this rank's row, at the same offset on
  every rank; the shorter rows' tails hold other members' state, so no memory is added), and the
  optimizer compute is sharded: each rank computes ``delta`` for its own row only, every rank's
  row of deltas is broadcast from that rank, and every rank applies them::

      g = hook(owner_major(grads))[rank]            # one all_reduce (avg) per bucket, own row read
      d, s[run] = delta(g, s[run], step)            # this rank's row only (its length: where)
      p <- p * decay - cat(broadcast(d, src=r) for r)[owner(p), place(p)]

  Otherwise (Adam's or SGD's weight decay adds ``wd * param`` to the gradient; an unbalanced
  bucket; buckets of eager DDP's C++ reducer) every rank computes the update of every member
  from its row (right on the member's owner; elsewhere thrown away: the state, at the same
  offset on every rank in its owner's buffer, is kept only where ``owner == rank``, a
  ``torch.where`` on the rank), and every rank's own row of *new values* is broadcast.
  Reading only the own row lets ``passes`` reduce just that row: ``all_to_all_weight_update``
  (gloo) and ``shard_weight_update`` (NCCL) turn the all_reduce + broadcasts into an exchange
  that moves the bytes of one all_reduce.
- ``shard_buckets=True``: every parameter is split evenly (flat, padded to a multiple of N);
  the bucket is reduced rank-major (this rank's slice of the bucket holds its slice of every
  member), each rank updates its slices (selected with ``group_rank``) and the bucket's slices
  are broadcast from every rank and concatenated, rewritten by the same passes.

In both layouts the averaged gradient is not written back: in compiled DDP ``param.grad`` keeps
this rank's local gradient.

Both schedules of the original: :func:`hook_with_zero_step` updates after the last gradient
(python reducer: a final autograd callback; C++ reducer: the last bucket), and
:func:`hook_with_zero_step_interleaved` updates each bucket as soon as its gradients are
reduced. ``passes.interleave_zero_broadcasts`` schedules the compiled graph accordingly.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fcol
import torch.nn.functional as F
from torch.autograd import Variable
from torch.nn.parallel import DistributedDataParallel

from .ddp import completed, reduce_buffer
from .ops import group_rank
from .optim_math import UPDATES, delta_rule, hyperparameters, state_names, step_scalars
from .validation import positional_arity

__all__ = ["ZeroOptimizer", "ZeroStep", "hook_with_zero_step", "hook_with_zero_step_interleaved"]

# Whole parameters: how far a bucket's longest owner row may exceed an equal share (see ZeroStep)
BALANCE_SLACK = 0.05


def rows_balanced(longest: int, total: int, world_size: int) -> bool:
    """Whether owner rows of ``total`` elements (or bytes), the longest ``longest``, are within
    ``BALANCE_SLACK`` of equal."""
    return world_size * longest <= (1 + BALANCE_SLACK) * total


def assign_whole_parameters(numels: list[int], world_size: int) -> tuple[list[int], list[int], list[int]]:
    """(owner, offset, load per rank) for parameters of ``numels`` given in gradient-ready
    order: largest first (stable), each to the least-loaded rank (lowest rank on ties); within
    its owner's state buffer a parameter's offset follows gradient-ready order, so the
    parameters one rank owns in a bucket sit side by side."""
    owner, load = [0] * len(numels), [0] * world_size
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        r = min(range(world_size), key=lambda r: load[r])
        owner[i] = r
        load[r] += numels[i]
    offset, end = [0] * len(numels), [0] * world_size
    for i, r in enumerate(owner):
        offset[i], end[r] = end[r], end[r] + numels[i]
    return owner, offset, load


def owner_rows(numels: list[int], owners: list[int], world_size: int) -> tuple[list[tuple[int, int]], list[int]]:
    """A bucket of members of ``numels`` owned by ``owners``, laid out owner-major (row r: the
    members rank r owns, in bucket order): each member's (row, offset in the row), and each
    row's length."""
    place, used = [], [0] * world_size
    for numel, r in zip(numels, owners):
        place.append((r, used[r]))
        used[r] += numel
    return place, used


Piece = tuple[int, int]  # (offset in a rank's state buffers, elements)


def lay_out_state(numels: list[int], owner: list[int], buckets: list[list[int]], world_size: int
                  ) -> tuple[dict[tuple[int, ...], tuple[int, int, list[tuple[int, int]], list[int]]], list[list[Piece]], int]:
    """Whole parameters: where each rank keeps the optimizer state of the parameters it owns,
    given the buckets the ZeRO hooks reduce (each in its owner-major order, see
    :meth:`ZeroOptimizer.reduce_bucket`). The same on every rank. Returns ``(runs, pieces, size)``:

    - ``runs``: a bucket whose owner rows are within ``BALANCE_SLACK`` of equal gets a run
      ``(start, L, places, row lengths)`` (:func:`owner_rows`), ``L`` its longest row: elements ``start .. start + L`` of
      every rank's buffers, holding that rank's row from ``start`` (each member at its place in
      the owner-major row), so the sharded update reads and writes one slice at an offset the
      same on every rank. The shorter rows' tails are free.
    - ``pieces[i]``: where parameter ``i``'s state lies in its owner's buffers, in order. A
      planned bucket's member is one piece in its run; the others' members fill their owner's
      free tails, then follow the runs, split where a tail ends.
    - ``size``: the buffers' length, ``max(loads)`` as with no runs at all: runs are planned only
      while their lengths sum to at most that (the most padded dropped first), and then every
      rank's state fits. So the layout costs no state memory::

          rank 0: [ b0 row 0 ........ | b1 row 0 .. p p | b2 row 0 ...... | p ]
          rank 1: [ b0 row 1 ..... q q | b1 row 1 ....... | b2 row 1 .. q q | q q ]
                    (p, q: rank 0's and rank 1's members of unbalanced buckets)
    """
    load = [0] * world_size
    for i, r in enumerate(owner):
        load[r] += numels[i]
    runs = []  # (members, places, row lengths)
    for members in buckets:
        place, used = owner_rows([numels[i] for i in members], [owner[i] for i in members], world_size)
        if rows_balanced(max(used), sum(used), world_size):
            runs.append((members, place, used))
    while sum(max(used) for *_, used in runs) > max(load):
        runs.remove(max(runs, key=lambda run: world_size * max(run[2]) - sum(run[2])))
    planned, pieces, start = {}, [[] for _ in numels], 0
    free = [[] for _ in range(world_size)]  # per rank: (lo, hi) intervals, in order
    for members, place, used in runs:
        for i, (_, at) in zip(members, place):
            pieces[i] = [(start + at, numels[i])]
        length = max(used)
        for r in range(world_size):
            free[r].append((start + used[r], start + length))
        planned[tuple(members)] = (start, length, place, used)
        start += length
    for r in range(world_size):
        free[r].append((start, start + sum(numels)))
    in_runs = {i for key in planned for i in key}
    for members in buckets:
        for i in members:
            if i in in_runs:
                continue
            need, holes = numels[i], free[owner[i]]
            while need:
                lo, hi = holes[0]
                n = min(need, hi - lo)
                if n:
                    pieces[i].append((lo, n))
                need -= n
                holes[0] = (lo + n, hi)
                if lo + n == hi:
                    holes.pop(0)
            if not pieces[i]:  # an empty parameter
                pieces[i] = [(0, 0)]
    size = max([start] + [lo + n for ps in pieces for lo, n in ps])
    return planned, pieces, size


class ZeroOptimizer:
    """ZeRO-1: each rank keeps optimizer state only for what it owns; after :meth:`step` (or
    the ZeRO hooks) every rank holds identical parameters.

    Args:
        params: one iterable of parameters (several parameter groups are not supported), all
            requiring grad, in the order DDP registers them (its gradient-ready order is the
            reverse).
        optimizer_class: ``torch.optim.SGD`` (with or without momentum), ``Adam`` or ``AdamW``.
        process_group: the group to shard over (default: the default group).
        shard_buckets: split every parameter evenly across ranks instead of assigning whole
            parameters (see the module docstring).
        **defaults: the optimizer's hyperparameters (validated by ``optimizer_class``).
    """

    def __init__(self, params: Iterable[torch.Tensor], optimizer_class: type,
                 process_group: dist.ProcessGroup | None = None, shard_buckets: bool = False, **defaults: Any):
        params = list(params)
        if not params:
            raise ValueError("ZeroOptimizer: got an empty parameter list")
        if any(isinstance(p, dict) for p in params):
            raise ValueError("ZeroOptimizer: several parameter groups are not supported; pass one iterable of parameters")
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"ZeroOptimizer: parameter {i} is a {type(p).__name__}, not a tensor")
            if not p.requires_grad:
                raise ValueError(f"ZeroOptimizer: parameter {i} (shape {tuple(p.shape)}) does not require grad; "
                                 "leave it out of the optimizer")
            if not p.is_floating_point():
                raise TypeError(f"ZeroOptimizer: parameter {i} has dtype {p.dtype}; only floating point is supported")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("ZeroOptimizer: a parameter appears more than once")
        if len({(p.dtype, p.device) for p in params}) != 1:
            raise TypeError("ZeroOptimizer: all parameters must share one dtype and device (buckets are flat), got "
                            f"{sorted({(str(p.dtype), str(p.device)) for p in params})}")
        self.optimizer_class = optimizer_class
        self.hp = hyperparameters(optimizer_class, defaults)
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self.shard_buckets = shard_buckets
        self.params = params
        self._index = {id(p): i for i, p in enumerate(params)}
        device = params[0].device
        self._group_name = self.process_group.group_name
        self._device = device
        self._steps = torch.zeros(len(params), dtype=torch.float64, device=device)
        names = state_names(optimizer_class, self.hp)
        n = self.world_size
        if shard_buckets:
            self._chunks = [math.ceil(p.numel() / n) for p in params]
            self._state = [{k: torch.zeros(c, dtype=p.dtype, device=device) for k in names}
                           for p, c in zip(params, self._chunks)]
        else:
            ready = list(reversed(range(len(params))))
            owner, offset, load = assign_whole_parameters([params[i].numel() for i in ready], n)
            self.owner = [0] * len(params)
            self._pieces: list[list[Piece]] = [[] for _ in params]  # see lay_out_state
            for j, i in enumerate(ready):
                self.owner[i], self._pieces[i] = owner[j], [(offset[j], params[i].numel())]
            self._buffers = {k: torch.zeros(max(load), dtype=params[0].dtype, device=device) for k in names}
        # whole parameters, after plan_buckets: bucket members -> (state offset, row length,
        # places, the row lengths by rank where they differ)
        self._rows: dict[tuple[int, ...], tuple[int, int, list[tuple[int, int]], Optional[list[int]]]] = {}
        self._bucket_of: dict[int, tuple[int, ...]] = {}
        self._buckets: list[list[int]] = []  # the hooks' buckets, as plan_buckets got them
        self._uniform_steps = True  # every planned bucket's members have one step count

    # -- the step --------------------------------------------------------------------------
    def index_of(self, param: torch.Tensor) -> int:
        try:
            return self._index[id(param)]
        except KeyError:
            raise ValueError(f"ZeroOptimizer: a parameter of shape {tuple(param.shape)} is not in this optimizer") from None

    def _state_views(self, i: int) -> dict[str, torch.Tensor]:
        """Parameter ``i``'s state in this rank's buffers, shaped like it: views, except for
        whole parameters whose state lies in several pieces (a copy)."""
        p = self.params[i]
        if self.shard_buckets:
            return self._state[i]
        state = {}
        for k, buf in self._buffers.items():
            parts = [buf[lo:lo + n] for lo, n in self._pieces[i]]
            state[k] = (parts[0] if len(parts) == 1 else torch.cat(parts)).view_as(p)
        return state

    def _store(self, i: int, state: dict[str, torch.Tensor]) -> None:
        """Write parameter ``i``'s ``state`` into this rank's buffers, at its pieces."""
        at = 0
        for lo, n in self._pieces[i]:
            self._write_state(lo, {k: state[k].reshape(-1)[at:at + n] for k in self._buffers})
            at += n

    def _rank(self) -> torch.Tensor:
        return group_rank(self._group_name, self._device)

    def _own_row(self, flat: torch.Tensor, rank: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Row ``rank`` (default: this rank, read at run time) of a bucket ``flat`` of
        ``world_size`` equal rows: the read ``passes`` recognize as "this rank's row"
        (``shard_weight_update``, ``all_to_all_weight_update``)."""
        rows = flat.view(self.world_size, flat.numel() // self.world_size)
        return rows.index_select(0, self._rank() if rank is None else rank).view(-1)

    def _own_slices(self, items: list[tuple[int, torch.Tensor]], flat: torch.Tensor) -> list[torch.Tensor]:
        """This rank's slice of every member of a rank-major bucket ``flat`` (see :meth:`reduce_bucket`)."""
        return list(self._own_row(flat).split([self._chunks[i] for i, _ in items]))

    def _own_slice(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``t``, shaped like parameter ``i`` (``shard_buckets``)."""
        return self._own_slices([(i, t)], self._rank_major([(i, t)]))[0]

    def _rank_major(self, items: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        n = self.world_size
        parts = [F.pad(t.reshape(-1), (0, n * self._chunks[i] - t.numel())).view(n, -1) for i, t in items]
        return torch.cat(parts, dim=1).reshape(-1)

    def _owner_rows(self, items: list[tuple[int, torch.Tensor]]) -> tuple[list[tuple[int, int]], int]:
        """Whole parameters, a bucket laid out owner-major (row r: the members rank r owns, in
        bucket order, padded to the longest row): each member's (row, offset in the row), and
        the row length. The same on every rank."""
        place, used = owner_rows([t.numel() for _, t in items], [self.owner[i] for i, _ in items], self.world_size)
        return place, max(used)

    def _owner_major(self, items: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Whole parameters: ``items``' tensors flat, owner-major (``[world_size * L]``), and
        each one's (row, offset in the row)."""
        place, length = self._owner_rows(items)
        parts = []
        for r in range(self.world_size):
            row = [t.reshape(-1) for (i, t), (owner, _) in zip(items, place) if owner == r]
            pad = length - sum(t.numel() for t in row)
            parts += row + ([items[0][1].new_zeros(pad)] if pad else [])
        return torch.cat(parts), place

    @torch.no_grad()
    def plan_buckets(self, buckets: list[list[int]]) -> None:
        """Whole parameters: lay the state out by the buckets the ZeRO hooks will reduce
        (:meth:`ZeroStep.plan`; :func:`lay_out_state`): a bucket whose owner rows are nearly
        equal gets a run of state holding this rank's row at an offset the same on every rank,
        so its update reads and writes one slice and runs over this rank's row alone
        (:meth:`update_bucket`); the other members fill the shorter rows' tails. The buffers
        keep their size. This rank's state moves along."""
        if self.shard_buckets:
            return
        if sorted(i for b in buckets for i in b) != list(range(len(self.params))):
            raise ValueError(f"ZeroOptimizer.plan_buckets: the buckets must hold every parameter once, got {buckets}")
        runs, pieces, size = lay_out_state([p.numel() for p in self.params], self.owner, buckets, self.world_size)
        owned = {i: self._state_views(i) for i in range(len(self.params)) if self.owner[i] == self.rank}
        self._buffers = {k: torch.zeros(size, dtype=buf.dtype, device=buf.device) for k, buf in self._buffers.items()}
        self._pieces = pieces
        for i, state in owned.items():
            self._store(i, state)
        self._buckets = [list(b) for b in buckets]
        self._rows = {}
        for key, (start, length, place, used) in runs.items():
            self._rows[key] = (start, length, place, used if len(set(used)) > 1 else None)
        self._bucket_of = {i: key for key in self._rows for i in key}
        self._uniform_steps = self._steps_uniform()

    def _steps_uniform(self) -> bool:
        steps = self._steps.tolist()
        return all(len({steps[i] for i in key}) == 1 for key in self._rows)

    def reduce_bucket(self, hook: Callable[..., Any], state: Any, items: list[tuple[int, torch.Tensor]]):
        """Average a bucket of gradients ``[(i, grad)]`` with one ``hook(state, flat)`` call and
        return ``([(i, g)], row)`` as :meth:`update_bucket` takes them, read from this rank's row of
        the bucket only, so that ``passes`` may reduce just that row (``shard_weight_update``,
        ``all_to_all_weight_update``); ``grad`` keeps this rank's local gradient.

        Whole parameters: the bucket is laid out owner-major (row r holds the members rank r
        owns, padded to the longest row); ``g`` is the member's averaged gradient on its owner
        (elsewhere it is not used: only owners' updates are kept). ``shard_buckets``: laid out
        rank-major, every member padded to ``world_size`` equal slices, so a rank's row holds
        its slice of every member; ``g`` is this rank's slice. ``row``: whole parameters, this
        rank's row of the averaged bucket (the ``g`` are views of it); ``None`` with
        ``shard_buckets``."""
        if self.shard_buckets:
            flat = self._rank_major(items)
            hook(state, flat)
            return list(zip((i for i, _ in items), self._own_slices(items, flat))), None
        flat, place = self._owner_major(items)
        hook(state, flat)
        own = self._own_row(flat)
        return [(i, own[at:at + g.numel()].view_as(g)) for (i, g), (_, at) in zip(items, place)], own

    @torch.no_grad()
    def update_bucket(self, items: list[tuple[int, torch.Tensor]], row: Optional[torch.Tensor] = None) -> None:
        """Apply the optimizer to a bucket of parameters ``[(i, averaged grad)]`` (with
        ``shard_buckets``, this rank's slices, as :meth:`reduce_bucket` gives them; whole
        parameters: the gradient need only be right on the parameter's owner) and make the
        results identical on every rank: every rank's row of new values (owner-major for whole
        parameters, rank-major with ``shard_buckets``) broadcast from that rank. Traceable; the
        same graph on every rank.

        Whole parameters, given ``row`` (this rank's row of a bucket laid out by
        :meth:`plan_buckets`), where the optimizer reads the parameter only through
        ``param * decay - delta`` (:func:`~compiled_hooks.optim_math.delta_rule`: AdamW, Adam
        and SGD without weight decay) and the bucket's members share one step count: each rank
        computes ``delta`` over its own row only, and every rank applies the broadcast rows to
        its parameters. Otherwise every rank computes the update of every member and keeps the
        state of those it owns."""
        rule, rank = UPDATES[self.optimizer_class], self._rank()
        index = torch.tensor([i for i, _ in items], device=self._device)
        steps = self._steps[index] + 1
        self._steps.index_put_((index,), steps)
        scalars = step_scalars(self.hp, steps)  # once per bucket: see step_scalars
        key = tuple(i for i, _ in items)
        delta = delta_rule(self.optimizer_class, self.hp)
        self._note_stepped(key)
        if row is not None and delta is not None and key in self._rows and self._uniform_steps:
            self._update_own_row(key, row, rank, scalars[0], *delta)
            return
        new_values = []
        for (i, g), step in zip(items, scalars.unbind(0)):
            p = self.params[i]
            if self.shard_buckets:
                p = self._own_slice(i, p.detach())
            state = self._state_views(i)
            new, new_state = rule(p, g.to(p.dtype), state, step, self.hp)
            if self.shard_buckets:
                for k, t in state.items():
                    t.copy_(new_state[k])
            else:
                self._write_owned_state(i, new_state, (rank == self.owner[i]).reshape(()))
            new_values.append(new.reshape(-1))
        if self.shard_buckets:
            flat = torch.cat(new_values)
            gathered = torch.cat([fcol.broadcast(flat, src, self.process_group) for src in range(self.world_size)])
            gathered = gathered.view(self.world_size, -1)
            offset = 0
            for (i, _), new in zip(items, new_values):
                p = self.params[i]
                p.copy_(gathered[:, offset:offset + new.numel()].reshape(-1)[: p.numel()].view_as(p))
                offset += new.numel()
            return
        # every rank's row of new values, from that rank (owner-major, as reduce_bucket)
        members = [(i, new.view_as(self.params[i])) for (i, _), new in zip(items, new_values)]
        flat, place = self._owner_major(members)
        own = self._own_row(flat, rank)
        self._apply_rows(key, place, own, lambda p, new: new)

    def _update_own_row(self, key: tuple[int, ...], row: torch.Tensor, rank: torch.Tensor, step: torch.Tensor,
                        decay: float, delta: Callable[..., Any]) -> None:
        """The sharded update of a planned bucket (see :meth:`update_bucket`)::

            d, new = delta(row, s[start:start+L], step)    # this rank's row only
            s[start:start+L] = where(arange(L) < this rank's row length, new, s[start:start+L])
            p <- p * decay - cat(broadcast(d, src=r) for r)[owner(p), place(p)]

        (the ``where`` only where rows differ: a shorter row's tail holds other state, see
        :func:`lay_out_state`)."""
        start, length, place, lengths = self._rows[key]
        dtype = self.params[key[0]].dtype
        state = {k: buf[start:start + length] for k, buf in self._buffers.items()}
        d, new_state = delta(row.to(dtype), state, step, self.hp)
        if lengths is not None:
            lengths = torch.tensor(lengths, device=self._device).index_select(0, rank)
            mine = torch.arange(length, device=self._device) < lengths
            new_state = {k: torch.where(mine, t, state[k]) for k, t in new_state.items()}
        self._write_state(start, new_state)
        self._apply_rows(key, place, d, lambda p, new: p * decay - new if decay != 1 else p - new)

    def _apply_rows(self, members: tuple[int, ...], place: list[tuple[int, int]], own: torch.Tensor,
                    combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Broadcast every rank's row ``own`` (owner-major, see :meth:`reduce_bucket`) from that
        rank and write ``combine(param, its part of the rows)`` into each parameter of ``members``."""
        rows = torch.cat([fcol.broadcast(own, src, self.process_group) for src in range(self.world_size)])
        rows = rows.view(self.world_size, -1)
        for i, (r, at) in zip(members, place):
            p = self.params[i]
            p.copy_(combine(p, rows[r, at:at + p.numel()].view_as(p)))

    def _note_stepped(self, key: tuple[int, ...]) -> None:
        """Whole parameters: the planned buckets' members keep one step count each as long as
        every update covers whole planned buckets; an update of part of one ends that (the
        sharded update then stays off, until :meth:`load_state_dict` or :meth:`plan_buckets`
        finds the counts equal again)."""
        if key in self._rows or not self._rows or not self._uniform_steps:
            return
        buckets = {self._bucket_of[i] for i in key if i in self._bucket_of}
        if sum(len(b) for b in buckets) != len({i for i in key if i in self._bucket_of}):
            self._uniform_steps = False

    def _write_state(self, lo: int, new_state: dict[str, torch.Tensor]) -> None:
        """Whole parameters: write ``new_state`` (flat, one per state buffer) into the buffers
        at ``lo``.

        Traced (``torch.compiler.is_compiling()``), an ``index_put_`` rather than
        ``buf[lo:hi].copy_``: a traced slice write becomes a ``slice_scatter`` of the whole
        buffer, and Inductor fuses a bucket's chain of them into kernels that each loop over the
        whole buffer, while an ``index_put`` it turns back into an in-place write of the slice
        (its index an ``arange`` computed in the kernel, never stored). Eager, the slice write:
        there an ``index_put_`` materializes the index and scatters, several times slower."""
        if not new_state:  # SGD without momentum keeps no state
            return
        n = next(iter(new_state.values())).numel()
        traced = torch.compiler.is_compiling()
        index = (torch.arange(lo, lo + n, device=self._device),) if traced else None
        for k, buf in self._buffers.items():
            if traced:
                buf.index_put_(index, new_state[k])
            else:
                buf[lo:lo + n].copy_(new_state[k])

    def _write_owned_state(self, i: int, new_state: dict[str, torch.Tensor], owned: torch.Tensor) -> None:
        """Whole parameters: write parameter ``i``'s new state into this rank's flat buffers, at
        its pieces, where the rank owns it (``owned``, a 0-dim bool read at run time)."""
        at = 0
        for lo, n in self._pieces[i]:
            self._write_state(lo, {k: torch.where(owned, new_state[k].reshape(-1)[at:at + n], buf[lo:lo + n])
                                   for k, buf in self._buffers.items()})
            at += n

    def update(self, i: int, grad: torch.Tensor) -> None:
        """:meth:`update_bucket` of the one parameter ``i`` with its averaged gradient."""
        p = self.params[i]
        if grad.shape != p.shape:
            raise ValueError(f"ZeroOptimizer: gradient of shape {tuple(grad.shape)} for parameter {i} of shape {tuple(p.shape)}")
        if self.shard_buckets:
            grad = self._own_slice(i, grad)
        self.update_bucket([(i, grad)])

    def step(self) -> None:
        """Update every parameter that has a gradient, from ``param.grad`` as it is (average the
        gradients first, e.g. with DDP). Without the ZeRO hooks this is the whole step."""
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self.update(i, p.grad)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # -- accounting and checkpoints --------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (per-element state and step counts)."""
        tensors = [t for s in self._state for t in s.values()] if self.shard_buckets else list(self._buffers.values())
        return sum(t.numel() * t.element_size() for t in tensors) + self._steps.numel() * self._steps.element_size()

    def state_dict(self) -> dict[str, Any]:
        """The full state in ``torch.optim`` format (loadable by ``optimizer_class``), on every
        rank. Collective: every rank of the group must call it."""
        state: dict[int, dict[str, torch.Tensor]] = {}
        for i, p in enumerate(self.params):
            views = self._state_views(i)
            full = {}
            for k, t in views.items():
                if self.shard_buckets:
                    out = torch.empty(self.world_size * t.numel(), dtype=t.dtype, device=t.device)
                    dist.all_gather_into_tensor(out, t.contiguous(), group=self.process_group)
                    full[k] = out[: p.numel()].view_as(p).clone()
                else:
                    full[k] = t.clone()
                    dist.broadcast(full[k], dist.get_global_rank(self.process_group, self.owner[i]),
                                   group=self.process_group)
            step = float(self._steps[i])
            if step == 0:
                continue
            if self.optimizer_class is not torch.optim.SGD:
                full["step"] = torch.tensor(step, dtype=torch.float32)
            state[i] = full
        return {"state": state, "param_groups": [{**self.hp, "params": list(range(len(self.params)))}]}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (or a ``torch.optim`` state dict of the same
        parameters, one group); each rank keeps its part."""
        groups = state_dict.get("param_groups", [])
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.params):
            raise ValueError(f"ZeroOptimizer.load_state_dict: expected one parameter group of {len(self.params)} "
                             f"parameters, got {[len(g['params']) for g in groups]}")
        position = {pid: i for i, pid in enumerate(groups[0]["params"])}
        self.hp.update({k: v for k, v in groups[0].items() if k in self.hp})
        self._steps.zero_()
        for buf in (t for s in self._state for t in s.values()) if self.shard_buckets else self._buffers.values():
            buf.zero_()
        for pid, saved in state_dict["state"].items():
            i = position[pid]
            p = self.params[i]
            self._steps[i] = float(saved["step"]) if "step" in saved else 1.0
            full = {}
            for k, t in self._state_views(i).items():
                full[k] = saved[k].to(device=t.device, dtype=t.dtype)
                if full[k].shape != p.shape:
                    raise ValueError(f"ZeroOptimizer.load_state_dict: state {k!r} of parameter {i} has shape "
                                     f"{tuple(full[k].shape)}, expected {tuple(p.shape)}")
                if self.shard_buckets:
                    t.copy_(self._own_slice(i, full[k]))
            if not self.shard_buckets and self.owner[i] == self.rank:
                self._store(i, full)
        self._uniform_steps = self._steps_uniform()


# -- the hooks -----------------------------------------------------------------------------

class ZeroStep:
    """The DDP-independent core of the ZeRO hooks. Buckets are planned when it is built
    (:meth:`plan`): parameters in reverse order (DDP's guess at gradient-ready order) packed up
    to ``bucket_bytes`` (the first up to ``first_bucket_bytes``, as DDP does). Gradients arrive
    one by one (:meth:`add`); a planned bucket closes once all its members have arrived (and the
    buckets before it have closed), so a gradient that comes a little out of the guessed order
    delays its bucket instead of changing it. A closed bucket is averaged with one ``hook``
    call, then updated and broadcast at once (``interleaved``) or after the last one
    (:meth:`finish`, which also closes what is left of buckets whose members did not all
    arrive). Buckets depend only on sizes, owners and the plan, so every rank makes the same ones.

    With whole parameters a bucket is exchanged as rows of equal length, one per owner (see
    :meth:`ZeroOptimizer.reduce_bucket`), so the shorter rows' padding goes on the wire too. A
    full bucket therefore closes only where its rows are within ``BALANCE_SLACK`` of equal, or
    once it holds twice its cap (on the benchmark's transformer with 4 MB caps: 0.9% padding
    instead of 17%; ownership stays as assigned). The optimizer's state is laid out by the
    planned buckets (:meth:`ZeroOptimizer.plan_buckets`)."""

    def __init__(self, hook: Callable[..., Any], zero: ZeroOptimizer, interleaved: bool,
                 bucket_bytes: int = 25 * 1024 * 1024, first_bucket_bytes: int = 1024 * 1024):
        self.hook, self.zero, self.interleaved = hook, zero, interleaved
        self.caps = (first_bucket_bytes, bucket_bytes)
        self.planned = self.plan()
        self.bucket_of = {i: b for b, members in enumerate(self.planned) for i in members}
        self.arrived: dict[int, torch.Tensor] = {}  # this backward's gradients not yet in a closed bucket
        self.missing = [len(members) for members in self.planned]  # per planned bucket, in this backward
        self.next = 0  # the first planned bucket not closed in this backward
        self.reduced: list[tuple[list, Optional[torch.Tensor]]] = []  # buckets waiting for their update
        self.started = False  # a backward is in progress (the final callback is queued)
        zero.plan_buckets(self.planned)

    def plan(self) -> list[list[int]]:
        """The buckets, each in the order its members are laid out: parameters in reverse order,
        a bucket closed where it holds its cap and its owner rows balance (see above)."""
        zero, buckets, current = self.zero, [], []
        rows = [0] * zero.world_size  # bytes per owner (shard_buckets: all in rows[0])
        for i in reversed(range(len(zero.params))):
            current.append(i)
            p = zero.params[i]
            if zero.shard_buckets:
                rows[0] += zero.world_size * zero._chunks[i] * p.element_size()
            else:
                rows[zero.owner[i]] += p.numel() * p.element_size()
            size, cap = sum(rows), self.caps[min(len(buckets), 1)]
            balanced = zero.shard_buckets or rows_balanced(max(rows), size, zero.world_size)
            if size >= cap and (balanced or size >= 2 * cap):
                buckets.append(current)
                current, rows = [], [0] * zero.world_size
        return buckets + ([current] if current else [])

    def add(self, state: Any, i: int, grad: torch.Tensor) -> None:
        self.arrived[i] = grad
        self.missing[self.bucket_of[i]] -= 1
        while self.next < len(self.planned) and self.missing[self.next] == 0:
            self.next += 1
            self.close(state, [(j, self.arrived.pop(j)) for j in self.planned[self.next - 1]])

    def close(self, state: Any, items: list[tuple[int, torch.Tensor]], averaged: bool = False) -> None:
        """Reduce the bucket ``items`` (``averaged``: whole gradients that were already
        averaged) and update it now (interleaved) or keep it for :meth:`finish`."""
        if not items:
            return
        row = None
        if not averaged:
            items, row = self.zero.reduce_bucket(self.hook, state, items)
        if self.interleaved:
            self.zero.update_bucket(items, row)
        else:
            self.reduced.append((items, row))

    def finish(self, state: Any) -> None:
        """End of backward: reduce what arrived of the buckets still open, then run the updates
        still waiting."""
        for members in self.planned[self.next:]:
            self.close(state, [(j, self.arrived.pop(j)) for j in members if j in self.arrived])
        for items, row in self.reduced:
            self.zero.update_bucket(items, row)
        self.reduced, self.arrived, self.next, self.started = [], {}, 0, False
        self.missing = [len(members) for members in self.planned]


def _hook_kind(name: str, hook: Any, python_reducer: bool, shard_buckets: bool) -> tuple[Callable[..., Any], bool]:
    """``(hook, runs_on_buckets)``: what the ZeRO hook calls to average gradients. Accepted:
    a ``hook(state, grad)`` of this package (or the one inside a :func:`ddp_comm_hook`
    wrapper), and, in eager DDP (C++ reducer) without ``shard_buckets``, a DDP comm hook
    ``hook(process_group, bucket: GradBucket) -> Future`` such as torch's ``allreduce_hook`` or
    ``fp16_compress_hook``, run on DDP's own bucket. Anything else is a ``TypeError``."""
    label = getattr(hook, "__qualname__", getattr(hook, "__name__", repr(hook)))
    hook = getattr(hook, "tensor_hook", hook)  # ddp_comm_hook(h): ZeRO reduces its own buckets with h
    if not callable(hook):
        raise TypeError(f"{name}: hook must be callable, got {type(hook).__name__}")
    params = [p for p in inspect.signature(hook).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if "param" in inspect.signature(hook).parameters:
        raise TypeError(f"{name}: {label} keeps state per parameter (e.g. PowerSGD), but ZeRO averages whole buckets "
                        "of gradients at once; use allreduce_hook, fp16_compress_hook or bf16_compress_hook")
    if len(params) >= 2 and params[1].name == "bucket":  # a DDP comm hook: GradBucket in, Future out
        if python_reducer:
            raise TypeError(f"{name}: {label} is a DDP comm hook (GradBucket in, Future out), which only eager DDP's "
                            "C++ reducer can run; for compiled DDP pass compiled_hooks' allreduce_hook, "
                            "fp16_compress_hook or bf16_compress_hook")
        if shard_buckets:
            raise TypeError(f"{name}: {label} is a DDP comm hook, which runs on DDP's own bucket; with "
                            "shard_buckets=True the gradients are laid out rank-major in buckets of ZeRO's own, so "
                            "pass compiled_hooks' allreduce_hook, fp16_compress_hook or bf16_compress_hook")
        return hook, True
    if positional_arity(hook)[0] != 2:
        raise TypeError(f"{name}: hook must be callable as hook(state, grad) (allreduce_hook, fp16_compress_hook, "
                        f"bf16_compress_hook) or be a DDP comm hook hook(state, bucket), got {label!r}")
    return hook, False


def _hook_with_zero(hook: Callable[..., Any], ddp: DistributedDataParallel, zero: ZeroOptimizer,
                    shard_buckets: bool, interleaved: bool, name: str) -> Callable[[Any, Any], Any]:
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"{name}: ddp must be a DistributedDataParallel, got {type(ddp).__name__}")
    if not isinstance(zero, ZeroOptimizer):
        raise TypeError(f"{name}: zero must be a compiled_hooks.zero.ZeroOptimizer, got {type(zero).__name__}")
    if shard_buckets != zero.shard_buckets:
        raise ValueError(f"{name}: shard_buckets={shard_buckets} but the ZeroOptimizer was built with "
                         f"shard_buckets={zero.shard_buckets}; build both the same way")
    trained = [p for p in ddp.module.parameters() if p.requires_grad]
    if {id(p) for p in trained} != {id(p) for p in zero.params}:
        raise ValueError(f"{name}: the ZeroOptimizer must hold exactly the DDP module's parameters that require grad "
                         f"({len(trained)} of them), got {len(zero.params)}")
    if ddp.process_group.size() != zero.world_size:
        raise ValueError(f"{name}: DDP's group has {ddp.process_group.size()} ranks, the ZeroOptimizer's {zero.world_size}")
    if torch._dynamo.config.optimize_ddp == "python_reducer" and not ddp._use_python_reducer:
        raise ValueError(f"{name}: this DDP was built before torch._dynamo.config.optimize_ddp = 'python_reducer' was "
                         "set, so compiled autograd cannot trace its hooks; build it with compile_ddp or after "
                         "setting the flag")
    hook, on_buckets = _hook_kind(name, hook, ddp._use_python_reducer, shard_buckets)
    reducing: list[tuple[torch.futures.Future[torch.Tensor], torch.Tensor, list]] = []  # C++ reducer, in order
    config = getattr(ddp, "_bucket_config", None)
    core = ZeroStep(hook, zero, interleaved, bucket_bytes=ddp.bucket_bytes_cap,
                    first_bucket_bytes=getattr(config, "first_bucket_bytes_cap", ddp.bucket_bytes_cap))

    def zero_hook(state, bucket):
        if isinstance(bucket, tuple):  # python reducer: (param.grad, param), once per parameter
            grad, param = bucket
            if not core.started:  # flush the last bucket (and, after backward, update) at the end
                core.started = True
                Variable._execution_engine.queue_callback(functools.partial(core.finish, state))
            core.add(state, zero.index_of(param), grad)
            return None
        # C++ reducer: DDP's bucket is ours; its buffer holds the flat gradients
        buffer, params = bucket.buffer(), bucket.parameters()
        views = list(buffer.split([p.numel() for p in params]))
        items = [(zero.index_of(p), v.view_as(p)) for p, v in zip(params, views)]
        if zero.shard_buckets:  # reduced rank-major in ZeRO's own layout, here and now
            core.close(state, items)
            fut = completed(buffer)
        else:
            # a DDP comm hook runs on DDP's own bucket
            fut = hook(state, bucket) if on_buckets else reduce_buffer(hook, state, buffer)
            if bucket.index() == 0:
                reducing.clear()  # what a backward that did not finish left
            reducing.append((fut, buffer, items))
            # The updates issue broadcasts, so they run here, in the main thread, where every
            # rank issues collectives in the same order: interleaved, a bucket's when the next
            # bucket has been handed over; otherwise all of them after the last bucket.
            keep = 0 if bucket.is_last() else 1 if interleaved else len(reducing)
            while len(reducing) > keep:
                done, done_buffer, done_items = reducing.pop(0)
                averaged = done.wait()
                if averaged is not done_buffer:
                    done_buffer.copy_(averaged)
                core.close(state, done_items, averaged=True)
        if bucket.is_last():
            core.finish(state)
        return fut

    zero_hook.__name__ = f"{name}_{getattr(hook, '__name__', 'hook')}"
    zero_hook.__qualname__ = zero_hook.__name__
    return zero_hook


def hook_with_zero_step(hook: Callable[..., Any], ddp: DistributedDataParallel, zero: ZeroOptimizer,
                        shard_buckets: bool = False) -> Callable[[Any, Any], Any]:
    """A DDP comm hook (register it with ``ddp.register_comm_hook(state, ...)``) that averages
    gradients with ``hook(state, grad)`` and runs ``zero``'s step after the last gradient is
    reduced, overlapping the outstanding gradient collectives. Works with compiled DDP (python
    reducer + :func:`compiled_hooks.compiled_autograd`: backward, step and broadcasts in one
    graph) and with eager DDP, on any backend, updating parameters from the first step.
    ``shard_buckets`` must match the ``ZeroOptimizer``'s.

    ``hook``: this package's ``allreduce_hook`` / ``fp16_compress_hook`` /
    ``bf16_compress_hook`` (``state`` is their state), the same wrapped by
    :func:`compiled_hooks.ddp_comm_hook`, or, in eager DDP without ``shard_buckets``, a DDP comm
    hook such as torch's ``default_hooks.allreduce_hook`` (``state`` a process group), run on
    DDP's bucket as the original does. Anything else raises ``TypeError`` here, before any
    collective."""
    return _hook_with_zero(hook, ddp, zero, shard_buckets, interleaved=False, name="hook_with_zero_step")


def hook_with_zero_step_interleaved(hook: Callable[..., Any], ddp: DistributedDataParallel, zero: ZeroOptimizer,
                                    shard_buckets: bool = False) -> Callable[[Any, Any], Any]:
    """Like :func:`hook_with_zero_step`, but each parameter is updated and broadcast as soon as
    its gradient is reduced, so broadcasts interleave with the later gradient collectives."""
    return _hook_with_zero(hook, ddp, zero, shard_buckets, interleaved=True, name="hook_with_zero_step_interleaved")
