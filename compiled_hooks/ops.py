"""Every custom op of this distribution, in one place (namespace ``compiled_hooks``).

Traced code calls these ops so that what must happen when a graph *runs* stays in the graph,
and passes recognise them by their overloads (``GROUP_RANK`` ...). Each op's schema and fake
(meta) implementation is here; where the real work belongs to a module (PowerSGD's state, the
rank guard's protocol), the op calls into it.

* ``group_rank(group_name, device) -> int64[1]``: this process's rank in the group, read at run
  time, so a graph that indexes by it is the same graph on every rank, and a pass can prove
  that an index is "this rank" by finding this op.
* ``powersgd_count(grad, state_id, slot, q_rows, q_cols) -> Q``: counts one PowerSGD hook call
  when the graph runs and returns the Q its power iteration starts from
  (:mod:`compiled_hooks.powersgd`; a graph names its state by the id :func:`register_state`
  gave it). Has a side effect: never dead-code eliminated.
* ``dequantize_packed(packed, block_size) -> values``: fp32 ``[rows, blocks, block_size]`` of
  the int8 rows a quantized collective received (:func:`compiled_hooks.int8.codec.
  dequantize_packed`), computed by ATen; the int8 collectives call it on CPU for rows from
  256 KiB up, where Inductor's loops load int8 through a temporary buffer.
* ``powersgd_fold_error(error!, grad)``: ``error += grad`` in place, declared as mutating
  ``error`` so that Inductor writes into the error buffer instead of a fresh one.
* ``check_ranks(record)``: the rank-divergence guard's check at a graph's start
  (:mod:`compiled_hooks.rank_guard`). Has a side effect.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

from . import compat, rank_guard
from .int8.codec import dequantize_packed_eager, packed_blocks

__all__ = [
    "group_rank",
    "register_state",
    "GROUP_RANK",
    "POWERSGD_COUNT",
    "DEQUANTIZE_PACKED",
    "CHECK_RANKS",
]

_STATES: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_STATE_IDS = itertools.count()


def register_state(state: Any) -> int:
    """The id by which compiled graphs name ``state`` (a hook's state, held weakly)."""
    state_id = next(_STATE_IDS)
    _STATES[state_id] = state
    return state_id


def _state(state_id: int, hook: str) -> Any:
    state = _STATES.get(state_id)
    if state is None:
        raise RuntimeError(
            f"{hook}: the state this graph was compiled with (id {state_id}) is gone"
        )
    return state


@torch.library.custom_op("compiled_hooks::group_rank", mutates_args=())
def group_rank(group_name: str, device: torch.device) -> torch.Tensor:
    """This rank's index in the group named ``group_name``, as ``int64[1]`` on ``device``."""
    group = compat.resolve_process_group(group_name)
    # a fill, no host-to-device copy
    return torch.full((1,), group.rank(), dtype=torch.int64, device=device)


@group_rank.register_fake
def _(group_name: str, device: torch.device) -> torch.Tensor:
    return torch.empty(1, dtype=torch.int64, device=device)


@torch.library.custom_op("compiled_hooks::powersgd_count", mutates_args=())
def powersgd_count(
    grad: torch.Tensor, state_id: int, slot: int, q_rows: int, q_cols: int
) -> torch.Tensor:
    """Count one hook call of ``slot`` for the PowerSGD state ``state_id`` and return the Q
    (``q_rows x q_cols``) this call starts from; empty for a call that does not compress.
    Returning Q ties the read of the state to this call's place in the graph."""
    return _state(state_id, "powerSGD_hook").count_call(slot, grad, q_rows, q_cols)


@powersgd_count.register_fake
def _(grad: torch.Tensor, state_id: int, slot: int, q_rows: int, q_cols: int) -> torch.Tensor:
    return grad.new_empty(q_rows, q_cols)


@torch.library.custom_op("compiled_hooks::powersgd_fold_error", mutates_args=("error",))
def powersgd_fold_error(error: torch.Tensor, grad: torch.Tensor) -> None:
    """``error += grad``, in place."""
    error.add_(grad)


# flexible_layout: it takes ``packed`` in whatever strides it comes (a bucket's columns), where
# Inductor would otherwise copy it into the strides it had when traced
@torch.library.custom_op(
    "compiled_hooks::dequantize_packed", mutates_args=(), tags=(torch.Tag.flexible_layout,)
)
def dequantize_packed(packed: torch.Tensor, block_size: int) -> torch.Tensor:
    """fp32 ``[rows, blocks, block_size]``: the values of the packed int8 rows ``packed``, each
    times its block's scale; ``packed`` in any strides."""
    return dequantize_packed_eager(packed, block_size)


@dequantize_packed.register_fake
def _(packed: torch.Tensor, block_size: int) -> torch.Tensor:
    rows, width = packed.shape
    return packed.new_empty(
        (rows, packed_blocks(width, block_size), block_size), dtype=torch.float32
    )


@torch.library.custom_op("compiled_hooks::check_ranks", mutates_args=())
def check_ranks(record: str) -> None:
    """Check ``record`` (JSON, see :mod:`passes.insert_rank_guard`) against the other ranks."""
    rank_guard.check(record)


@check_ranks.register_fake
def _(record: str) -> None:
    return None


GROUP_RANK = torch.ops.compiled_hooks.group_rank.default
POWERSGD_COUNT = torch.ops.compiled_hooks.powersgd_count.default
DEQUANTIZE_PACKED = torch.ops.compiled_hooks.dequantize_packed.default
CHECK_RANKS = torch.ops.compiled_hooks.check_ranks.default

# The count and the check matter even where nothing reads their results.
torch.fx.node.has_side_effect(POWERSGD_COUNT)
torch.fx.node.has_side_effect(CHECK_RANKS)
