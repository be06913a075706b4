"""int8 gradient communication (ZeRO++'s qgZ), compile-native: ``int8_compress_hook``.

Each rank quantizes its gradient block-wise to int8 (fp32 scales, :mod:`.codec`), the
ranks exchange their rows with one all-to-all, and each sums what it received in fp32 and
divides by the world size: that is the reduce-scatter form (``output`` given). The all-reduce
form then quantizes the averaged shard again and all-gathers it; every rank dequantizes the
same bytes, so every rank ends with the same gradient, bit for bit::

    x       = grad + error[WORKER]                                    (error feedback)
    q, s    = quantize(x as [N, shard])        error[WORKER] = x - dequantize(q, s)
    mine    = sum_j dequantize(all_to_all(q, s))[j] / N              fp32, rank order
    output  = mine                                                    (reduce-scatter form)
    y       = mine + error[SHARD]                                     (all-reduce form)
    q2, s2  = quantize(y)                      error[SHARD]  = y - dequantize(q2, s2)
    grad    = dequantize(all_gather(q2, s2))

On the wire: 1 byte a value plus 4 bytes a block (``block_size`` values), about 0.27x of fp32
and 0.53x of bf16 at the default 256; the all-reduce form sends that twice, as a
reduce-scatter and an all-gather do. Error per element, without feedback: at most
``absmax / 254`` of its block per quantization (:mod:`.codec`); the sum is exact in fp32
up to rounding. Non-finite values stay non-finite. The result is written in ``grad``'s
(``output``'s) dtype.

Error feedback (the default, :class:`~compiled_hooks.int8.state.QuantizedState`) keeps
both residuals per parameter and adds them to the next step's values, so what one step's
rounding drops is sent in a later step instead of lost.

``int8_compress_hook.reduce_async(state, bucket)`` is its form for DDP's C++ reducer: the
same values for the bucket's flat buffer, with async collectives (the all-gather issued from
the all-to-all's continuation, in an order fixed when the hook is called: :class:`InOrder`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from .. import compat, validation
from ..hook_kind import give_reduce_async
from .codec import (
    dequantize,
    from_row_blocks,
    pack,
    quantize,
    quantize_blocks,
    to_blocks,
    to_row_blocks,
    to_rows,
)
from .collectives import (
    all_gather_quantized,
    gathered_values,
    reduce_scatter_quantized,
    sum_received,
)
from .state import SHARD, WORKER, QuantizedState

__all__ = ["QuantizedState", "int8_compress_hook", "reduce_bucket_async"]

NAME = "int8_compress_hook"


def _check(state: Any, grad: torch.Tensor, output: torch.Tensor | None) -> None:
    if not isinstance(state, QuantizedState):
        raise TypeError(f"{NAME}: state must be a QuantizedState, got {type(state).__name__}.")
    validation.check_tensor(NAME, "grad", grad)
    if output is not None:
        validation.check_tensor(NAME, "output", output)
        validation.check_dtype(NAME, "output", output, grad.dtype)
        validation.check_shard(NAME, grad, output, state.world_size)


def _key(state: QuantizedState, param: object) -> str | None:
    """The error-feedback key of ``param``; None without error feedback."""
    if not state.error_feedback:
        return None
    if param is None:
        raise ValueError(
            f"{NAME}: error feedback keeps a residual per parameter, so the hook needs param= "
            "(the DDP, data_parallel and FSDP2 adapters pass it); call it with param=, or build "
            "QuantizedState(..., error_feedback=False)."
        )
    return state.key(param)


def _residual(x: torch.Tensor, sent: torch.Tensor, folded: torch.Tensor) -> torch.Tensor:
    """``x - sent``; where that is not finite, the error ``folded`` into ``x`` stays."""
    residual = x - sent
    return torch.where(torch.isfinite(residual), residual, folded)


def _quantize_keeping(error: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_blocks` of ``x`` (blocks with ``error``, in the same layout, already
    added), writing the new residual into ``error`` in place: one loop over the blocks computes
    both, indexing every input linearly."""
    q, scales = quantize_blocks(x)
    error.copy_(_residual(x, q.float() * scales.unsqueeze(2), error))
    return q, scales


