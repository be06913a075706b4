"""The local sum that finishes a reduce-scatter sent as an all-to-all, as a custom op
(``compiled_hooks::rank_sum``, registered on import).

``rank_sum(received, ranks, divisor) -> shard``: ``received`` holds ``ranks`` blocks of equal
rows, block ``r`` from rank ``r``; the shard is their sum, added in rank order in fp32 where the
dtype is narrower, divided by ``divisor``, in ``received``'s dtype::

    received = [a0 a1 | b0 b1], ranks = 2, divisor = 2   ->   [(a0 + b0) / 2, (a1 + b1) / 2]

``passes.reduce_scatter_as_all_to_all`` writes it. As an opaque call it costs Inductor no
kernel to compile, where the same sum as its own kernel costs a C++ (or Triton) compile for each
bucket size.
"""

from __future__ import annotations

import torch

__all__ = ["rank_sum", "RANK_SUM"]


def _shard_shape(received: torch.Tensor, ranks: int, divisor: int) -> list[int]:
    if ranks < 1 or divisor < 1:
        raise ValueError(f"rank_sum: ranks {ranks} and divisor {divisor} must be positive")
    if received.dim() == 0 or received.shape[0] % ranks:
        raise ValueError(f"rank_sum: {tuple(received.shape)} is not {ranks} blocks of rows")
    return [received.shape[0] // ranks, *received.shape[1:]]


@torch.library.custom_op("compiled_hooks::rank_sum", mutates_args=())
def rank_sum(received: torch.Tensor, ranks: int, divisor: int) -> torch.Tensor:
    """The sum of ``received``'s ``ranks`` blocks over ``divisor`` (see the module docstring)."""
    shape = _shard_shape(received, ranks, divisor)
    blocks = received.reshape(ranks, *shape)
    narrow = received.dtype.is_floating_point and received.dtype.itemsize < 4
    total = blocks[0].to(torch.float32 if narrow else received.dtype, copy=True)
    for block in blocks[1:]:
        total += block
    if divisor != 1:
        total = total / divisor
    return total.to(received.dtype)


@rank_sum.register_fake
def _(received: torch.Tensor, ranks: int, divisor: int) -> torch.Tensor:
    return received.new_empty(_shard_shape(received, ranks, divisor))


RANK_SUM = torch.ops.compiled_hooks.rank_sum.default
