"""The ZeRO hooks: DDP comm hooks that average gradients in buckets and run a
:class:`~compiled_hooks.zero.ZeroOptimizer`'s step inside the backward.

:class:`ZeroStep` is the DDP-independent core (buckets, arrival, closing, the step);
:func:`hook_with_zero_step` and :func:`hook_with_zero_step_interleaved` adapt it to DDP's two
reducers (the python reducer of compiled DDP, once per gradient; the C++ reducer of eager DDP,
once per bucket).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from .. import compat
from ..ddp import completed, reduce_buffer
from ..hook_kind import hook_kind
from .layout import plan_buckets
from .optimizer import ZeroOptimizer

__all__ = ["ZeroStep", "hook_with_zero_step", "hook_with_zero_step_interleaved"]


class ZeroStep:
    """Buckets are planned when it is built (:func:`~compiled_hooks.zero.layout.plan_buckets`
    over the optimizer's parameters and owners, in the module's parameter ``order``: the
    optimizer's groups may list them in another). Gradients arrive one by one (:meth:`add`); a
    planned bucket closes once all its members have arrived (and the buckets before it have
    closed), so a gradient that comes a little out of the guessed order delays its bucket
    instead of changing it. A closed bucket is averaged with one ``hook`` call, then updated and
    broadcast at once (``interleaved``) or after the last one (:meth:`finish`, which also closes
    what is left of buckets whose members did not all arrive, and clips first if the optimizer
    has ``max_norm``). Buckets depend only on sizes, owners and the plan, so every rank makes
    the same ones. The optimizer's state is laid out by the planned buckets
    (:meth:`ZeroOptimizer.plan_buckets`)."""

    def __init__(
        self,
        hook: Callable[..., Any],
        zero: ZeroOptimizer,
        interleaved: bool,
        bucket_bytes: int = 25 * 1024 * 1024,
        first_bucket_bytes: int = 1024 * 1024,
        order: list[int] | None = None,
    ):
        self.hook, self.zero, self.interleaved = hook, zero, interleaved
        self.planned = plan_buckets(
            zero.bucket_nbytes(),
            zero.owner,
            zero.world_size,
            first_bucket_bytes,
            bucket_bytes,
            order,
        )
        self.bucket_of = {i: b for b, members in enumerate(self.planned) for i in members}
        # this backward's gradients not yet in a closed bucket
        self.arrived: dict[int, torch.Tensor] = {}
        # per planned bucket, in this backward
        self.missing = [len(members) for members in self.planned]
        self.next = 0  # the first planned bucket not closed in this backward
        # buckets waiting for their update
        self.reduced: list[tuple[list, torch.Tensor | None]] = []
        self.started = False  # a backward is in progress (the final callback is queued)
        zero.plan_buckets(self.planned)

    def add(self, state: Any, i: int, grad: torch.Tensor) -> None:
        self.arrived[i] = grad
        self.missing[self.bucket_of[i]] -= 1
        while self.next < len(self.planned) and self.missing[self.next] == 0:
            self.next += 1
            self.close(state, [(j, self.arrived.pop(j)) for j in self.planned[self.next - 1]])

    def close(
        self, state: Any, items: list[tuple[int, torch.Tensor]], averaged: bool = False
    ) -> None:
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
        still waiting (clipped by the norm of all of them, if the optimizer clips)."""
        for members in self.planned[self.next :]:
            self.close(state, [(j, self.arrived.pop(j)) for j in members if j in self.arrived])
        clip = (
            self.zero.clip_coefficient(self.reduced)
            if self.zero.max_norm is not None and self.reduced
            else None
        )
        for items, row in self.reduced:
            self.zero.update_bucket(items, row, clip)
        self.reduced, self.arrived, self.next, self.started = [], {}, 0, False
        self.missing = [len(members) for members in self.planned]


def _reducer(
    name: str, hook: Any, python_reducer: bool, ddp_buckets: bool
) -> tuple[Callable[..., Any], bool]:
    """``(hook, runs_on_buckets)``: what the ZeRO hook calls to average gradients. Accepted:
    a ``hook(state, grad)`` of this package (or the one inside a :func:`ddp_comm_hook`
    wrapper), and, in eager DDP (C++ reducer) without ``shard_buckets``, a DDP comm hook
    ``hook(process_group, bucket: GradBucket) -> Future`` such as torch's ``allreduce_hook`` or
    ``fp16_compress_hook``, run on DDP's own bucket. Anything else is a ``TypeError``."""
    kind = hook_kind(hook, name)
    if kind.per_parameter:
        raise TypeError(
            f"{name}: {kind.name} keeps state per parameter (e.g. PowerSGD), but ZeRO averages "
            "whole buckets of gradients at once; use allreduce_hook, fp16_compress_hook or "
            "bf16_compress_hook"
        )
    if kind.grad_bucket:  # GradBucket in, Future out
        if python_reducer:
            raise TypeError(
                f"{name}: {kind.name} is a DDP comm hook (GradBucket in, Future out), which only "
                "eager DDP's C++ reducer can run; for compiled DDP pass compiled_hooks' "
                "allreduce_hook, fp16_compress_hook or bf16_compress_hook"
            )
        if not ddp_buckets:  # the storage reduces buckets of its own layout
            raise TypeError(
                f"{name}: {kind.name} is a DDP comm hook, which runs on DDP's own bucket; with "
                "shard_buckets=True the gradients are laid out rank-major in buckets of ZeRO's "
                "own, so pass compiled_hooks' allreduce_hook, fp16_compress_hook or "
                "bf16_compress_hook"
            )
        return kind.fn, True
    if not kind.all_reduce:
        raise TypeError(
            f"{name}: hook must be callable as hook(state, grad) (allreduce_hook, "
            "fp16_compress_hook, bf16_compress_hook) or be a DDP comm hook hook(state, bucket), "
            f"got {kind.name!r}"
        )
    return kind.fn, False


def _hook_with_zero(
    hook: Callable[..., Any],
    ddp: DistributedDataParallel,
    zero: ZeroOptimizer,
    shard_buckets: bool,
    interleaved: bool,
    name: str,
) -> Callable[[Any, Any], Any]:
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"{name}: ddp must be a DistributedDataParallel, got {type(ddp).__name__}")
    if not isinstance(zero, ZeroOptimizer):
        raise TypeError(
            f"{name}: zero must be a compiled_hooks.zero.ZeroOptimizer, got {type(zero).__name__}"
        )
    if shard_buckets != zero.shard_buckets:
        raise ValueError(
            f"{name}: shard_buckets={shard_buckets} but the ZeroOptimizer was built with "
            f"shard_buckets={zero.shard_buckets}; build both the same way"
        )
    if interleaved and zero.max_norm is not None:
        raise ValueError(
            f"{name}: the ZeroOptimizer clips gradients (max_norm={zero.max_norm}), which needs "
            "the norm of every gradient before the first update, but the interleaved schedule "
            "updates each bucket as soon as it is reduced; use hook_with_zero_step (the step "
            "after backward)"
        )
    if zero.has_step_hooks():
        raise ValueError(
            f"{name}: the ZeroOptimizer has step hooks, which run around step(); with the ZeRO "
            "hooks the update runs inside the backward, where they would not run"
        )
    trained = [p for p in ddp.module.parameters() if p.requires_grad]
    if {id(p) for p in trained} != {id(p) for p in zero.params}:
        raise ValueError(
            f"{name}: the ZeroOptimizer must hold exactly the DDP module's parameters that "
            f"require grad ({len(trained)} of them), got {len(zero.params)}"
        )
    if ddp.process_group.size() != zero.world_size:
        raise ValueError(
            f"{name}: DDP's group has {ddp.process_group.size()} ranks, the ZeroOptimizer's "
            f"{zero.world_size}"
        )
    if compat.python_reducer() and not compat.ddp_uses_python_reducer(ddp):
        raise ValueError(
            f"{name}: this DDP was built before torch._dynamo.config.optimize_ddp = "
            "'python_reducer' was set, so compiled autograd cannot trace its hooks; build it "
            "with compile_ddp or after setting the flag"
        )
    hook, on_buckets = _reducer(
        name, hook, compat.ddp_uses_python_reducer(ddp), zero.storage.reduces_ddp_buckets
    )
    # C++ reducer, in order
    reducing: list[tuple[torch.futures.Future[torch.Tensor], torch.Tensor, list]] = []
    core = ZeroStep(
        hook,
        zero,
        interleaved,
        bucket_bytes=ddp.bucket_bytes_cap,
        first_bucket_bytes=compat.ddp_first_bucket_bytes(ddp),
        order=[zero.index_of(p) for p in trained],
    )
    zero.attach_hooks()

    def zero_hook(state, bucket):
        if isinstance(bucket, tuple):  # python reducer: (param.grad, param), once per parameter
            grad, param = bucket
            if not core.started:  # flush the last bucket (and, after backward, update) at the end
                core.started = True
                compat.queue_backward_callback(functools.partial(core.finish, state))
            core.add(state, zero.index_of(param), grad)
            return None
        # C++ reducer: DDP's bucket is ours; its buffer holds the flat gradients
        buffer, params = bucket.buffer(), bucket.parameters()
        views = list(buffer.split([p.numel() for p in params]))
        items = [(zero.index_of(p), v.view_as(p)) for p, v in zip(params, views)]
        if not zero.storage.reduces_ddp_buckets:  # reduced in ZeRO's own layout, here and now
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