def _quantize_shard(
    state: QuantizedState, key: str | None, mine: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The averaged shard ``mine`` quantized for the all-gather (its error folded in and kept)."""
    if key is None:
        return quantize(mine.unsqueeze(0), state.block_size)
    error = state.residual(key, SHARD, mine.shape, mine.device, NAME)
    return _quantize_keeping(error, to_blocks(mine.unsqueeze(0), state.block_size) + error)


def int8_compress_hook(
    state: QuantizedState,
    grad: torch.Tensor,
    output: torch.Tensor | None = None,
    *,
    param: object = None,
) -> None:
    """Average ``grad`` across ``state.process_group`` with int8 on the wire; the result in
    ``grad``, or this rank's shard of it in ``output`` (``grad``'s dtype, ``grad.numel() ==
    world_size * output.numel()``). See the module docstring.

    ``param`` names what ``grad`` belongs to (a parameter, or its name): the error-feedback
    residuals are kept per ``param``. DDP's adapter (:func:`compiled_hooks.ddp_comm_hook`),
    ``data_parallel`` and FSDP2's ``register_comm_hook`` pass it.
    """
    _check(state, grad, output)
    key = _key(state, param)
    # Flat before any arithmetic: the rows and blocks of a flat tensor are views with linear
    # indices, where those of an N-d gradient take a division and a modulo per element.
    rows = to_rows(grad.reshape(-1).float(), state.world_size)
    if key is None:
        q, scales = quantize(rows, state.block_size)
    else:
        error = state.residual(key, WORKER, grad.shape, grad.device, NAME)
        q, scales = _quantize_keeping(error, to_blocks(rows, state.block_size) + error)
    shard = rows.shape[1]
    mine = reduce_scatter_quantized(q, scales, shard, state.process_group) / state.world_size
    if output is not None:
        output.copy_(mine.view(output.shape))
        return
    q, scales = _quantize_shard(state, key, mine)
    gathered = all_gather_quantized(q, scales, shard, state.process_group)
    grad.copy_(gathered[: grad.numel()].view(grad.shape))


def reduce_bucket_async(state: QuantizedState, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """:func:`int8_compress_hook` on a DDP ``GradBucket``'s flat buffer, with async
    collectives: the C++ reducer's form, which returns a future of the buffer at once.

    The buffer is quantized whole. The worker residual is kept per parameter (DDP reorders its
    buckets after the first step), the shard's per bucket index (a bucket whose size changed
    starts it again from zero). Every check runs before the first collective."""
    buffer = bucket.buffer()
    _check(state, buffer, None)
    grads, params = bucket.gradients(), bucket.parameters()
    keys = [_key(state, p) for p in params]
    x = buffer.float()
    folded = None
    if state.error_feedback:
        spans = [_span(buffer, g) for g in grads]
        errors = [
            state.residual(k, WORKER, g.shape, g.device, NAME)  # type: ignore[arg-type]
            for k, g in zip(keys, grads)
        ]
        folded = torch.zeros_like(x)
        for error, (start, end) in zip(errors, spans):
            folded[start:end] = from_row_blocks(error, (end - start,))
        x = x + folded
    world, group, bs = state.world_size, state.process_group, state.block_size
    rows = to_rows(x, world)
    shard = rows.shape[1]
    q, scales = quantize(rows, bs)
    if folded is not None:
        residual = _residual(x, dequantize(q, scales, shard).reshape(-1)[: x.numel()], folded)
        for error, (start, end) in zip(errors, spans):
            error.copy_(to_row_blocks(residual[start:end], world, bs))
    bucket_key = f"bucket:{bucket.index()}" if state.error_feedback else None
    order = state.in_order
    exchange, gather = order.reserve(), order.reserve()
    packed = pack(q, scales)
    received = torch.empty_like(packed)
    gathered: list[torch.Tensor] = []

    def reduce(fut: torch.futures.Future[Any]) -> None:
        try:
            fut.value()  # raises what the all-to-all raised
            mine = sum_received(received, bs, shard) / world
            mine_sent = pack(*_quantize_shard(state, bucket_key, mine))
            gathered.append(mine_sent.new_empty((world, mine_sent.shape[1])))
        except Exception as e:  # the slot must be filled, or every later slot waits forever
            order.fill(gather, functools.partial(_failed, e))
            raise
        order.fill(
            gather,
            lambda: compat.all_gather_into(
                gathered[0], mine_sent, group, async_op=True
            ).get_future(),
        )

    def finish(fut: torch.futures.Future[Any]) -> torch.Tensor:
        fut.value()
        values = gathered_values(gathered[0], bs, shard)[: buffer.numel()]
        return buffer.copy_(values)

    order.fill(
        exchange,
        lambda: dist.all_to_all_single(received, packed, group=group, async_op=True).get_future(),
    ).then(reduce)
    return gather.future.then(finish)


def _span(buffer: torch.Tensor, grad: torch.Tensor) -> tuple[int, int]:
    """Where the view ``grad`` lies in the flat ``buffer``: ``(start, end)``."""
    start = (grad.data_ptr() - buffer.data_ptr()) // buffer.element_size()
    end = start + grad.numel()
    if grad.dtype != buffer.dtype or not grad.is_contiguous() or start < 0 or end > buffer.numel():
        raise ValueError(f"{NAME}: a bucket's gradient is not a contiguous view of its buffer")
    return start, end


def _failed(error: Exception) -> torch.futures.Future[Any]:
    raise error


give_reduce_async(int8_compress_hook, reduce_bucket_async)
