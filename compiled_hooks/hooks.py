"""The default FSDP communication hooks, written with functional collectives.

Same names, arguments and numerics as
``torch.distributed.algorithms._comm_hooks.default_hooks``; what differs is how they are
built: every collective is a ``torch.distributed._functional_collectives`` call and every
result is written back with ``copy_``, so ``torch.compile(fullgraph=True)`` traces a hook
whole and Inductor fuses the division and casts around the collective. No ``.data`` swaps
and no streams: the hooks run the same on CPU (gloo) and CUDA (NCCL).

In-place contract (as the original): ``allreduce_hook`` and the compression hooks without
``output`` leave the averaged gradient in ``grad``; with ``output`` they leave this rank's
averaged shard in ``output``. Results are in ``grad``'s dtype for the default hooks and in
``state.parameter_type`` for the compression hooks. Unlike the original, the destination's
dtype is never changed (a functional program cannot swap ``.data``), so it must already have
that dtype, and ``grad`` is left untouched by the reduce-scatter paths.

Numerics, with ``pre``/``post`` from the state (``pre * post == world_size``)::

    allreduce_hook:      grad   = sum_r(grad_r / pre) / post
    reduce_scatter_hook: output = shard(sum_r(grad_r / pre)) / post
    fp16/bf16 hooks:     dst    = (sum_r((grad_r / pre).to(wire)) / post).to(parameter_type)

Every all-reduce hook also has a form for DDP's C++ reducer, ``hook.reduce_async(state, grad)
-> Future[Tensor]``, built from the same two halves (``_to_wire`` before the collective,
``_from_wire`` after it): it pre-divides in place, issues an async all_reduce and returns a
future whose continuation post-divides and writes the result back into ``grad``; the future
completes with ``grad``, holding the same values, bit for bit, as the hook.

The compression hooks pre-divide before the cast, so a gradient above fp16's range that
fits after the division no longer overflows (the original casts first), and post-divide in
the wire dtype, like the original.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fcol

from . import compat, validation
from .hook_kind import give_reduce_async
from .state import DefaultState, LowPrecisionState

__all__ = ["allreduce_hook", "reduce_scatter_hook", "fp16_compress_hook", "bf16_compress_hook"]


def _to_wire(
    state: DefaultState, grad: torch.Tensor, wire: torch.dtype | None, inplace: bool = False
) -> torch.Tensor:
    """Before the collective: ``grad / pre``, in the ``wire`` dtype (``None``: ``grad``'s).
    ``inplace`` divides ``grad`` itself (the C++ reducer's bucket, which the result overwrites):
    the same values, without a temporary."""
    pre = state.gradient_predivide_factor
    if pre > 1:
        grad = grad.div_(pre) if inplace else grad / pre
    return grad if wire is None else grad.to(wire)


def _from_wire(state: DefaultState, summed: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """After the collective: ``summed / post``, in the wire dtype. ``inplace`` divides ``summed``
    itself (a collective's output that nothing else reads)."""
    if state.gradient_postdivide_factor > 1:
        post = state.gradient_postdivide_factor
        summed = summed.div_(post) if inplace else summed / post
    return summed


def _all_reduce(
    state: DefaultState, grad: torch.Tensor, wire: torch.dtype | None = None
) -> torch.Tensor:
    t = fcol.all_reduce(_to_wire(state, grad, wire), "sum", state.process_group)
    return _from_wire(state, t)


def _reduce_scatter(
    state: DefaultState, grad: torch.Tensor, wire: torch.dtype | None = None
) -> torch.Tensor:
    flat = _to_wire(state, grad, wire).reshape(-1)
    t = compat.reduce_scatter_single(flat, "sum", 0, state.process_group)
    return _from_wire(state, t)


def _all_reduce_future(
    state: DefaultState, grad: torch.Tensor, wire: torch.dtype | None = None
) -> torch.futures.Future[torch.Tensor]:
    """:func:`_all_reduce` into ``grad`` with an async collective: ``grad`` is pre-divided in
    place (and cast to the wire dtype), the all_reduce is issued, and the post-division and the
    copy back into ``grad`` run as the returned future's continuation, which completes with
    ``grad``. The same values as the functional form, bit for bit."""
    t = _to_wire(state, grad, wire, inplace=True)
    work = dist.all_reduce(t, dist.ReduceOp.SUM, group=state.process_group, async_op=True)

    def finish(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        summed = _from_wire(state, fut.value()[0], inplace=True)
        return grad if summed is grad else grad.copy_(summed)

    return work.get_future().then(finish)


def allreduce_hook(state: DefaultState, grad: torch.Tensor) -> None:
    """Average ``grad`` across ``state.process_group`` in place (pre-divide, sum, post-divide)."""
    validation.check_state("allreduce_hook", state)
    validation.check_tensor("allreduce_hook", "grad", grad)
    grad.copy_(_all_reduce(state, grad))


def _allreduce_async(state: DefaultState, grad: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    validation.check_state("allreduce_hook", state)
    validation.check_tensor("allreduce_hook", "grad", grad)
    return _all_reduce_future(state, grad)


def reduce_scatter_hook(state: DefaultState, grad: torch.Tensor, output: torch.Tensor) -> None:
    """Write this rank's shard of the averaged ``grad`` into ``output``.

    ``grad`` is the full (unsharded) gradient of ``world_size * output.numel()`` elements,
    read in row-major order; ``output`` must have ``grad``'s dtype and device.
    """
    name = "reduce_scatter_hook"
    validation.check_state(name, state)
    validation.check_tensor(name, "grad", grad)
    validation.check_tensor(name, "output", output)
    validation.check_dtype(name, "output", output, grad.dtype)
    validation.check_shard(name, grad, output, state.world_size)
    output.copy_(_reduce_scatter(state, grad).view(output.shape))


def _low_precision_hook(
    name: str,
    wire: torch.dtype,
    state: LowPrecisionState,
    grad: torch.Tensor,
    output: torch.Tensor | None,
) -> None:
    validation.check_state(name, state, low_precision=True)
    validation.check_tensor(name, "grad", grad)
    if output is None:
        validation.check_dtype(name, "grad", grad, state.parameter_type)
        grad.copy_(_all_reduce(state, grad, wire).to(state.parameter_type))
    else:
        validation.check_tensor(name, "output", output)
        validation.check_dtype(name, "output", output, state.parameter_type)
        validation.check_shard(name, grad, output, state.world_size)
        output.copy_(_reduce_scatter(state, grad, wire).view(output.shape).to(state.parameter_type))


def _low_precision_async(
    name: str, wire: torch.dtype, state: LowPrecisionState, grad: torch.Tensor
) -> torch.futures.Future[torch.Tensor]:
    validation.check_state(name, state, low_precision=True)
    validation.check_tensor(name, "grad", grad)
    validation.check_dtype(name, "grad", grad, state.parameter_type)
    return _all_reduce_future(state, grad, wire)


def fp16_compress_hook(
    state: LowPrecisionState, grad: torch.Tensor, output: torch.Tensor | None = None
) -> None:
    """Average ``grad`` communicating in float16; result in ``grad`` (or the shard in ``output``).

    Pre-divide in ``grad``'s dtype, cast to fp16, sum (all_reduce, or reduce_scatter when
    ``output`` is given), post-divide in fp16, cast to ``state.parameter_type``.
    """
    _low_precision_hook("fp16_compress_hook", torch.float16, state, grad, output)


def bf16_compress_hook(
    state: LowPrecisionState, grad: torch.Tensor, output: torch.Tensor | None = None
) -> None:
    """Same as :func:`fp16_compress_hook`, communicating in bfloat16."""
    _low_precision_hook("bf16_compress_hook", torch.bfloat16, state, grad, output)


# The C++ reducer's form of each all-reduce hook (see the module docstring).
give_reduce_async(allreduce_hook, _allreduce_async)
give_reduce_async(
    fp16_compress_hook,
    functools.partial(_low_precision_async, "fp16_compress_hook", torch.float16),
)
give_reduce_async(
    bf16_compress_hook,
    functools.partial(_low_precision_async, "bf16_compress_hook", torch.bfloat16),
)
