"""The plain tensors a compiled ``data_parallel`` forward gathers from, one per sharded
parameter: its *leaf*.

A traced forward that reads a DTensor parameter makes it a graph input of a tensor subclass,
which Dynamo wraps and guards and AOTAutograd flattens, per parameter at every trace and
through a runtime wrapper at every call. So a compiled read (a traced root's block gathers and
parameter reads, a block compiled on its own) reads no DTensor: it gathers from the leaf, a
plain tensor that shares the storage of the parameter's local shard (the optimizer's in-place
step and an in-place ``load_state_dict`` reach it) and requires grad as the parameter does.
Autograd accumulates the shard's gradient into ``leaf.grad``; the leaf's post-accumulate hook
moves it to the parameter, as the DTensor gradient ``to_local()``'s backward would have given::

    param (nn.Parameter(DTensor), Shard(0))  ──  local shard  ──┐  one storage
    leaf  (plain tensor, requires_grad)      ───────────────────┘
    compiled forward:  full = gather(leaf)
    backward:          leaf.grad ─(hook)─> param.grad   (a DTensor of param's spec; added to
                                                          one already there), then param's own
                                                          post-accumulate-grad hooks

Invariant: each leaf shares its parameter's storage, shape and dtype, and requires grad iff the
parameter does. Where that can break through the module, ``data_parallel`` makes the leaves
again (:meth:`Leaves.link`: after ``_apply``, or a parameter assigned, as
``load_state_dict(assign=True)`` does) or has them follow (:meth:`Leaves.follow`: after
``requires_grad_()`` on a managed module). Each backward checks it for every parameter, once: a
parameter frozen since its leaf was made gets no gradient (dropped) and its leaf follows; one
whose storage or ``requires_grad=True`` its leaf does not hold raises, naming it.
Tensor-parallel parameters, read as DTensors by the module itself, have no leaf.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .. import compat
from .layout import Layout

__all__ = ["Leaves", "Slot"]

Params = Mapping[str, "nn.Parameter | None"]  # a module's own parameters, by attribute
# where a traced read finds a parameter's leaf (a module's map by attribute, a block's list by
# index), the key there, the parameter as a module holds it (Params, attribute), its layout
Slot = tuple[Any, "str | int", Params, str, Layout]


def _local(param: torch.Tensor) -> torch.Tensor:
    """The local tensor of the DTensor ``param``, outside autograd."""
    assert isinstance(param, DTensor), "a sharded parameter or its gradient"
    with torch.no_grad():
        return param.to_local()


class Leaves:
    """The leaves of one ``data_parallel`` root, by parameter (its layout's name)."""

    def __init__(self) -> None:
        # layout name -> (the parameters of a module that holds it, its attribute there, leaf)
        self.entries: dict[str, tuple[Params, str, torch.Tensor]] = {}
        self._checked = False  # in the running backward

    def link(self, slots: Iterable[Slot]) -> None:
        """Make the leaf of every parameter of ``slots`` that is not tensor-parallel. A slot per
        place a traced read looks the leaf up in: that map or list and the leaf's key there,
        then the parameter as a module holds it (its ``_parameters`` and attribute) and its
        layout; one leaf per parameter, in every place of its slots."""
        made: dict[str, torch.Tensor] = {}
        for leaves, key, params, attr, layout in slots:
            if layout.tensor_parallel is not None:
                continue
            if layout.name not in made:
                param = params[attr]
                assert isinstance(param, DTensor), "data_parallel shards into DTensors"
                leaf = _local(param).detach().requires_grad_(param.requires_grad)
                leaf.register_post_accumulate_grad_hook(self._moved(layout.name))
                made[layout.name] = leaf
                self.entries[layout.name] = (params, attr, leaf)
            leaves[key] = made[layout.name]

    def follow(self) -> None:
        """Each leaf requires grad as its parameter now does."""
        for params, attr, leaf in self.entries.values():
            param = params[attr]
            leaf.requires_grad_(param is not None and param.requires_grad)

    def _moved(self, name: str) -> Any:
        def move(leaf: torch.Tensor) -> None:
            grad, leaf.grad = leaf.grad, None
            if not self._checked:
                self.check()
                self._checked = True
                compat.queue_backward_callback(self._done)
            params, attr, _ = self.entries[name]
            param = params[attr]
            if grad is None or param is None or not param.requires_grad:
                return
            assert isinstance(param, DTensor), "checked: the leaf's parameter"
            with torch.no_grad():
                if param.grad is None:
                    param.grad = DTensor.from_local(
                        grad,
                        param.device_mesh,
                        param.placements,
                        run_check=False,
                        shape=param.shape,
                        stride=param.stride(),
                    )
                else:
                    _local(param.grad).add_(grad)
            compat.run_post_accumulate_grad_hooks(param)

        return move

    def _done(self) -> None:
        self._checked = False

    def check(self) -> None:
        """The invariant of the module docstring, for every leaf: a parameter frozen since its
        leaf was made freezes the leaf; any other break raises ``RuntimeError``."""
        for name, (params, attr, leaf) in self.entries.items():
            param = params[attr]
            local = _local(param) if isinstance(param, DTensor) else None
            if (
                local is None
                or local.data_ptr() != leaf.data_ptr()
                or local.shape != leaf.shape
                or local.dtype != leaf.dtype
            ):
                raise RuntimeError(
                    f"data_parallel: parameter {name!r} no longer holds the shard its compiled "
                    "forward read (it was replaced around the module): change parameters in "
                    "place (copy_, load_state_dict), or through the module (.to(), assignment, "
                    "load_state_dict(assign=True)), which data_parallel follows"
                )
            if leaf.requires_grad and not param.requires_grad:
                leaf.requires_grad_(False)
            elif param.requires_grad and not leaf.requires_grad:
                raise RuntimeError(
                    f"data_parallel: parameter {name!r} was set to require grad after its "
                    "compiled forward was traced without, so this backward gave it no "
                    "gradient: call requires_grad_() on a module data_parallel manages "
                    "instead (it follows), or set it before data_parallel"
                )
