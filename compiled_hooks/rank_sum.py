"""The local sum that finishes a reduce-scatter sent as an all-to-all, as a custom op
(``compiled_hooks::rank_sum``, registered on import).

``rank_sum(received, ranks, divisor, predivisor=1) -> shard``: ``received`` holds ``ranks``
blocks of equal rows, block ``r`` from rank ``r``; the shard is their sum, each block first
divided by ``predivisor`` in its own dtype, added in rank order in fp32 where the dtype is
narrower, divided by ``divisor``, in ``received``'s dtype::

    received = [a0 a1 | b0 b1], ranks = 2, divisor = 2   ->   [(a0 + b0) / 2, (a1 + b1) / 2]
    received = [a0 a1 | b0 b1], ranks = 2, divisor = 1, predivisor = 2
                                                         ->   [a0 / 2 + b0 / 2, a1 / 2 + b1 / 2]

``predivisor`` is a power of two, which the op divides by for the senders: dividing by a power of
two and multiplying by its reciprocal (as Inductor does on GPUs) round alike, so the shard equals
the one the senders' own division would give, bit for bit.

``passes.reduce_scatter_as_all_to_all`` writes it. As an opaque call it costs Inductor no
kernel to compile, where the same sum as its own kernel costs a C++ (or Triton) compile for each
bucket size.
"""

from __future__ import annotations

import torch

__all__ = ["rank_sum", "RANK_SUM", "exact_predivisor"]


def exact_predivisor(n: object) -> bool:
    """Whether ``rank_sum`` takes ``n`` as its ``predivisor``: an int (or an integral float)
    2**k, k >= 0."""
    if isinstance(n, bool) or not isinstance(n, (int, float)) or not n >= 1:
        return False
    return (isinstance(n, int) or n.is_integer()) and int(n) & (int(n) - 1) == 0


def _shard_shape(
    received: torch.Tensor, ranks: int, divisor: int, predivisor: int = 1
) -> list[int]:
    if ranks < 1 or divisor < 1:
        raise ValueError(f"rank_sum: ranks {ranks} and divisor {divisor} must be positive")
    if not exact_predivisor(predivisor):
        raise ValueError(f"rank_sum: predivisor {predivisor} is not a power of two")
    if received.dim() == 0 or received.shape[0] % ranks:
        raise ValueError(f"rank_sum: {tuple(received.shape)} is not {ranks} blocks of rows")
    return [received.shape[0] // ranks, *received.shape[1:]]


@torch.library.custom_op("compiled_hooks::rank_sum", mutates_args=())
def rank_sum(received: torch.Tensor, ranks: int, divisor: int, predivisor: int = 1) -> torch.Tensor:
    """The sum of ``received``'s ``ranks`` blocks, each over ``predivisor``, over ``divisor``
    (see the module docstring)."""
    shape = _shard_shape(received, ranks, divisor, predivisor)
    # each block over predivisor in the wire dtype, as the sender would have divided it
    blocks = (b if predivisor == 1 else b / predivisor for b in received.reshape(ranks, *shape))
    narrow = received.dtype.is_floating_point and received.dtype.itemsize < 4
    # a copy of the first block, never a view of received (a divided block is a copy already)
    total = next(blocks).to(torch.float32 if narrow else received.dtype, copy=predivisor == 1)
    for block in blocks:
        total += block
    if divisor != 1:
        total = total / divisor
    return total.to(received.dtype)


@rank_sum.register_fake
def _(received: torch.Tensor, ranks: int, divisor: int, predivisor: int = 1) -> torch.Tensor:
    return received.new_empty(_shard_shape(received, ranks, divisor, predivisor))


RANK_SUM = torch.ops.compiled_hooks.rank_sum.default
