"""The default FSDP communication hooks, written with functional collectives.

Same names, arguments and numerics as
``torch.distributed.algorithms._comm_hooks.default_hooks``; what differs is how they are
built: every collective is a ``torch.distributed._functional_collectives`` call and every
result is written back with ``copy_``, so ``torch.compile(fullgraph=True)`` traces a hook
whole and Inductor fuses the division and casts around the collective. No ``.data`` swaps,
no streams, no futures: the hooks run the same on CPU (gloo) and CUDA (NCCL).

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

The compression hooks pre-divide before the cast, so a gradient above fp16's range that
fits after the division no longer overflows (the original casts first), and post-divide in
the wire dtype, like the original.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed._functional_collectives as fcol

from . import validation
from .state import DefaultState, LowPrecisionState

__all__ = ["allreduce_hook", "reduce_scatter_hook", "fp16_compress_hook", "bf16_compress_hook"]


def _pre_divide(state: DefaultState, t: torch.Tensor, wire: Optional[torch.dtype]) -> torch.Tensor:
    if state.gradient_predivide_factor > 1:
        t = t / state.gradient_predivide_factor
    return t if wire is None else t.to(wire)


def _post_divide(state: DefaultState, t: torch.Tensor) -> torch.Tensor:
    if state.gradient_postdivide_factor > 1:
        t = t / state.gradient_postdivide_factor
    return t


def _all_reduce(state: DefaultState, grad: torch.Tensor, wire: Optional[torch.dtype] = None) -> torch.Tensor:
    t = fcol.all_reduce(_pre_divide(state, grad, wire), "sum", state.process_group)
    return _post_divide(state, t)


def _reduce_scatter(state: DefaultState, grad: torch.Tensor, wire: Optional[torch.dtype] = None) -> torch.Tensor:
    flat = _pre_divide(state, grad, wire).reshape(-1)
    t = fcol.reduce_scatter_single(flat, "sum", 0, state.process_group)
    return _post_divide(state, t)


def allreduce_hook(state: DefaultState, grad: torch.Tensor) -> None:
    """Average ``grad`` across ``state.process_group`` in place (pre-divide, sum, post-divide)."""
    validation.check_state("allreduce_hook", state)
    validation.check_tensor("allreduce_hook", "grad", grad)
    grad.copy_(_all_reduce(state, grad))


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
    output: Optional[torch.Tensor],
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


def fp16_compress_hook(
    state: LowPrecisionState, grad: torch.Tensor, output: Optional[torch.Tensor] = None
) -> None:
    """Average ``grad`` communicating in float16; result in ``grad`` (or the shard in ``output``).

    Pre-divide in ``grad``'s dtype, cast to fp16, sum (all_reduce, or reduce_scatter when
    ``output`` is given), post-divide in fp16, cast to ``state.parameter_type``.
    """
    _low_precision_hook("fp16_compress_hook", torch.float16, state, grad, output)


def bf16_compress_hook(
    state: LowPrecisionState, grad: torch.Tensor, output: Optional[torch.Tensor] = None
) -> None:
    """Same as :func:`fp16_compress_hook`, communicating in bfloat16."""
    _low_precision_hook("bf16_compress_hook", torch.bfloat16, state, grad, output)
