"""PowerSGD's custom ops (namespace ``compiled_hooks``), registered on import.

* ``powersgd_count(grad, state_id, slot, q_rows, q_cols) -> Q``: counts one hook call when the
  graph runs and returns the Q its power iteration starts from (a graph names its state by
  :attr:`.state.PowerSGDState.state_id`). Has a side effect: never dead-code eliminated, and
  ``passes.bucket_low_rank_factors`` finds the factors' all-reduces by its use.
* ``powersgd_fold_error(error!, grad)``: ``error += grad`` in place, declared as mutating
  ``error`` so that Inductor writes into the error buffer instead of a fresh one.
"""

from __future__ import annotations

import torch

from .state import PowerSGDState

__all__ = ["powersgd_count", "powersgd_fold_error", "POWERSGD_COUNT"]


@torch.library.custom_op("compiled_hooks::powersgd_count", mutates_args=())
def powersgd_count(
    grad: torch.Tensor, state_id: int, slot: int, q_rows: int, q_cols: int
) -> torch.Tensor:
    """Count one hook call of ``slot`` for the PowerSGD state ``state_id`` and return the Q
    (``q_rows x q_cols``) this call starts from; empty for a call that does not compress.
    Returning Q ties the read of the state to this call's place in the graph."""
    return PowerSGDState.of(state_id).count_call(slot, grad, q_rows, q_cols)


@powersgd_count.register_fake
def _(grad: torch.Tensor, state_id: int, slot: int, q_rows: int, q_cols: int) -> torch.Tensor:
    return grad.new_empty(q_rows, q_cols)


@torch.library.custom_op("compiled_hooks::powersgd_fold_error", mutates_args=("error",))
def powersgd_fold_error(error: torch.Tensor, grad: torch.Tensor) -> None:
    """``error += grad``, in place."""
    error.add_(grad)


POWERSGD_COUNT = torch.ops.compiled_hooks.powersgd_count.default

# The count matters even where nothing reads its result.
torch.fx.node.has_side_effect(POWERSGD_COUNT)
