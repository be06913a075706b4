"""Gradient accumulation without a reduction per micro-batch, for a ``data_parallel`` root
(FSDP2's ``set_requires_gradient_sync(False)``, DDP's ``no_sync()``).

While sync is off (or backward finalization is manual: :mod:`.finalize` reduces then), a
backward keeps each parameter's unsharded gradient, cast to the dtype the comm hook takes, as
the ``.grad`` of a leaf this module owns (its *accumulator*); the next synced backward adds that
sum to its own gradient and reduces once::

    sync off:  acc.grad += grad.to(in_dtype)                 # no collective
    sync on:   hook(state, pad(grad.to(in_dtype) + acc.grad), out); acc.grad = None

Eager, the backward reads the switch, as FSDP2's does. Compiled, the traced forward reads it
(Dynamo guards on it, and on which accumulators hold a sum), and the graph carries the choice:

- sync off: the forward takes the accumulators as inputs, and its backward returns each
  gradient as theirs, which autograd accumulates into ``acc.grad``;
- sync on, a sum pending: the forward takes ``acc.grad`` and, per parameter, a 0-dim leaf (its
  *marker*); the backward adds the sum, reduces, and gives the marker a gradient, whose hook
  clears ``acc.grad`` (:meth:`Accumulation.prepare`).

So compiled, a switch applies from the next forward. One flipped between a compiled forward and
its backward moves the reduction to the next synced backward and changes no value.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Accumulation", "Accumulate", "NOTHING", "traced"]


class Accumulate(NamedTuple):
    """What a traced forward passes one parameter's gather (all None: sync on, nothing
    pending): its accumulator (sync off), or the sum pending and its marker (sync on)."""

    leaf: torch.Tensor | None = None
    pending: torch.Tensor | None = None
    marker: torch.Tensor | None = None


NOTHING = Accumulate()


def traced(entry: tuple[torch.Tensor, torch.Tensor] | None, reduces: bool) -> Accumulate:
    """What a traced forward passes the gather of a parameter whose (accumulator, marker) is
    ``entry`` (None: never prepared), whose backward reduces if ``reduces``
    (:attr:`Accumulation.reduces`), read by Dynamo so that it guards on both."""
    if entry is None:
        return NOTHING
    acc, marker = entry
    if not reduces:
        return Accumulate(leaf=acc)
    if acc.grad is None:
        return NOTHING
    return Accumulate(pending=acc.grad, marker=marker)


class Accumulation:
    """The switches and the accumulated unsharded gradients of one ``data_parallel`` root, by
    parameter (its layout's fully qualified name). ``sync`` is FSDP2's
    ``requires_gradient_sync``; ``manual`` its manual backward finalization (every backward
    accumulates, and ``finalize_backward`` reduces); ``reduces``, what both make of a backward,
    is the one attribute a backward and a traced forward read."""

    def __init__(self) -> None:
        self.sync, self.manual, self.reduces = True, False, True
        self.leaves: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # (accumulator, marker)

    def switch(self, *, sync: bool | None = None, manual: bool | None = None) -> None:
        self.sync = self.sync if sync is None else sync
        self.manual = self.manual if manual is None else manual
        self.reduces = self.sync and not self.manual

    def prepare(
        self, name: str, shape: torch.Size, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``name``'s (accumulator, marker), made on first use: the accumulator a leaf of
        ``shape`` that holds no data of its own (stride 0) and takes ``.grad`` in ``dtype``."""
        if name not in self.leaves:
            acc = torch.zeros((), dtype=dtype, device=device).expand(shape).detach()
            marker = torch.zeros((), dtype=dtype, device=device)
            acc.requires_grad_(), marker.requires_grad_()

            def consumed(m: torch.Tensor) -> None:
                acc.grad, m.grad = None, None

            marker.register_post_accumulate_grad_hook(consumed)
            self.leaves[name] = (acc, marker)
        return self.leaves[name]

    def add(self, name: str, grad: torch.Tensor) -> None:
        """Eager backward, sync off: accumulate ``grad`` (the caller's to give away)."""
        acc = self.leaves[name][0]
        with torch.no_grad():
            if acc.grad is None:
                acc.grad = grad
            else:
                acc.grad += grad

    def take(self, name: str) -> torch.Tensor | None:
        """Eager backward, sync on: the sum pending for ``name``, cleared."""
        entry = self.leaves.get(name)
        if entry is None or entry[0].grad is None:
            return None
        pending, entry[0].grad = entry[0].grad, None
        return pending

    def pending_bytes(self) -> int:
        """The bytes the accumulated unsharded gradients hold."""
        return sum(
            acc.grad.numel() * acc.grad.element_size()
            for acc, _ in self.leaves.values()
            if acc.grad is not None
        )
