"""The state of the int8 hook (:func:`compiled_hooks.quantized.int8_compress_hook`).

Error feedback keeps, per parameter (a *slot*, numbered in first-call order), what quantization
dropped, and adds it to the next step's gradient. Two residuals per slot (*parts*):

- ``WORKER``: this rank's gradient (plus its error) minus what it sent, shaped like the
  gradient;
- ``SHARD``: for the all-reduce form, the averaged shard this rank owns minus what it sent in
  the all-gather (the second quantization), ``[shard]``.

The residuals are tensors of the state, read and written when the hook runs: traced, through
the custom ops ``compiled_hooks::quantized_error`` / ``quantized_keep_error``
(:mod:`compiled_hooks.ops`), so a compiled graph needs no buffer of the state as an input and
is compiled once. A residual element that is not finite (its block held inf or nan, a step the
grad scaler skips) keeps the error it had before that step.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
import torch.distributed as dist

from . import ops
from .in_order import InOrder
from .quantize import check_block_size
from .state import DefaultState

__all__ = ["QuantizedState", "WORKER", "SHARD"]

WORKER, SHARD = 0, 1


class QuantizedState(DefaultState):
    """State of :func:`~compiled_hooks.quantized.int8_compress_hook`.

    Args:
        process_group: the group to average over.
        bits: bits per value on the wire; 8 is the only width.
        block_size: values per fp32 scale (each block's absolute maximum maps to 127).
        error_feedback: add each step's quantization residual to the next step's gradient;
            the hook then needs ``param=`` (the adapters pass it).

    A state belongs to one model. ``state_dict()`` / ``load_state_dict()`` carry the residuals:
    a slot's parameter is found again by its name where the adapter keys by name
    (``data_parallel``), else by the order of the first calls, which is the same for the same
    model.
    """

    __slots__ = [
        "bits",
        "block_size",
        "error_feedback",
        "_slot_of",
        "_shapes",
        "_errors",
        "_in_order",
        "_id",
        "__weakref__",
    ]

    def __init__(
        self,
        process_group: dist.ProcessGroup,
        *,
        bits: int = 8,
        block_size: int = 256,
        error_feedback: bool = True,
    ):
        super().__init__(process_group)
        if isinstance(bits, bool) or bits != 8:
            raise ValueError(f"QuantizedState: bits must be 8 (int8 on the wire), got {bits!r}")
        self.bits = 8
        self.block_size = check_block_size("QuantizedState", block_size)
        if not isinstance(error_feedback, bool):
            raise TypeError(
                f"QuantizedState: error_feedback must be a bool, got {error_feedback!r}"
            )
        self.error_feedback = error_feedback
        self._slot_of: dict[Hashable, int] = {}
        self._shapes: dict[int, torch.Size] = {}
        self._errors: dict[tuple[int, int], torch.Tensor] = {}
        self._in_order = InOrder()  # the C++ reducer's form issues its collectives through it
        self._id = ops.register_state(self)

    def _slot(self, key: Hashable, shape: torch.Size, hook: str) -> int:
        """The slot of ``key`` (a parameter, or a name), checked against its gradient's shape."""
        slot = self._slot_of.get(key)
        if slot is None:
            slot = self._slot_of[key] = len(self._slot_of)
        known = self._shapes.setdefault(slot, shape)
        if known != shape:
            raise ValueError(
                f"{hook}: gradient of shape {tuple(shape)} for a parameter whose gradient had "
                f"shape {tuple(known)}; make one QuantizedState per model."
            )
        return slot

    def _bucket_slot(self, index: int) -> int:
        """The slot of a DDP bucket (the C++ reducer's shard residual); no shape to check."""
        key = ("bucket", index)
        slot = self._slot_of.get(key)
        if slot is None:
            slot = self._slot_of[key] = len(self._slot_of)
        return slot

    # -- run when the hook runs (through ops when traced) ----------------------------------

    def _error(self, slot: int, part: int, like: torch.Tensor) -> torch.Tensor:
        kept = self._errors.get((slot, part))
        if kept is None or kept.shape != like.shape:
            return torch.zeros_like(like)
        return kept.to(like.device, like.dtype, copy=True)

    def _keep_error(self, slot: int, part: int, residual: torch.Tensor) -> None:
        kept = self._errors.get((slot, part))
        if kept is None or kept.shape != residual.shape:
            self._errors[(slot, part)] = residual.detach().clone()
        else:
            kept.copy_(residual)

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The residuals (``errors``: ``"slot.part"`` -> tensor) and each slot's name where it was
        keyed by one (``names``: slot -> str)."""
        return {
            "bits": self.bits,
            "block_size": self.block_size,
            "error_feedback": self.error_feedback,
            "errors": {f"{s}.{p}": t.clone() for (s, p), t in self._errors.items()},
            "names": {s: k for k, s in self._slot_of.items() if isinstance(k, str)},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the residuals of :meth:`state_dict`; ``block_size`` must match (a residual is
        the error of one block layout)."""
        if state_dict["block_size"] != self.block_size:
            raise ValueError(
                f"QuantizedState.load_state_dict: block_size {state_dict['block_size']} in the "
                f"checkpoint, {self.block_size} in this state"
            )
        errors = {}
        for name, t in state_dict["errors"].items():
            slot, part = (int(x) for x in name.split("."))
            errors[(slot, part)] = t.clone()
        self._errors = errors
        self._slot_of = {k: s for k, s in self._slot_of.items() if not isinstance(k, str)}
        for slot, key in state_dict["names"].items():
            self._slot_of[key] = int(slot)

    def __repr__(self) -> str:
        return (
            f"QuantizedState(world_size={self.world_size}, bits={self.bits}, "
            f"block_size={self.block_size}, error_feedback={self.error_feedback})"
        )
