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
import torch.nn.functional as F

from .. import compat, ops, validation
from .codec import dequantize, from_blocks, pack, quantize, to_blocks
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


def _read(state: QuantizedState, key: str, part: int, like: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():  # read when the graph runs
        return ops.quantized_error(like, state.state_id, key, part)
    return state.read_error(key, part, like, NAME)


def _residual(x: torch.Tensor, sent: torch.Tensor, folded: torch.Tensor) -> torch.Tensor:
    """``x - sent``; where that is not finite, the error ``folded`` into ``x`` stays."""
    residual = x - sent
    return torch.where(torch.isfinite(residual), residual, folded)


def _keep(
    state: QuantizedState, key: str, part: int, residual: torch.Tensor, row: int, shape: torch.Size
) -> None:
    """Keep ``residual``, in the block layout of rows of ``row`` elements, as the error of
    ``(key, part)``, in ``shape`` (:func:`~compiled_hooks.int8.codec.from_blocks`)."""
    if torch.compiler.is_compiling():
        ops.quantized_keep_error(residual, state.state_id, key, part, row, list(shape))
    else:
        state.keep_error(key, part, from_blocks(residual, row, shape))


def _quantize_keeping(
    state: QuantizedState,
    key: str,
    part: int,
    x: torch.Tensor,
    folded: torch.Tensor,
    shape: torch.Size,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize` of the rows ``x`` (``folded``, the rows of the error read, already in
    them), keeping the residual as the error of ``(key, part)`` in ``shape``.

    The residual stays in the block layout up to the keep, which cuts it to ``shape``: a loop
    over the blocks indexes every input linearly, where a loop over ``shape`` would find each
    element's block by a division."""
    bs = state.block_size
    q, scales = quantize(x, bs)
    residual = _residual(to_blocks(x, bs), q.float() * scales.unsqueeze(2), to_blocks(folded, bs))
    _keep(state, key, part, residual, x.shape[1], shape)
    return q, scales


def _rows(state: QuantizedState, x: torch.Tensor) -> torch.Tensor:
    """``x`` flat, zero-padded to whole shards, as ``[world_size, shard]``."""
    world = state.world_size
    shard = -(-x.numel() // world)
    return F.pad(x.reshape(-1), (0, shard * world - x.numel())).view(world, shard)


def _quantize_shard(
    state: QuantizedState, key: str | None, mine: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The averaged shard ``mine`` quantized for the all-gather (its error folded in and kept)."""
    if key is None:
        return quantize(mine.unsqueeze(0), state.block_size)
    folded = _read(state, key, SHARD, mine)
    y = (mine + folded).unsqueeze(0)
    return _quantize_keeping(state, key, SHARD, y, folded.unsqueeze(0), mine.shape)


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
    x = grad.reshape(-1).float()
    if key is None:
        rows = _rows(state, x)
        q, scales = quantize(rows, state.block_size)
    else:
        folded = _read(state, key, WORKER, x.view(grad.shape)).reshape(-1)
        rows = _rows(state, x + folded)
        q, scales = _quantize_keeping(state, key, WORKER, rows, _rows(state, folded), grad.shape)
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
        folded = torch.zeros_like(x)
        for k, g, (start, end) in zip(keys, grads, spans):
            folded[start:end] = state.read_error(k, WORKER, g.float(), NAME).reshape(-1)  # type: ignore[arg-type]
        x = x + folded
    rows = _rows(state, x)
    world, shard, group = state.world_size, rows.shape[1], state.process_group
    q, scales = quantize(rows, state.block_size)
    if folded is not None:
        residual = _residual(x, dequantize(q, scales, shard).reshape(-1)[: x.numel()], folded)
        for k, g, (start, end) in zip(keys, grads, spans):
            state.keep_error(k, WORKER, residual[start:end].view(g.shape))  # type: ignore[arg-type]
    bucket_key = f"bucket:{bucket.index()}" if state.error_feedback else None
    order, bs = state.in_order, state.block_size
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


int8_compress_hook.reduce_async = reduce_bucket_async  # type: ignore[attr-defined]
