"""The state of compile-native PowerSGD (:mod:`compiled_hooks.powersgd`), and the registry by
which a compiled graph names it (:meth:`PowerSGDState.of`).

The state is per parameter (the original keeps it per DDP bucket): error-feedback buffers and
warm-started Q are tensors that the compiled graph reads and writes, allocated when
compression starts, with Q drawn from ``torch.Generator(random_seed + 1_000_003 * slot)``:
the same on every rank. How the state follows the steps without the compiled graph
depending on the step number: every hook call runs a small custom op,
``compiled_hooks::powersgd_count``, whose Python implementation counts the calls when the
graph runs. A step ends when every parameter has had its call, which advances ``state.iter``;
at ``start_powerSGD_iter`` it allocates the buffers and sets ``state.compressing``, a Python
flag that the traced hook reads, so Dynamo recompiles the backward once, at the same step on
every rank. (The number of parameters per step is learnt in the first step, so with
``start_powerSGD_iter=1`` compression starts at step 2; every parameter must get a gradient
in every step, DDP's default.)
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.distributed as dist

from ..in_order import InOrder

__all__ = ["PowerSGDState", "Slot", "random_q", "should_compress"]


class Slot:
    """One parameter's compression state."""

    __slots__ = ["shape", "dtype", "device", "compress", "q_shape", "error", "q"]

    def __init__(self, grad: torch.Tensor, compress: bool, rank: int):
        self.shape, self.dtype, self.device, self.compress = (
            grad.shape,
            grad.dtype,
            grad.device,
            compress,
        )
        self.q_shape = self.q_shape_of(grad.shape, rank)
        self.error: torch.Tensor | None = None  # n x m, with error feedback
        self.q: torch.Tensor | None = None  # Q transposed (r x m), with warm start

    @staticmethod
    def q_shape_of(shape: torch.Size, rank: int) -> tuple[int, int]:
        """Shape of Q transposed (r x m)."""
        n, m = _matrix_shape(shape) or (0, 0)
        return min(n, m, rank), m


def _matrix_shape(shape: torch.Size) -> tuple[int, int] | None:
    if len(shape) == 0 or shape.numel() == 0:
        return None
    return shape[0], shape.numel() // shape[0]


def should_compress(
    shape: torch.Size, rank: int, min_compression_rate: float
) -> tuple[bool, int, int]:
    """(compress?, elements before, elements after) for a gradient of ``shape``, by the original's
    rule."""
    nm = _matrix_shape(shape)
    if nm is None:
        return False, shape.numel(), shape.numel()
    n, m = nm
    r = min(n, m, rank)
    return (n + m) * r * min_compression_rate < n * m, n * m, (n + m) * r