def hook_with_zero_step(
    hook: Callable[..., Any],
    ddp: DistributedDataParallel,
    zero: ZeroOptimizer,
    shard_buckets: bool = False,
) -> Callable[[Any, Any], Any]:
    """A DDP comm hook (register it with ``ddp.register_comm_hook(state, ...)``) that averages
    gradients with ``hook(state, grad)`` and runs ``zero``'s step after the last gradient is
    reduced, overlapping the outstanding gradient collectives, clipped first if ``zero`` has
    ``max_norm``. Works with compiled DDP (python reducer +
    :func:`compiled_hooks.compiled_autograd`: backward, step and broadcasts in one graph) and
    with eager DDP, on any backend, updating parameters from the first step. ``shard_buckets``
    must match the ``ZeroOptimizer``'s.

    ``hook``: this package's ``allreduce_hook`` / ``fp16_compress_hook`` /
    ``bf16_compress_hook`` (``state`` is their state), the same wrapped by
    :func:`compiled_hooks.ddp_comm_hook`, or, in eager DDP without ``shard_buckets``, a DDP comm
    hook such as torch's ``default_hooks.allreduce_hook`` (``state`` a process group), run on
    DDP's bucket as the original does. Anything else raises ``TypeError`` here, before any
    collective."""
    return _hook_with_zero(
        hook, ddp, zero, shard_buckets, interleaved=False, name="hook_with_zero_step"
    )


def hook_with_zero_step_interleaved(
    hook: Callable[..., Any],
    ddp: DistributedDataParallel,
    zero: ZeroOptimizer,
    shard_buckets: bool = False,
) -> Callable[[Any, Any], Any]:
    """Like :func:`hook_with_zero_step`, but each bucket is updated and broadcast as soon as its
    gradients are reduced, so broadcasts interleave with the later gradient collectives. A
    ``zero`` that clips (``max_norm``) is refused: clipping needs every gradient first."""
    return _hook_with_zero(
        hook, ddp, zero, shard_buckets, interleaved=True, name="hook_with_zero_step_interleaved"
    )
