"""``ZeroOptimizer``: ZeRO-1 as a ``torch.optim.Optimizer``. Each rank keeps the optimizer state
of what it owns; every update leaves every rank with identical parameters.

Where each rank keeps its state, and how buckets go on the wire, is one of two strategies
(:mod:`.storage`): whole parameters, each owned by one rank (default), or every parameter split
evenly (``shard_buckets``). Checkpoints: :mod:`.checkpoint`.

Hyperparameters reach the traced step as a table of values (:mod:`.param_groups`), so an LR
schedule never recompiles. What the traced code branches on (SGD's momentum being 0, Adam's and
SGD's weight decay being 0, nesterov) is fixed per group when the optimizer is built; a change
of it raises ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fcol

from .checkpoint import LocalState, consolidated_state, load_state, local_state
from .even_shards import EvenShards
from .optim_math import (
    COLUMNS,
    DIRECTION_COLUMNS,
    check_change,
    direction_rule,
    group_hyperparameters,
    rule_of,
    state_names,
    step_scalars,
    table_row,
)
from .param_groups import Group, checked_params, groups_state
from .storage import BucketUpdate, Storage
from .whole_parameters import WholeParameters

__all__ = ["ZeroOptimizer"]


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

    _row_buckets: frozenset[tuple[int, ...]]  # planned buckets updated over own rows

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type,
        process_group: dist.ProcessGroup | None = None,
        shard_buckets: bool = False,
        max_norm: float | None = None,
        **defaults: Any,
    ):
        if max_norm is not None and not (isinstance(max_norm, (int, float)) and max_norm > 0):
            raise ValueError(f"ZeroOptimizer: max_norm must be a positive number, got {max_norm!r}")
        self.optimizer_class = optimizer_class
        group = process_group if process_group is not None else dist.group.WORLD
        if group is None:
            raise RuntimeError(
                "ZeroOptimizer: no process group given and the default one is not initialized"
            )
        self.process_group: dist.ProcessGroup = group
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
            raise TypeError(
                "ZeroOptimizer: a parameter group is a dict with 'params', got "
                f"{type(param_group).__name__}"
            )
        if self._built and (self._hooks_built or bool(self._steps.any())):
            raise RuntimeError(
                "ZeroOptimizer.add_param_group: the state is already laid out for the ZeRO hooks "
                "or used by a step; build the optimizer with every parameter group instead"
            )
        group = dict(param_group)
        index = len(self.param_groups)
        params = checked_params(group["params"], index, self.param_groups)
        hp = group_hyperparameters(self.optimizer_class, self._given, group)
        extra = {k: v for k, v in group.items() if k not in hp and k != "params"}
        self.param_groups.append(
            Group({"params": params, **hp, **extra}, self._hyperparameters_changed, index)
        )
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
        # a traced step reads it: replaced only when it changes
        if row_buckets != self._row_buckets:
            self._row_buckets = row_buckets

    # -- layout ------------------------------------------------------------------------------
    def _build(self) -> None:
        """Lay out the state for the parameters of every group, from zero."""
        groups = self.param_groups
        self.params = [p for g in groups for p in g["params"]]
        params = self.params
        if len({(p.dtype, p.device) for p in params}) != 1:
            raise TypeError(
                "ZeroOptimizer: all parameters must share one dtype and device (buckets are "
                f"flat), got {sorted({(str(p.dtype), str(p.device)) for p in params})}"
            )
        self._index = {id(p): i for i, p in enumerate(params)}
        self._group_of = [g for g, group in enumerate(groups) for _ in group["params"]]
        self._rules = [rule_of(self.optimizer_class, group) for group in groups]
        names = {state_names(rule) for rule in self._rules}
        if len(names) != 1:
            raise ValueError(
                "ZeroOptimizer: every parameter group must keep the same state (SGD: momentum 0 "
                f"in all groups or in none), got {sorted(names)}"
            )
        device = params[0].device
        self._table = torch.tensor(
            [table_row(g) for g in groups], dtype=torch.float64, device=device
        )
        self._steps = torch.zeros(len(params), dtype=torch.float64, device=device)
        self.grad_norm = torch.zeros((), dtype=torch.float32, device=device)
        strategy = EvenShards if self.shard_buckets else WholeParameters
        self.storage: Storage = strategy(params, names.pop(), self.process_group)
        self._row_buckets = frozenset()
        self._consolidated: tuple[torch.Tensor, dict[str, Any]] | None = None
        self.state = LocalState(self.storage, self._steps, self.index_of)  # type: ignore[assignment]
        self._built = True

    def _own_row_buckets(self) -> frozenset[tuple[int, ...]]:
        """The planned buckets whose update may run over this rank's own row: every member's
        update reads the parameter only as ``param * decay - scale * direction``
        (:func:`~.optim_math.direction_rule`), and the members' groups agree on what the
        direction reads (Adam's betas and eps, SGD's momentum and dampening)."""
        columns = [COLUMNS.index(c) for c in DIRECTION_COLUMNS[self.optimizer_class]]
        rows = [[table_row(group)[c] for c in columns] for group in self.param_groups]
        ok = []
        for key in self.storage.planned_runs():
            groups = {self._group_of[i] for i in key}
            rules = {self._rules[g] for g in groups}
            if (
                len(rules) == 1
                and direction_rule(rules.pop()) is not None
                and len({tuple(rows[g]) for g in groups}) == 1
            ):
                ok.append(key)
        return frozenset(ok)

    @torch.no_grad()
    def plan_buckets(self, buckets: list[list[int]]) -> None:
        """Lay the state out by the buckets the ZeRO hooks will reduce
        (:func:`~compiled_hooks.zero.layout.plan_buckets`): with whole parameters, a bucket
        whose owner rows are nearly equal gets a run of state holding this rank's row at an
        offset the same on every rank, so its update reads and writes one slice and runs over
        this rank's row alone (:meth:`update_bucket`, :meth:`.storage.WholeParameters.plan`).
        This rank's state moves along. With ``shard_buckets`` the layout does not depend on the
        buckets."""
        if sorted(i for b in buckets for i in b) != list(range(len(self.params))):
            raise ValueError(
                "ZeroOptimizer.plan_buckets: the buckets must hold every parameter once, got "
                f"{buckets}"
            )
        self.storage.plan(buckets, self._steps.tolist())
        self._row_buckets = self._own_row_buckets()

    def bucket_nbytes(self) -> list[int]:
        """Each parameter's bytes in a ZeRO bucket on the wire, for planning the buckets."""
        return self.storage.bucket_nbytes()

    @property
    def owner(self) -> list[int] | None:
        """Whole parameters: the rank that owns each parameter; ``None`` with ``shard_buckets``."""
        return self.storage.owners

    def attach_hooks(self) -> None:
        """Mark the update as run by the ZeRO hooks, inside the backward: the layout is fixed
        (:meth:`add_param_group` refuses), step hooks are refused, and the step counts as called
        (an LR scheduler checks that ``step()`` ran before its own step)."""
        self._hooks_built = True
        self._opt_called = True

    def has_step_hooks(self) -> bool:
        """Whether step pre- or post-hooks are registered."""
        return bool(self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks)

    # -- where the state is --------------------------------------------------------------------
    def index_of(self, param: torch.Tensor) -> int:
        try:
            return self._index[id(param)]
        except KeyError:
            raise ValueError(
                f"ZeroOptimizer: a parameter of shape {tuple(param.shape)} is not in this optimizer"
            ) from None

    # -- the step ------------------------------------------------------------------------------
    def reduce_bucket(
        self, hook: Callable[..., Any], state: Any, items: list[tuple[int, torch.Tensor]]
    ):
        """Average a bucket of gradients ``[(i, grad)]`` with one ``hook(state, flat)`` call and
        return ``([(i, g)], row)`` as :meth:`update_bucket` takes them, read from this rank's row
        of the bucket only, so that ``passes`` may reduce just that row (``shard_weight_update``,
        ``all_to_all_weight_update``); ``grad`` keeps this rank's local gradient. ``g``: whole
        parameters, the averaged gradient, right on its owner; ``shard_buckets``, this rank's
        slice. ``row``: this rank's row (whole parameters; ``None`` with ``shard_buckets``). The
        layouts: :mod:`.buckets`."""
        return self.storage.reduce(hook, state, items)

    def clip_coefficient(
        self, reduced: list[tuple[list[tuple[int, torch.Tensor]], torch.Tensor | None]]
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
            else:
                parts += self.storage.norm_squares(items)
        local = torch.stack(parts).sum() if parts else self.grad_norm.new_zeros(())
        norm = fcol.all_reduce(local, "sum", self.process_group).sqrt()
        self.grad_norm.copy_(norm)
        assert self.max_norm is not None, "clip_coefficient is called only when the optimizer clips"
        return (self.max_norm / (norm + 1e-6)).clamp(max=1.0)

    @torch.no_grad()
    def update_bucket(
        self,
        items: list[tuple[int, torch.Tensor]],
        row: torch.Tensor | None = None,
        clip: torch.Tensor | None = None,
    ) -> None:
        """Apply the optimizer to a bucket ``[(i, averaged grad)]`` as :meth:`reduce_bucket` gives
        it, the gradients scaled by ``clip`` if given (:meth:`clip_coefficient`), and leave every
        rank with the same new values: every rank's row of them broadcast from that rank.
        Traceable; the same graph on every rank. Given ``row`` of a bucket :meth:`plan_buckets`
        laid out, where the members' rules allow it and they share one step count, each rank
        computes the update's direction over its own row only
        (:meth:`.whole_parameters.WholeParameters.update`)."""
        rank = self.storage.rank_tensor()
        index = torch.tensor([i for i, _ in items], device=self._table.device)
        steps = self._steps[index] + 1
        self._steps.index_put_((index,), steps)
        groups = torch.tensor([self._group_of[i] for i, _ in items], device=self._table.device)
        sgd = self.optimizer_class is torch.optim.SGD  # once per bucket: see step_scalars
        scalars = step_scalars(self._table.index_select(0, groups), steps, bias_terms=not sgd)
        key = tuple(i for i, _ in items)
        rules = [self._rules[self._group_of[i]] for i in key]
        over_row = key in self._row_buckets
        self.storage.update(BucketUpdate(items, row, scalars, clip, rules, over_row, rank))

    def _own_grad(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """Parameter ``i``'s averaged gradient as :meth:`update_bucket` takes it (with
        ``shard_buckets``, this rank's slice), its shape checked first."""
        p = self.params[i]
        if grad.shape != p.shape:
            raise ValueError(
                f"ZeroOptimizer: gradient of shape {tuple(grad.shape)} for parameter {i} of shape "
                f"{tuple(p.shape)}"
            )
        return self.storage.own_grad(i, grad)

    def update(self, i: int, grad: torch.Tensor) -> None:
        """:meth:`update_bucket` of parameter ``i`` alone, its gradient averaged (no clipping)."""
        self.update_bucket([(i, self._own_grad(i, grad))])

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update every parameter that has a gradient, from ``param.grad`` as it is (average the
        gradients first, e.g. with DDP), clipped first if ``max_norm`` is set. Without the ZeRO
        hooks this is the whole step. Collective: every rank of the group must call it."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items = [
            (i, self._own_grad(i, p.grad)) for i, p in enumerate(self.params) if p.grad is not None
        ]
        clip = (
            self.clip_coefficient([(items, None)]) if self.max_norm is not None and items else None
        )
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
            raise RuntimeError(
                "ZeroOptimizer: step hooks run around step(), but with the ZeRO hooks the update "
                "runs inside the backward, where they would not run; register them without the "
                "ZeRO hooks"
            )

    # -- accounting and checkpoints (see :mod:`.checkpoint`) -------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (per-element state and step counts)."""
        return self.storage.state_bytes() + self._steps.numel() * self._steps.element_size()

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of the state, in ``torch.optim`` form, without communication; what
        ``torch.distributed.checkpoint`` saves from every rank and reshards on load
        (:func:`.checkpoint.local_state`). After :meth:`consolidate_state_dict` (and until the
        next update), the rank it consolidated to gets the whole state instead, as
        ``torch.optim`` and ``ZeroRedundancyOptimizer`` give it."""
        if self._consolidated is not None and torch.equal(self._consolidated[0], self._steps):
            return self._consolidated[1]
        return local_state(self.storage, self._steps, groups_state(self.param_groups))

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collect the whole state on rank ``to`` of the group (point-to-point from each owner;
        with ``shard_buckets`` a gather per state tensor), for a one-file checkpoint:
        ``if rank == to: torch.save(zero.state_dict(), path)``. Collective: every rank of the group
        must call it. Parameters that never stepped have no entry, as in ``torch.optim``."""
        if not 0 <= to < self.world_size:
            raise ValueError(
                f"ZeroOptimizer.consolidate_state_dict: to={to} is not a rank of the group (size "
                f"{self.world_size})"
            )
        whole = consolidated_state(self.storage, self._steps, groups_state(self.param_groups), to)
        self._consolidated = (self._steps.clone(), whole) if whole is not None else None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from a state dict of the same parameter groups: this optimizer's
        :meth:`state_dict` (any rank's part: each rank takes what it keeps), one filled in by
        ``torch.distributed.checkpoint`` (saved at any world size), a consolidated one, or a
        ``torch.optim`` one. Parameters map by position, as in ``torch.optim``; group
        hyperparameters are restored (and checked as a scheduler's would be)."""
        load_state(self.storage, self._steps, self.param_groups, state_dict)
        self._consolidated = None
