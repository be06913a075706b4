"""The state of the int8 hook (:func:`compiled_hooks.int8.hook.int8_compress_hook`).

Error feedback keeps, per parameter, what quantization dropped, and adds it to the next step's
gradient. Two residuals per parameter (*parts*):

- ``WORKER``: this rank's gradient (plus its error) minus what it sent, as the gradient's
  values;
- ``SHARD``: for the all-reduce form, the averaged shard this rank owns minus what it sent in
  the all-gather (the second quantization), ``[shard]``.

A parameter is named by a *key*, a string: its name where the adapter passes one
(``data_parallel``, FSDP2), else ``"id:<id(param)>"``, which Dynamo reads as a constant.

The residuals are fp32 tensors of the state that the hook reads and updates in place
(:meth:`QuantizedState.residual`), like an optimizer's state, held in the layout the hook
quantizes in: the rows that travel to each rank, cut into blocks
(:func:`~compiled_hooks.int8.codec.to_row_blocks`: ``[world_size, blocks, block_size]`` for
``WORKER``, ``[1, blocks, block_size]`` for ``SHARD``). A compiled graph takes them as inputs
and writes each back with a ``copy_`` of the same shape as the value it computes, so Inductor
writes the residual from the loop that quantizes (``passes.hoist_input_writebacks`` moves the
write-back next to it). The hook creates a residual the first time it meets its key; traced,
that creation is a side effect of the first graph, so the second step compiles once more, with
the residuals as inputs. Where a trace cannot create one (an ``autograd.Function``'s backward
under ``torch.compile``: ``data_parallel``), :meth:`QuantizedState.prepare` creates them before.
A residual element that is not finite (its block held inf or nan, a step the grad scaler skips)
keeps the error it had before that step. Checkpoints hold the residuals as values: the
gradient's shape, and ``[shard]``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..in_order import InOrder
from ..state import DefaultState
from .codec import BLOCK_SIZE, check_block_size, from_row_blocks, row_length, to_row_blocks

__all__ = ["QuantizedState", "WORKER", "SHARD"]

WORKER, SHARD = 0, 1
Slot = tuple[str, int]  # (key, part)


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A checkpoint's residual as this state keeps one: its own contiguous fp32 copy."""
    return t.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)


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
        "_errors",
        "_shapes",
        "_loaded",
        "_order",
        "_pending",
        "in_order",
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
        self._errors: dict[Slot, torch.Tensor] = {}  # the residuals, in the hook's layout
        self._shapes: dict[Slot, torch.Size] = {}  # the shape of each residual's values
        self._loaded: dict[Slot, torch.Tensor] = {}  # a checkpoint's values, for slots to come
        self._order: list[str] = []  # the "id:" keys, in first-call order (for checkpoints)
        self._pending: dict[int, dict[int, torch.Tensor]] = {}  # loaded, for the i-th "id:" key
        # the C++ reducer's form issues its collectives through it
        self.in_order = InOrder()

    @staticmethod
    def key(param: object) -> str:
        """The key of ``param``: a name as it is, anything else by its ``id``."""
        return param if isinstance(param, str) else f"id:{id(param)}"

    # -- the hook's interface -------------------------------------------------------------

    def residual(
        self, key: str, part: int, shape: torch.Size, device: torch.device, hook: str
    ) -> torch.Tensor:
        """The residual of ``(key, part)`` itself, for values of ``shape`` (the gradient's, or
        ``[shard]``), on ``device``, in the hook's layout (the module docstring), for the hook
        to read and update in place: zeros the first time, a checkpoint's values after
        :meth:`load_state_dict`. ``ValueError`` if a ``WORKER`` residual was made for another
        shape (another model's gradient); a ``SHARD`` residual of another shape starts again
        from zeros (a C++-reducer bucket whose size changed)."""
        slot = (key, part)
        if part == WORKER and key.startswith("id:") and key not in self._order:
            self._order.append(key)
            for p, t in self._pending.pop(len(self._order) - 1, {}).items():
                self._loaded[(key, p)] = t
        kept = self._errors.get(slot)
        if kept is not None and self._shapes[slot] != shape:
            if part == WORKER:
                raise ValueError(
                    f"{hook}: gradient of shape {tuple(shape)} for a parameter whose residual "
                    f"was made for shape {tuple(self._shapes[slot])}; make one QuantizedState "
                    "per model."
                )
            kept = None
        if kept is None:
            values = self._loaded.get(slot)
            if values is None:
                kept = self._zeros(part, shape, device)
            elif values.numel() != shape.numel():  # refused, the checkpoint's values kept
                raise ValueError(
                    f"{hook}: the checkpoint's residual for {key!r} holds {values.numel()} "
                    f"values, its gradient {shape.numel()}"
                )
            else:
                kept = self._blocks(part, self._loaded.pop(slot).to(device)).contiguous()
            self._errors[slot], self._shapes[slot] = kept, shape
        elif kept.device != device:
            kept = self._errors[slot] = kept.to(device)
        return kept

    def for_group(self, process_group: dist.ProcessGroup) -> QuantizedState:
        return QuantizedState(
            process_group,
            bits=self.bits,
            block_size=self.block_size,
            error_feedback=self.error_feedback,
        )

    def prepare(
        self, key: str, shape: torch.Size, device: torch.device, *, reduce_scatter: bool
    ) -> None:
        """Create the residuals the hook will use for gradients of ``shape`` under ``key`` (zeros,
        or a loaded checkpoint's), for a caller whose hook is traced where it cannot create them;
        ``reduce_scatter``: the hook is called with ``output`` (no ``SHARD`` residual)."""
        if not self.error_feedback:
            return
        self.residual(key, WORKER, shape, device, "QuantizedState.prepare")
        if not reduce_scatter:
            shard = torch.Size([row_length(shape.numel(), self.world_size)])
            self.residual(key, SHARD, shard, device, "QuantizedState.prepare")

    def _rows(self, part: int) -> int:
        return self.world_size if part == WORKER else 1

    def _blocks(self, part: int, values: torch.Tensor) -> torch.Tensor:
        """``values`` in the hook's layout for ``part``."""
        return to_row_blocks(values.float(), self._rows(part), self.block_size)

    def _zeros(self, part: int, shape: torch.Size, device: torch.device) -> torch.Tensor:
        """Zeros for gradients of ``shape`` in the hook's layout for ``part``, made in it rather
        than padded into it: traced, a pad of a constant is a masked load of a constant, which
        Inductor 2.11's C++ backend fails to compile."""
        rows = self._rows(part)
        blocks = -(-row_length(shape.numel(), rows) // self.block_size)
        return torch.zeros(rows, blocks, self.block_size, device=device)

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The residuals as values (the gradient's shape, ``[shard]``): ``errors`` maps a
        parameter's name, or ``"#i"`` for the ``i``-th parameter the hook was called with
        first (no name given), to ``{part: tensor}``. A loaded residual not used yet is
        included."""
        values = {slot: from_row_blocks(t, self._shapes[slot]) for slot, t in self._errors.items()}
        values.update(self._loaded)
        errors: dict[str, dict[int, torch.Tensor]] = {}
        for (key, part), t in values.items():
            name = f"#{self._order.index(key)}" if key.startswith("id:") else key
            errors.setdefault(name, {})[part] = t.clone()
        for i, parts in self._pending.items():
            errors[f"#{i}"] = {p: t.clone() for p, t in parts.items()}
        return {"bits": self.bits, "block_size": self.block_size, "errors": errors}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the residuals of :meth:`state_dict`; ``block_size`` must match (a residual is
        the error of one block layout). ``"#i"`` entries go to the ``i``-th parameter this
        state is called with first: the same model calls in the same order. A residual this
        state already has takes the checkpoint's values in place (zeros where the checkpoint
        has none): the tensors stay those a compiled graph was traced with. ``ValueError``,
        before anything changes, for a residual of another size than this state's."""
        if state_dict["block_size"] != self.block_size:
            raise ValueError(
                f"QuantizedState.load_state_dict: block_size {state_dict['block_size']} in the "
                f"checkpoint, {self.block_size} in this state"
            )
        loaded: dict[Slot, torch.Tensor] = {}
        pending: dict[int, dict[int, torch.Tensor]] = {}
        for name, parts in state_dict["errors"].items():
            if not name.startswith("#"):
                loaded.update(((name, p), _copy(t)) for p, t in parts.items())
            elif int(name[1:]) < len(self._order):
                key = self._order[int(name[1:])]
                loaded.update(((key, p), _copy(t)) for p, t in parts.items())
            else:
                pending[int(name[1:])] = {p: _copy(t) for p, t in parts.items()}
        for slot in self._errors.keys() & loaded.keys():
            if loaded[slot].numel() != self._shapes[slot].numel():
                raise ValueError(
                    f"QuantizedState.load_state_dict: the residual of {slot[0]!r} (part "
                    f"{slot[1]}) holds {loaded[slot].numel()} values in the checkpoint, "
                    f"{self._shapes[slot].numel()} in this state"
                )
        for slot, kept in self._errors.items():
            new = loaded.pop(slot, None)
            if new is None:
                kept.zero_()
            else:
                kept.copy_(self._blocks(slot[1], new))
        self._loaded, self._pending = loaded, pending

    def __repr__(self) -> str:
        return (
            f"QuantizedState(world_size={self.world_size}, bits={self.bits}, "
            f"block_size={self.block_size}, error_feedback={self.error_feedback})"
        )