def random_q(
    seed: int, slot: int, step: int, shape: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """The Q a slot starts from at ``step``: standard normal (on the CPU) from a generator seeded
    by the state's seed, the slot and the step, so every rank draws the same."""
    g = torch.Generator().manual_seed(seed + 1_000_003 * slot + 7_919 * step)
    return torch.randn(shape, generator=g, dtype=dtype)


class PowerSGDState:
    """Hyperparameters and state of :func:`powerSGD_hook`; arguments as in
    ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState``.

    Args:
        process_group: the group to average over (``None``: the default group).
        matrix_approximation_rank: rank ``r`` of the approximation ``P Q^T`` (>= 1).
        start_powerSGD_iter: steps averaged uncompressed before compression starts; must be
            > 1 with error feedback or warm start, as in the original.
        min_compression_rate: compress a gradient only if it shrinks more than this (0 or
            below: every matrix).
        use_error_feedback: add each step's compression error to the next step's gradient.
        warm_start: start each step's power iteration from the last step's Q.
        orthogonalization_epsilon: added to each column's norm when orthogonalizing.
        random_seed: seed of the initial Q (the same on every rank).

    A state belongs to one DDP model (one set of parameters): a parameter it has not seen in
    the first step raises ``ValueError``. ``iter`` counts completed steps,
    ``compression_stats()`` reports the element counts as the original does.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
    ):
        if process_group is None:
            if not dist.is_initialized():
                raise RuntimeError(
                    "PowerSGDState: torch.distributed is not initialized and no process_group was "
                    "given"
                )
            process_group = dist.group.WORLD
        if not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                "PowerSGDState expects a torch.distributed.ProcessGroup, got "
                f"{type(process_group).__name__}."
            )
        for name, value in (
            ("matrix_approximation_rank", matrix_approximation_rank),
            ("start_powerSGD_iter", start_powerSGD_iter),
            ("random_seed", random_seed),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"PowerSGDState: {name} must be an int, got {value!r}")
        if matrix_approximation_rank < 1:
            raise ValueError(
                "PowerSGDState: matrix_approximation_rank must be >= 1, got "
                f"{matrix_approximation_rank}"
            )
        if start_powerSGD_iter < 0:
            raise ValueError(
                f"PowerSGDState: start_powerSGD_iter must be >= 0, got {start_powerSGD_iter}"
            )
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError(
                "PowerSGDState: start_powerSGD_iter must be > 1 with use_error_feedback or "
                "warm_start (the state is set up from the first steps' gradients), as in the "
                "original"
            )
        # Any number, with the original's meaning: a rate of 0 or below compresses every matrix.
        numbers: tuple[tuple[str, float], ...] = (
            ("min_compression_rate", min_compression_rate),
            ("orthogonalization_epsilon", orthogonalization_epsilon),
        )
        for name, number in numbers:
            if isinstance(number, bool) or not isinstance(number, (int, float)):
                raise TypeError(f"PowerSGDState: {name} must be a number, got {number!r}")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.random_seed = random_seed
        self.iter = 0
        self.compressing = start_powerSGD_iter == 0
        # parameter (or gradient) -> slot number, in first-call order
        self._slot_of: dict[torch.Tensor, int] = {}
        self._slots: dict[int, Slot] = {}
        self._per_step: int | None = None  # hook calls per step, known after the first step
        self._seen: set[int] = set()  # slots called in this step
        self.in_order = InOrder()  # the C++ reducer's form issues its collectives through it
        self.state_id = next(_IDS)  # how a compiled graph names this state (see of())
        _STATES[self.state_id] = self

    @staticmethod
    def of(state_id: int) -> PowerSGDState:
        """The live state a compiled graph names by ``state_id``."""
        state = _STATES.get(state_id)
        if state is None:
            raise RuntimeError(
                f"powerSGD_hook: the state this graph was compiled with (id {state_id}) is gone"
            )
        return state

    # -- the hook's interface -------------------------------------------------------------

    def slot_index(self, key: torch.Tensor) -> int:
        """The slot of the parameter (or gradient) ``key``, numbered in first-call order;
        ``ValueError`` for a new key once the first step has fixed the model's parameters."""
        slot = self._slot_of.get(key)
        if slot is None:
            if self._per_step is not None:
                raise ValueError(
                    f"powerSGD_hook: this PowerSGDState already serves a model of "
                    f"{self._per_step} parameters and was given another parameter; make one "
                    "PowerSGDState per DDP model."
                )
            slot = len(self._slot_of)
            self._slot_of[key] = slot
        return slot

    def slot(self, index: int) -> Slot | None:
        """The compression state of slot ``index``; None before its first counted call."""
        return self._slots.get(index)

    # run when the graph runs (see the module docstring)
    def count_call(self, slot: int, grad: torch.Tensor, q_rows: int, q_cols: int) -> torch.Tensor:
        """Count one hook call of ``slot`` and return the Q (``q_rows x q_cols``, empty when
        the call does not compress) it starts from; the step ends when every slot has had
        its call."""
        if slot not in self._slots:
            compress, _, _ = should_compress(
                grad.shape, self.matrix_approximation_rank, self.min_compression_rate
            )
            self._slots[slot] = Slot(grad, compress, self.matrix_approximation_rank)
        if slot in self._seen:  # a parameter's second call: a new step began
            if self._per_step is None:
                self._per_step = len(self._seen)
            self._step_done()
        s = self._slots[slot]
        if q_rows == 0:
            q = grad.new_empty(0, 0)
        elif s.q is not None:
            q = s.q.clone()
        else:
            q = self._random_qt(slot)
        self._seen.add(slot)
        if self._per_step is not None and len(self._seen) == self._per_step:
            self._step_done()
        return q

    def _random_qt(self, slot: int) -> torch.Tensor:
        s = self._slots[slot]
        r, m = s.q_shape
        return (
            random_q(self.random_seed, slot, self.iter, (m, r), s.dtype)
            .t()
            .contiguous()
            .to(s.device)
        )

    def _step_done(self) -> None:
        self._seen.clear()
        self.iter += 1
        if not self.compressing and self.iter >= self.start_powerSGD_iter:
            self._start_compressing()

    def _start_compressing(self) -> None:
        """Allocate the compressed slots' state (no graph reads it before the flag is set)."""
        for slot, s in self._slots.items():
            if not s.compress:
                continue
            if self.warm_start:
                s.q = self._random_qt(slot)
            if self.use_error_feedback:
                shape = _matrix_shape(s.shape)
                assert shape is not None, "a compressed gradient is a matrix"
                s.error = torch.zeros(shape, dtype=s.dtype, device=s.device)
        self.compressing = True

    def compression_stats(self) -> tuple[float, int, int]:
        """(rate, elements before, elements after compression) per step, as the original reports."""
        before = after = 0
        for s in self._slots.values():
            _, b, a = should_compress(
                s.shape, self.matrix_approximation_rank, self.min_compression_rate
            )
            before += b
            after += a if s.compress else b
        return (before / after if after else 0.0), before, after

    def __repr__(self) -> str:
        return (
            f"PowerSGDState(world_size={self.world_size}, "
            f"matrix_approximation_rank={self.matrix_approximation_rank}, "
            f"start_powerSGD_iter={self.start_powerSGD_iter}, iter={self.iter}, "
            f"compressing={self.compressing})"
        )


# every live state by its state_id, held weakly
_STATES: weakref.WeakValueDictionary[int, PowerSGDState] = weakref.WeakValueDictionary()
_IDS = itertools.count()
