"""The state of the int8 hook (:func:`compiled_hooks.int8.hook.int8_compress_hook`).

Error feedback keeps, per parameter, what quantization dropped, and adds it to the next step's
gradient. Two residuals per parameter (*parts*):

- ``WORKER``: this rank's gradient (plus its error) minus what it sent, shaped like the
  gradient;
- ``SHARD``: for the all-reduce form, the averaged shard this rank owns minus what it sent in
  the all-gather (the second quantization), ``[shard]``.

A parameter is named by a *key*, a string: its name where the adapter passes one
(``data_parallel``, FSDP2), else ``"id:<id(param)>"``, which Dynamo reads as a constant (a
dictionary of the state filled while tracing would make the second step recompile). The
residuals are tensors of the state, read and written when the hook runs: traced, through the
custom ops ``compiled_hooks::quantized_error`` / ``quantized_keep_error``
(:mod:`compiled_hooks.ops`), so a compiled graph needs no buffer of the state as an input and
is compiled once. A residual element that is not finite (its block held inf or nan, a step the
grad scaler skips) keeps the error it had before that step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import ops
from ..in_order import InOrder
from ..state import DefaultState
from .codec import BLOCK_SIZE, check_block_size

__all__ = ["QuantizedState", "WORKER", "SHARD"]

WORKER, SHARD = 0, 1


class QuantizedState(DefaultState):
    """State of :func:`~compiled_hooks.int8.hook.int8_compress_hook`.

    Args:
        process_group: the group to average over.
        bits: bits per value on the wire; 8 is the only width.
        block_size: values per fp32 scale (each block's absolute maximum maps to 127).
        error_feedback: add each step's quantization residual to the next step's gradient;
            the hook then needs ``param=`` (the adapters pass it).

    A state belongs to one model. ``state_dict()`` / ``load_state_dict()`` carry the residuals:
    a parameter is found again by its name where the adapter passes one (``data_parallel``,
    FSDP2), else by the order of the first calls, which is the same for the same model.
    """

    __slots__ = [
        "bits",
        "block_size",
        "error_feedback",
        "_shapes",
        "_errors",
        "_order",
        "_pending",
        "in_order",
        "state_id",
        "__weakref__",
    ]

    def __init__(
        self,
        process_group: dist.ProcessGroup,
        *,
        bits: int = 8,
        block_size: int = BLOCK_SIZE,
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
        self._shapes: dict[str, torch.Size] = {}  # key -> the gradient's shape
        self._errors: dict[tuple[str, int], torch.Tensor] = {}  # (key, part) -> residual
        self._order: list[str] = []  # the "id:" keys, in first-call order (for checkpoints)
        self._pending: dict[int, dict[int, torch.Tensor]] = {}  # loaded, for the i-th "id:" key
        # the hook's interface to this state (with read_error and keep_error below):
        self.in_order = InOrder()  # the C++ reducer's form issues its collectives through it
        self.state_id = ops.register_state(self)  # how a compiled graph names this state

    @staticmethod
    def key(param: object) -> str:
        """The key of ``param``: a name as it is, anything else by its ``id``."""
        return param if isinstance(param, str) else f"id:{id(param)}"

    # -- the hook's interface, run when the hook runs (through ops when traced) -------------

    def read_error(self, key: str, part: int, like: torch.Tensor, hook: str) -> torch.Tensor:
        """A copy of the residual, zeros before the first; ``ValueError`` if the ``WORKER``
        read finds a gradient of another shape than the key's earlier ones."""
        if part == WORKER:
            known = self._shapes.setdefault(key, like.shape)
            if known != like.shape:
                raise ValueError(
                    f"{hook}: gradient of shape {tuple(like.shape)} for a parameter whose "
                    f"gradient had shape {tuple(known)}; make one QuantizedState per model."
                )
            if key.startswith("id:") and key not in self._order:
                self._order.append(key)
                for p, t in self._pending.pop(len(self._order) - 1, {}).items():
                    self._errors[(key, p)] = t
        kept = self._errors.get((key, part))
        if kept is None or kept.shape != like.shape:
            return torch.zeros_like(like)
        return kept.to(like.device, like.dtype, copy=True)

    def keep_error(self, key: str, part: int, residual: torch.Tensor) -> None:
        """Keep ``residual`` (copied) as the error of ``(key, part)``."""
        kept = self._errors.get((key, part))
        if kept is None or kept.shape != residual.shape:
            self._errors[(key, part)] = residual.detach().clone()
        else:
            kept.copy_(residual)

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The residuals: ``errors`` maps a parameter's name, or ``"#i"`` for the ``i``-th
        parameter the hook was called with first (no name given), to ``{part: tensor}``."""
        errors: dict[str, dict[int, torch.Tensor]] = {}
        for (key, part), t in self._errors.items():
            name = f"#{self._order.index(key)}" if key.startswith("id:") else key
            errors.setdefault(name, {})[part] = t.clone()
        return {"bits": self.bits, "block_size": self.block_size, "errors": errors}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the residuals of :meth:`state_dict`; ``block_size`` must match (a residual is
        the error of one block layout). ``"#i"`` entries go to the ``i``-th parameter this
        state is called with first: the same model calls in the same order."""
        if state_dict["block_size"] != self.block_size:
            raise ValueError(
                f"QuantizedState.load_state_dict: block_size {state_dict['block_size']} in the "
                f"checkpoint, {self.block_size} in this state"
            )
        self._errors, self._order, self._pending = {}, [], {}
        for name, parts in state_dict["errors"].items():
            if name.startswith("#"):
                self._pending[int(name[1:])] = {p: t.clone() for p, t in parts.items()}
            else:
                for p, t in parts.items():
                    self._errors[(name, p)] = t.clone()

    def __repr__(self) -> str:
        return (
            f"QuantizedState(world_size={self.world_size}, bits={self.bits}, "
            f"block_size={self.block_size}, error_feedback={self.error_feedback})"
        )
