"""``ZeroOptimizer``: ZeRO-1 as a ``torch.optim.Optimizer``. Each rank keeps the optimizer state
of what it owns; every update leaves every rank with identical parameters.

Storage:

- whole parameters (default): each parameter is owned by one rank
  (:func:`~compiled_hooks.zero.layout.assign_whole_parameters`); a rank's state lies in one flat
  buffer per state name, laid out by the ZeRO hooks' buckets
  (:func:`~compiled_hooks.zero.layout.lay_out_state`).
- ``shard_buckets``: every parameter split evenly, flat, padded to a multiple of the world size;
  a rank keeps its slice of every parameter's state.

Hyperparameters are tensors when the step runs: ``param_groups`` hold the usual Python values,
and setting one (``group["lr"] = x``, as every torch LR scheduler does) also writes it into a
float64 table the traced step reads (one row per group, :data:`~.optim_math.COLUMNS`). So a
schedule changes values, never the compiled graph. What the traced code branches on (SGD's
momentum being 0, Adam's and SGD's weight decay being 0, nesterov) is fixed per group when the
optimizer is built; a change of it raises ``ValueError``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fcol
import torch.nn.functional as F

from ..ops import group_rank
from .checkpoint import FlatShard
from .layout import Piece, Run, assign_whole_parameters, lay_out_state, owner_rows
from .optim_math import (COLUMNS, DIRECTION_COLUMNS, UNSUPPORTED, apply, check_change, direction_rule, group_hyperparameters, rule_of,
                         state_names, step_scalars, table_row, update)

__all__ = ["ZeroOptimizer"]

# the group keys the step reads: COLUMNS, and what its form depends on
_WATCHED = frozenset(COLUMNS) | {"betas", "nesterov", "decoupled_weight_decay", *UNSUPPORTED}


class _Group(dict):
    """A parameter group. Setting a hyperparameter also writes it into the optimizer's table
    (see the module docstring); a value the step cannot take is refused and not kept."""

    def __init__(self, values: dict[str, Any], on_change: Callable[[int], None], index: int):
        super().__init__(values)
        self._on_change, self._index = on_change, index

    def __setitem__(self, key: str, value: Any) -> None:
        had, old = key in self, self.get(key)
        super().__setitem__(key, value)
        if key not in _WATCHED:
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


class _LocalState(Mapping):
    """``optimizer.state``: parameter -> this rank's entry of :meth:`ZeroOptimizer.state_dict`
    (its step, and the state this rank keeps of it)."""

    def __init__(self, zero: "ZeroOptimizer"):
        self._zero = zero

    def __getitem__(self, param: torch.Tensor) -> dict[str, Any]:
        return self._zero._local_entry(self._zero.index_of(param))

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._zero.params)

    def __len__(self) -> int:
        return len(self._zero.params)


class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO-1: each rank keeps optimizer state only for what it owns; after :meth:`step` (or
    the ZeRO hooks) every rank holds identical parameters.

    Args:
        params: parameters, or parameter groups (dicts with ``"params"`` and any of the
            optimizer's hyperparameters), all requiring grad, of one dtype and device, in any
            order (the ZeRO hooks plan their buckets in the module's parameter order).
        optimizer_class: ``torch.optim.SGD`` (with or without momentum), ``Adam`` or ``AdamW``.
        process_group: the group to shard over (default: the default group).
        shard_buckets: split every parameter evenly across ranks instead of assigning whole
            parameters (see :mod:`compiled_hooks.zero`).
        max_norm: clip the averaged gradients to this global 2-norm before the update, as
            ``torch.nn.utils.clip_grad_norm_`` does; the norm is computed from each rank's own
            part plus one all_reduce of a scalar, and kept in :attr:`grad_norm`.
        **defaults: the optimizer's hyperparameters (validated by ``optimizer_class``).

    ``state_dict()`` is this rank's part (see :meth:`state_dict`); after
    :meth:`consolidate_state_dict` the chosen rank's ``state_dict()`` is the whole state in
    ``torch.optim`` format.
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type, process_group: dist.ProcessGroup | None = None,
                 shard_buckets: bool = False, max_norm: Optional[float] = None, **defaults: Any):
        if max_norm is not None and not (isinstance(max_norm, (int, float)) and max_norm > 0):
            raise ValueError(f"ZeroOptimizer: max_norm must be a positive number, got {max_norm!r}")
        self.optimizer_class = optimizer_class
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self.shard_buckets = shard_buckets
        self.max_norm = max_norm
        self._built = False
        self._hooks_built = False
        params = list(params)
        if not params:
            raise ValueError("ZeroOptimizer: got an empty parameter list")
        self._given = defaults  # what each group's values go over
        super().__init__(params, group_hyperparameters(optimizer_class, defaults, {}))
        self._build()

    # -- parameter groups --------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (its hyperparameters over the defaults, validated by the optimizer
        class). Once a step has run or the ZeRO hooks are built, the state and buckets are laid
        out for the parameters there are, so a new group is refused."""
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise TypeError(f"ZeroOptimizer: a parameter group is a dict with 'params', got {type(param_group).__name__}")
        if self._built and (self._hooks_built or bool(self._steps.any())):
            raise RuntimeError("ZeroOptimizer.add_param_group: the state is already laid out for the ZeRO hooks or "
                               "used by a step; build the optimizer with every parameter group instead")
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        index = len(self.param_groups)
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        for j, p in enumerate(params):
            where = f"parameter {j} of group {index}"
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"ZeroOptimizer: {where} is a {type(p).__name__}, not a tensor")
            if not p.requires_grad:
                raise ValueError(f"ZeroOptimizer: {where} (shape {tuple(p.shape)}) does not require grad; "
                                 "leave it out of the optimizer")
            if not p.is_floating_point():
                raise TypeError(f"ZeroOptimizer: {where} has dtype {p.dtype}; only floating point is supported")
            if id(p) in seen:
                raise ValueError(f"ZeroOptimizer: {where} appears more than once")
            seen.add(id(p))
        if not params:
            raise ValueError(f"ZeroOptimizer: parameter group {index} is empty")
        hp = group_hyperparameters(self.optimizer_class, self._given, group)
        extra = {k: v for k, v in group.items() if k not in hp and k != "params"}
        self.param_groups.append(_Group({"params": params, **hp, **extra}, self._hyperparameters_changed, index))
        if self._built:
            try:
                self._build()
            except Exception:
                self.param_groups.pop()
                self._build()
                raise

    def _hyperparameters_changed(self, index: int) -> None:
        if not self._built:
            return
        group = self.param_groups[index]
        check_change(self.optimizer_class, self._rules[index], group, index)
        self._table[index].copy_(torch.tensor(table_row(group), dtype=torch.float64))
        row_buckets = self._own_row_buckets()
        if row_buckets != self._row_buckets:  # a traced step reads it: replaced only when it changes
            self._row_buckets = row_buckets

    # -- layout ------------------------------------------------------------------------------
    def _build(self) -> None:
        """Lay out the state for the parameters of every group, from zero."""
        groups = self.param_groups
        self.params = [p for g in groups for p in g["params"]]
        params = self.params
        if len({(p.dtype, p.device) for p in params}) != 1:
            raise TypeError("ZeroOptimizer: all parameters must share one dtype and device (buckets are flat), got "
                            f"{sorted({(str(p.dtype), str(p.device)) for p in params})}")
        self._index = {id(p): i for i, p in enumerate(params)}
        self._group_of = [g for g, group in enumerate(groups) for _ in group["params"]]
        self._rules = [rule_of(self.optimizer_class, group) for group in groups]
        names = {state_names(rule) for rule in self._rules}
        if len(names) != 1:
            raise ValueError("ZeroOptimizer: every parameter group must keep the same state (SGD: momentum 0 in all "
                             f"groups or in none), got {sorted(names)}")
        names = names.pop()
        device = params[0].device
        self._device = device
        self._group_name = self.process_group.group_name
        self._table = torch.tensor([table_row(g) for g in groups], dtype=torch.float64, device=device)
        self._steps = torch.zeros(len(params), dtype=torch.float64, device=device)
        self.grad_norm = torch.zeros((), dtype=torch.float32, device=device)
        n = self.world_size
        if self.shard_buckets:
            self._chunks = [math.ceil(p.numel() / n) for p in params]
            self._state = [{k: torch.zeros(c, dtype=p.dtype, device=device) for k in names}
                           for p, c in zip(params, self._chunks)]
        else:
            ready = list(reversed(range(len(params))))
            assigned = assign_whole_parameters([params[i].numel() for i in ready], n)
            self.owner = [0] * len(params)
            self._pieces: list[list[Piece]] = [[] for _ in params]  # see lay_out_state
            for j, i in enumerate(ready):
                self.owner[i], self._pieces[i] = assigned.owner[j], [(assigned.offset[j], params[i].numel())]
            self._buffers = {k: torch.zeros(max(assigned.load), dtype=params[0].dtype, device=device) for k in names}
        self._rows: dict[tuple[int, ...], Run] = {}  # whole parameters, after plan_buckets: the planned runs
        self._bucket_of: dict[int, tuple[int, ...]] = {}
        self._buckets: list[list[int]] = []  # the hooks' buckets, as plan_buckets got them
        self._uniform_steps = True  # every planned bucket's members have one step count
        self._row_buckets: frozenset[tuple[int, ...]] = frozenset()  # planned buckets updated over own rows
        self._consolidated: Optional[tuple[torch.Tensor, dict[str, Any]]] = None
        self.state = _LocalState(self)
        self._built = True

    def _own_row_buckets(self) -> frozenset[tuple[int, ...]]:
        """The planned buckets whose update may run over this rank's own row: every member's
        update reads the parameter only as ``param * decay - scale * direction``
        (:func:`~.optim_math.direction_rule`), and the members' groups agree on what the
        direction reads (Adam's betas and eps, SGD's momentum and dampening)."""
        columns = [COLUMNS.index(c) for c in DIRECTION_COLUMNS[self.optimizer_class]]
        rows = [[table_row(group)[c] for c in columns] for group in self.param_groups]
        ok = []
        for key in self._rows:
            groups = {self._group_of[i] for i in key}
            rules = {self._rules[g] for g in groups}
            if len(rules) == 1 and direction_rule(rules.pop()) is not None and len({tuple(rows[g]) for g in groups}) == 1:
                ok.append(key)
        return frozenset(ok)

    @torch.no_grad()
    def plan_buckets(self, buckets: list[list[int]]) -> None:
        """Whole parameters: lay the state out by the buckets the ZeRO hooks will reduce
        (:func:`~compiled_hooks.zero.layout.plan_buckets`, :func:`~compiled_hooks.zero.layout.lay_out_state`):
        a bucket whose owner rows are nearly equal gets a run of state holding this rank's row
        at an offset the same on every rank, so its update reads and writes one slice and runs
        over this rank's row alone (:meth:`update_bucket`); the other members fill the shorter
        rows' tails. The buffers keep their size. This rank's state moves along."""
        if self.shard_buckets:
            return
        if sorted(i for b in buckets for i in b) != list(range(len(self.params))):
            raise ValueError(f"ZeroOptimizer.plan_buckets: the buckets must hold every parameter once, got {buckets}")
        layout = lay_out_state([p.numel() for p in self.params], self.owner, buckets, self.world_size)
        owned = {i: self._state_views(i) for i in range(len(self.params)) if self.owner[i] == self.rank}
        self._buffers = {k: torch.zeros(layout.size, dtype=buf.dtype, device=buf.device)
                         for k, buf in self._buffers.items()}
        self._pieces = layout.pieces
        for i, state in owned.items():
            self._store(i, state)
        self._buckets = [list(b) for b in buckets]
        self._rows = dict(layout.runs)
        self._bucket_of = {i: key for key in self._rows for i in key}
        self._uniform_steps = self._steps_uniform()
        self._row_buckets = self._own_row_buckets()

    def _steps_uniform(self) -> bool:
        steps = self._steps.tolist()
        return all(len({steps[i] for i in key}) == 1 for key in self._rows)

    # -- where the state is --------------------------------------------------------------------
    def index_of(self, param: torch.Tensor) -> int:
        try:
            return self._index[id(param)]
        except KeyError:
            raise ValueError(f"ZeroOptimizer: a parameter of shape {tuple(param.shape)} is not in this optimizer") from None

    def _state_views(self, i: int) -> dict[str, torch.Tensor]:
        """Parameter ``i``'s state in this rank's buffers: with ``shard_buckets`` this rank's
        flat slice; whole parameters: shaped like it, views, except where the state lies in
        several pieces (a copy)."""
        if self.shard_buckets:
            return self._state[i]
        state = {}
        for k, buf in self._buffers.items():
            parts = [buf[lo:lo + n] for lo, n in self._pieces[i]]
            state[k] = (parts[0] if len(parts) == 1 else torch.cat(parts)).view_as(self.params[i])
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

    def _slice_bounds(self, i: int) -> tuple[int, int]:
        """``shard_buckets``: the elements ``lo .. hi`` of parameter ``i`` (flat) this rank keeps,
        its slice without the padding."""
        n = self.params[i].numel()
        lo = min(self.rank * self._chunks[i], n)
        return lo, min(lo + self._chunks[i], n)

    def _own_slice(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``t``, shaped like parameter ``i``'s chunk (``shard_buckets``)."""
        return self._own_slices([(i, t)], self._rank_major([(i, t)]))[0]

    def _rank_major(self, items: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        n = self.world_size
        parts = [F.pad(t.reshape(-1), (0, n * self._chunks[i] - t.numel())).view(n, -1) for i, t in items]
        return torch.cat(parts, dim=1).reshape(-1)

    def _owner_major(self, items: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Whole parameters: ``items``' tensors flat, owner-major (``[world_size * L]``), and
        each one's (row, offset in the row)."""
        rows = owner_rows([t.numel() for _, t in items], [self.owner[i] for i, _ in items], self.world_size)
        parts = []
        for r in range(self.world_size):
            row = [t.reshape(-1) for (i, t), (owner, _) in zip(items, rows.place) if owner == r]
            pad = rows.length - sum(t.numel() for t in row)
            parts += row + ([items[0][1].new_zeros(pad)] if pad else [])
        return torch.cat(parts), rows.place

    # -- the step ------------------------------------------------------------------------------
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

    def clip_coefficient(self, reduced: list[tuple[list[tuple[int, torch.Tensor]], Optional[torch.Tensor]]]
                         ) -> torch.Tensor:
        """``clip_grad_norm_``'s coefficient ``min(1, max_norm / (norm + 1e-6))`` for the averaged
        gradients of the buckets ``reduced`` (``[(items, row)]`` as :meth:`reduce_bucket` gives
        them, or whole averaged gradients with ``row=None``): each rank sums the squares of what it
        owns (its rows; its slices; its members), one all_reduce adds them up. The norm is kept
        in :attr:`grad_norm`. Traceable; the same graph on every rank."""
        parts = []
        for items, row in reduced:
            if row is not None:
                parts.append(row.float().square().sum())
            elif self.shard_buckets:
                parts += [g.float().square().sum() for _, g in items]
            else:
                rank = self._rank().reshape(())
                parts += [torch.where(rank == self.owner[i], g.float().square().sum(), 0.0) for i, g in items]
        local = torch.stack(parts).sum() if parts else self.grad_norm.new_zeros(())
        norm = fcol.all_reduce(local, "sum", self.process_group).sqrt()
        self.grad_norm.copy_(norm)
        return (self.max_norm / (norm + 1e-6)).clamp(max=1.0)

    @torch.no_grad()
    def update_bucket(self, items: list[tuple[int, torch.Tensor]], row: Optional[torch.Tensor] = None,
                      clip: Optional[torch.Tensor] = None) -> None:
        """Apply the optimizer to a bucket of parameters ``[(i, averaged grad)]`` (with
        ``shard_buckets``, this rank's slices, as :meth:`reduce_bucket` gives them; whole
        parameters: the gradient need only be right on the parameter's owner), the gradients
        scaled by ``clip`` if given (:meth:`clip_coefficient`), and make the results identical on
        every rank: every rank's row of new values (owner-major for whole parameters, rank-major
        with ``shard_buckets``) broadcast from that rank. Traceable; the same graph on every rank.

        Whole parameters, given ``row`` (this rank's row of a bucket laid out by
        :meth:`plan_buckets`), where the bucket may be updated over its own row (see
        ``_own_row_buckets``) and its members share one step count: each rank computes the
        direction over its own row only, and every rank applies the broadcast rows to its
        parameters. Otherwise every rank computes the update of every member and keeps the state
        of those it owns."""
        rank = self._rank()
        index = torch.tensor([i for i, _ in items], device=self._device)
        steps = self._steps[index] + 1
        self._steps.index_put_((index,), steps)
        groups = torch.tensor([self._group_of[i] for i, _ in items], device=self._device)
        scalars = step_scalars(self._table.index_select(0, groups), steps,  # once per bucket: see step_scalars
                               bias_terms=self.optimizer_class is not torch.optim.SGD)
        key = tuple(i for i, _ in items)
        self._note_stepped(key)
        if row is not None and key in self._row_buckets and self._uniform_steps:
            self._update_own_row(key, row if clip is None else row * clip.to(row.dtype), rank, scalars)
            return
        new_values = []
        for (i, g), s in zip(items, scalars.unbind(0)):
            p = self.params[i]
            if self.shard_buckets:
                p = self._own_slice(i, p.detach())
            g = g.to(p.dtype) if clip is None else g.to(p.dtype) * clip.to(p.dtype)
            state = self._state_views(i)
            rule = self._rules[self._group_of[i]]
            new, new_state = update(p, g, state, s, rule)
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
        self._apply_rows(key, place, self._own_row(flat, rank), lambda j, p, new: new)

    def _update_own_row(self, key: tuple[int, ...], row: torch.Tensor, rank: torch.Tensor,
                        scalars: torch.Tensor) -> None:
        """The sharded update of a planned bucket (see :meth:`update_bucket`)::

            u, new = direction(row, s[start:start+L], step)    # this rank's row only
            s[start:start+L] = where(arange(L) < this rank's row length, new, s[start:start+L])
            p <- p * decay - scale * cat(broadcast(u, src=r) for r)[owner(p), place(p)]

        (the ``where`` only where rows differ: a shorter row's tail holds other state, see
        :func:`~compiled_hooks.zero.layout.lay_out_state`; ``decay`` and ``scale`` are each
        member's own, from its group's learning rate)."""
        run = self._rows[key]
        dtype = self.params[key[0]].dtype
        rule = self._rules[self._group_of[key[0]]]
        per_member = scalars.unbind(0)
        state = {k: buf[run.start:run.start + run.length] for k, buf in self._buffers.items()}
        direction, new_state = direction_rule(rule)(row.to(dtype), state, per_member[0], rule)
        if run.lengths is not None:
            lengths = torch.tensor(run.lengths, device=self._device).index_select(0, rank)
            mine = torch.arange(run.length, device=self._device) < lengths
            new_state = {k: torch.where(mine, t, state[k]) for k, t in new_state.items()}
        self._write_state(run.start, new_state)
        self._apply_rows(key, run.place, direction, lambda j, p, u: apply(p, u, per_member[j], rule))

    def _apply_rows(self, members: tuple[int, ...], place: list[tuple[int, int]], own: torch.Tensor,
                    combine: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Broadcast every rank's row ``own`` (owner-major, see :meth:`reduce_bucket`) from that
        rank and write ``combine(j, param, its part of the rows)`` into each parameter of
        ``members`` (``j``: its position in the bucket)."""
        rows = torch.cat([fcol.broadcast(own, src, self.process_group) for src in range(self.world_size)])
        rows = rows.view(self.world_size, -1)
        for j, (i, (r, at)) in enumerate(zip(members, place)):
            p = self.params[i]
            p.copy_(combine(j, p, rows[r, at:at + p.numel()].view_as(p)))

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

    def _own_grad(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """Parameter ``i``'s averaged gradient as :meth:`update_bucket` takes it (with
        ``shard_buckets``, this rank's slice), its shape checked first."""
        p = self.params[i]
        if grad.shape != p.shape:
            raise ValueError(f"ZeroOptimizer: gradient of shape {tuple(grad.shape)} for parameter {i} of shape {tuple(p.shape)}")
        return self._own_slice(i, grad) if self.shard_buckets else grad

    def update(self, i: int, grad: torch.Tensor) -> None:
        """:meth:`update_bucket` of the one parameter ``i`` with its averaged gradient (no clipping)."""
        self.update_bucket([(i, self._own_grad(i, grad))])

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Update every parameter that has a gradient, from ``param.grad`` as it is (average the
        gradients first, e.g. with DDP), clipped first if ``max_norm`` is set. Without the ZeRO
        hooks this is the whole step. Collective: every rank of the group must call it."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items = [(i, self._own_grad(i, p.grad)) for i, p in enumerate(self.params) if p.grad is not None]
        clip = self.clip_coefficient([(items, None)]) if self.max_norm is not None and items else None
        for item in items:
            self.update_bucket([item], clip=clip)
        return loss

    # -- the Optimizer's step hooks ------------------------------------------------------------
    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        self._refuse_step_hooks()
        return super().register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any:
        self._refuse_step_hooks()
        return super().register_step_post_hook(hook)

    def _refuse_step_hooks(self) -> None:
        if self._hooks_built:
            raise RuntimeError("ZeroOptimizer: step hooks run around step(), but with the ZeRO hooks the update runs "
                               "inside the backward, where they would not run; register them without the ZeRO hooks")

    # -- accounting and checkpoints --------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (per-element state and step counts)."""
        tensors = [t for s in self._state for t in s.values()] if self.shard_buckets else list(self._buffers.values())
        return sum(t.numel() * t.element_size() for t in tensors) + self._steps.numel() * self._steps.element_size()

    def _local_entry(self, i: int) -> dict[str, Any]:
        """Parameter ``i``'s entry in this rank's :meth:`state_dict`: its step, and the state this
        rank keeps of it (whole parameters: all of it on the owner, nothing elsewhere;
        ``shard_buckets``: a :class:`~.checkpoint.FlatShard` of this rank's slice)."""
        entry: dict[str, Any] = {"step": self._steps[i].to(torch.float32).cpu()}
        p = self.params[i]
        if self.shard_buckets:
            lo, hi = self._slice_bounds(i)
            entry.update({k: FlatShard(t[:hi - lo], tuple(p.shape), lo) for k, t in self._state[i].items()})
        elif self.owner[i] == self.rank:
            entry.update(self._state_views(i))
        return entry

    def _groups_state(self) -> list[dict[str, Any]]:
        """``param_groups`` as a state dict holds them: values, and parameters by index."""
        groups, start = [], 0
        for group in self.param_groups:
            n = len(group["params"])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start, start + n))})
            start += n
        return groups

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of the state, in ``torch.optim`` form (``{"state": {index: entry},
        "param_groups": [...]}``), without communication: every parameter's ``step``, and the
        state this rank keeps (whole parameters: the owned parameters' tensors, views where they
        lie in one piece; ``shard_buckets``: :class:`~.checkpoint.FlatShard` slices at the
        parameter's shape). ``torch.distributed.checkpoint`` saves every rank's part
        (``get_optimizer_state_dict(model, zero)``) and loads it at any world size, into this
        optimizer or a plain one, and no rank holds the whole state.

        After :meth:`consolidate_state_dict` (and until the next update), the rank it consolidated
        to gets the whole state instead, as ``torch.optim`` and ``ZeroRedundancyOptimizer`` give
        it: full tensors, loadable by the plain optimizer."""
        if self._consolidated is not None and torch.equal(self._consolidated[0], self._steps):
            return self._consolidated[1]
        return {"state": {i: self._local_entry(i) for i in range(len(self.params))}, "param_groups": self._groups_state()}

    @torch.no_grad()
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collect the whole state on rank ``to`` of the group (point-to-point from each owner;
        with ``shard_buckets`` a gather per state tensor), for a one-file checkpoint:
        ``if rank == to: torch.save(zero.state_dict(), path)``. Collective: every rank of the group
        must call it. Parameters that never stepped have no entry, as in ``torch.optim``."""
        if not 0 <= to < self.world_size:
            raise ValueError(f"ZeroOptimizer.consolidate_state_dict: to={to} is not a rank of the group "
                             f"(size {self.world_size})")
        here = self.rank == to
        dst = dist.get_global_rank(self.process_group, to)
        state: dict[int, dict[str, torch.Tensor]] = {}
        for i, p in enumerate(self.params):
            step = float(self._steps[i])
            if step == 0:
                continue
            full = {"step": torch.tensor(step, dtype=torch.float32)}
            for k, t in self._state_views(i).items():
                if self.shard_buckets:
                    parts = [torch.empty_like(t) for _ in range(self.world_size)] if here else None
                    dist.gather(t.contiguous(), parts, dst=dst, group=self.process_group)
                    if here:
                        full[k] = torch.cat(parts)[: p.numel()].view_as(p)
                elif self.owner[i] == to:
                    if here:
                        full[k] = t.clone()
                elif self.rank == self.owner[i]:
                    dist.send(t.contiguous(), dst=dst, group=self.process_group)
                elif here:
                    full[k] = torch.empty_like(t)
                    dist.recv(full[k], src=dist.get_global_rank(self.process_group, self.owner[i]),
                              group=self.process_group)
            state[i] = full
        self._consolidated = (self._steps.clone(), {"state": state, "param_groups": self._groups_state()}) if here else None

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from a state dict of the same parameter groups: this optimizer's
        :meth:`state_dict` (any rank's part: each rank takes what it keeps), one filled in by
        ``torch.distributed.checkpoint`` (saved at any world size), a consolidated one, or a
        ``torch.optim`` one. Parameters map by position, as in ``torch.optim``; group
        hyperparameters are restored (and checked as a scheduler's would be)."""
        groups = state_dict.get("param_groups", [])
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"ZeroOptimizer.load_state_dict: expected parameter groups of "
                             f"{[len(g['params']) for g in self.param_groups]} parameters, got "
                             f"{[len(g['params']) for g in groups]}")
        position = {key: i for i, key in enumerate(key for g in groups for key in g["params"])}
        unknown = [key for key in state_dict["state"] if key not in position]
        if unknown:
            raise ValueError(f"ZeroOptimizer.load_state_dict: state for parameters {unknown[:5]} that no group lists")
        for group, saved in zip(self.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        # Loaded into fresh buffers, then copied into the live ones: the state dict's tensors may
        # be views of the live ones (DCP loads into this optimizer's own state_dict()).
        live = self._state if self.shard_buckets else [self._buffers]
        fresh = [{k: torch.zeros_like(t) for k, t in d.items()} for d in live]
        if self.shard_buckets:
            self._state = fresh
        else:
            self._buffers = fresh[0]
        self._steps.zero_()
        for key, saved in state_dict["state"].items():
            self._load_entry(position[key], saved)
        for old, new in zip(live, fresh):
            for k, t in old.items():
                t.copy_(new[k])
        if self.shard_buckets:
            self._state = live
        else:
            self._buffers = live[0]
        self._uniform_steps = self._steps_uniform()
        self._consolidated = None

    def _load_entry(self, i: int, saved: dict[str, Any]) -> None:
        p = self.params[i]
        names = list(self._state_views(i))
        if "step" in saved:
            self._steps[i] = float(saved["step"])
        elif any(k in saved for k in names):  # torch's SGD keeps no step count
            self._steps[i] = 1.0
        keeps = self.shard_buckets or self.owner[i] == self.rank
        if not keeps:
            return
        own = {}
        for k in names:
            value = saved.get(k)
            if value is None:
                if float(self._steps[i]) > 0:
                    raise ValueError(f"ZeroOptimizer.load_state_dict: parameter {i} stepped but its state {k!r} "
                                     "is missing on the rank that keeps it (a rank's part of a state dict loads only "
                                     "on that rank; use torch.distributed.checkpoint to reshard)")
                continue
            if isinstance(value, FlatShard):
                if (not self.shard_buckets or tuple(value.shape) != tuple(p.shape)
                        or value.lo != self._slice_bounds(i)[0]):
                    raise ValueError(f"ZeroOptimizer.load_state_dict: state {k!r} of parameter {i} is another "
                                     f"rank's slice ({value}); use torch.distributed.checkpoint to reshard")
                self._state[i][k][:value.local.numel()].copy_(value.local)
                continue
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"ZeroOptimizer.load_state_dict: state {k!r} of parameter {i} has shape "
                                 f"{tuple(value.shape)}, expected {tuple(p.shape)}")
            value = value.to(device=p.device, dtype=p.dtype)
            if self.shard_buckets:
                self._state[i][k].copy_(self._own_slice(i, value))
            else:
                own[k] = value
        if own:
            self._store(i, {k: own.get(k, torch.zeros_like(p)) for k in names})
