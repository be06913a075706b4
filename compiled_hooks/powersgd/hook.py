"""PowerSGD gradient compression (Vogels et al., NeurIPS 2019), compile-native.

Same names, hyperparameters and algorithm as
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``; what differs is how it is
built: every collective is a functional collective and every result is written back with
``copy_``, so compiled autograd traces the hook into the compiled backward with no graph
break, and :mod:`passes` bucket the small P and Q all_reduces of many parameters.

Per gradient ``M`` (viewed as ``n x m``, ``n = grad.shape[0]``), once compression has started
and when ``(n + m) * r * min_compression_rate < n * m`` (``r`` = the approximation rank)::

    M = M + error                       (use_error_feedback)
    Q = orthogonalize(Q)                (Q: the last step's, if warm_start, else a new random one)
    P = all_reduce(M @ Q, sum); P = orthogonalize(P)
    Q = all_reduce(M.T @ P, sum) / N
    grad = P @ Q.T;  error = M - P @ Q.T;  keep Q  (warm_start)

Every other gradient (vectors, small matrices), and every gradient before
``start_powerSGD_iter``, is averaged uncompressed, as in the original.

The state (:class:`PowerSGDState`, per parameter, and how it follows the steps without the
compiled graph depending on the step number) is in :mod:`.state`, its custom ops in :mod:`.ops`.

Where this differs from the original, by design:

* Gram-Schmidt orthogonalization for every rank (the original uses QR above rank 2), batched
  over the matrices of one shape where several are at hand (:func:`orthogonalize`): the
  columns may differ in sign, which ``P @ Q.T`` does not see.
* A column of zeros stays zero (with ``orthogonalization_epsilon=0`` the original divides by
  zero and fills the gradient with NaN).
* Error feedback only for the compressed gradients. The original also keeps
  ``local - average`` for the uncompressed ones in its bucket-wide error, which averages to
  zero across ranks: the averaged gradients differ by rounding only.
* The random Q come from ``torch.Generator`` seeded per parameter, not from numpy (not a
  dependency), so the two implementations start from different Q.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fcol

from .. import validation
from ..hook_kind import give_reduce_async
from . import ops
from .state import PowerSGDState, Slot, should_compress

__all__ = ["orthogonalize", "powerSGD_hook", "reduce_bucket_async"]


def orthogonalize(matrix: torch.Tensor, epsilon: float = 0.0, dim: int = 1) -> torch.Tensor:
    """Gram-Schmidt on the columns (``dim=1``) or rows (``dim=0``) of ``matrix``, functional: a
    new contiguous tensor whose columns (rows) are orthonormal. A vector that is zero, or in
    the span of the ones before it, becomes zero; ``epsilon`` is added to every norm.

    Leading dimensions are a batch: each matrix is orthogonalized on its own, with the same
    values as alone (dot products as ``(u * v).sum(-1)``, a row-wise reduction that does not
    depend on the batch; bit for bit on CPU, checked by ``tests/hooks/test_powersgd.py`` and,
    end to end, ``tests/hooks/test_reducer_hooks.py``), so many matrices of one shape cost one
    matrix's ops."""
    vectors = matrix.unbind(-2 if dim == 0 else -1)
    out: list[torch.Tensor] = []
    for v in vectors:
        for u in out:
            v = v - (u * v).sum(-1, keepdim=True) * u
        norm = torch.linalg.vector_norm(v, dim=-1, keepdim=True)
        out.append(
            v / (norm + epsilon)
            if epsilon
            else torch.where(norm > 0, v / norm, torch.zeros_like(v))
        )
    return torch.stack(out, -2 if dim == 0 else -1)


def _orthogonalize_each(
    matrices: list[torch.Tensor], epsilon: float, dim: int
) -> list[torch.Tensor]:
    """:func:`orthogonalize` of every matrix; those of one shape and dtype in one batch."""
    groups: dict[tuple, list[int]] = {}
    for i, m in enumerate(matrices):
        groups.setdefault((m.shape, m.dtype, m.device), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(matrices)
    for members in groups.values():
        if len(members) == 1:
            out[members[0]] = orthogonalize(matrices[members[0]], epsilon, dim)
        else:
            batch = orthogonalize(torch.stack([matrices[i] for i in members]), epsilon, dim)
            for i, o in zip(members, batch.unbind(0)):
                out[i] = o
    return out  # type: ignore[return-value]


def _fold_error(error: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``M = grad + error``, stored in the error buffer, which is returned.

    Traced, a plain ``error.add_(grad)`` is functionalized: M gets a new ``n x m`` buffer (the
    copy back into ``error`` comes last) that lives, with the gradient it was made from, until
    Q's all_reduce has returned, for every compressed parameter at once. An op declared as
    mutating ``error`` is reinplaced by Inductor onto the error buffer; the gradient's buffer
    is then free right away and reused for the next parameter's gradient, so no step writes
    into freshly allocated (page-faulting) memory."""
    if torch.compiler.is_compiling():
        ops.powersgd_fold_error(error, grad)
    else:
        error.add_(grad)
    return error


UNROLLED_RANK = 8


def _total(tensors: list[torch.Tensor]) -> torch.Tensor:
    out = tensors[0]
    for t in tensors[1:]:
        out = out + t
    return out


def _low_rank_products(p: torch.Tensor, qt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``P Q^T`` twice: for the new error and for the gradient (``p``: ``n x r``, ``qt``:
    ``r x m``).

    Eager, one GEMM. Traced, for ``r <= UNROLLED_RANK``, sums of ``r`` outer products, which are
    pointwise, so Inductor computes each inside the kernel that writes the error or the gradient
    and the ``n x m`` product is never stored; two expressions, summed in opposite orders so
    that CSE does not merge them, because Inductor stores a pointwise result that has two
    readers and more than 4 inputs. The gradient's is computed from the all-reduced factors
    only, so it is the same on every rank (``M - new error`` would not be, bit for bit)."""
    r = p.shape[1]
    if not torch.compiler.is_compiling() or r > UNROLLED_RANK:
        approx = p @ qt
        return approx, approx
    terms = [p[:, k : k + 1] * qt[k : k + 1] for k in range(r)]
    return _total(terms), _total(terms[::-1])


AVERAGE, SUM, LOW_RANK = "average", "sum", "low rank"  # how a call reduces its gradient


class _Call:
    """One gradient's hook call between the halves around its collectives. ``kind``: before
    compression starts, ``AVERAGE`` (``all_reduce(grad / N)``); a gradient not worth compressing,
    ``SUM`` (``all_reduce(grad) / N``); else ``LOW_RANK``, with ``m`` (the gradient as a matrix,
    plus the error), ``q0`` (the starting Q, transposed: r x m), ``q_hat`` (Q orthogonalized, set
    by :func:`_p_locals`) and the slot's buffers."""

    __slots__ = ["grad", "kind", "m", "q0", "q_hat", "error", "warm_q"]

    def __init__(
        self,
        grad: torch.Tensor,
        kind: str,
        m: torch.Tensor | None = None,
        q0: torch.Tensor | None = None,
        error: torch.Tensor | None = None,
        warm_q: torch.Tensor | None = None,
    ):
        self.grad, self.kind, self.m, self.q0, self.error, self.warm_q = (
            grad,
            kind,
            m,
            q0,
            error,
            warm_q,
        )
        self.q_hat: torch.Tensor | None = None


def _begin(
    state: PowerSGDState, grad: torch.Tensor, param: torch.Tensor | None, eager: bool = False
) -> _Call:
    """Before the first collective: checks, the call's count, ``M`` (the error folded in) and
    the starting ``Q``. ``eager``: never traced (the C++ reducer's form), so the count needs no
    custom op."""
    name = "powerSGD_hook"
    if not isinstance(state, PowerSGDState):
        raise TypeError(f"{name}: state must be a PowerSGDState, got {type(state).__name__}.")
    validation.check_tensor(name, "grad", grad)
    slot = state.slot_index(grad if param is None else param)
    compressing = state.compressing  # read first: this very call may switch compression on
    compress, _, _ = should_compress(
        grad.shape, state.matrix_approximation_rank, state.min_compression_rate
    )
    s = state.slot(slot)  # None only in the first step
    if s is not None and grad.shape != s.shape:
        raise ValueError(
            f"{name}: gradient of shape {tuple(grad.shape)} for a parameter whose gradient had "
            f"shape {tuple(s.shape)}"
        )
    q_shape = (
        Slot.q_shape_of(grad.shape, state.matrix_approximation_rank)
        if compressing and compress
        else (0, 0)
    )
    if eager:  # what the op runs, without its dispatch
        q0 = state.count_call(slot, grad, *q_shape)
    else:  # traced, the count must happen when the graph runs
        q0 = ops.powersgd_count(grad, state.state_id, slot, *q_shape)
    if not compressing:
        return _Call(grad, AVERAGE)
    if not compress:
        return _Call(grad, SUM)
    error = s.error if s is not None else None
    local = grad.reshape(grad.shape[0], -1)
    m = local if error is None else _fold_error(error, local)
    return _Call(grad, LOW_RANK, m, q0, error, s.q if s is not None else None)


def _set(t: torch.Tensor | None) -> torch.Tensor:
    """A ``LOW_RANK`` call's tensor, set by the time it is read."""
    assert t is not None, "read before it was set"
    return t


def _p_locals(state: PowerSGDState, calls: list[_Call]) -> list[torch.Tensor]:
    """This rank's ``P = M Q`` of every call, to be summed over the ranks; ``Q`` orthogonalized
    first (the calls' Q of one shape in one batch)."""
    q_hats = _orthogonalize_each(
        [_set(c.q0) for c in calls], state.orthogonalization_epsilon, dim=0
    )
    for c, q_hat in zip(calls, q_hats):
        c.q_hat = q_hat.t()
    return [_set(c.m) @ _set(c.q_hat) for c in calls]


def _q_locals(
    state: PowerSGDState, calls: list[_Call], p_sums: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(P, this rank's Q^T)`` of every call from its summed ``P``: ``P`` orthogonalized (those of
    one shape in one batch), ``Q^T = P^T M``.

    Q is kept transposed (r x m) and computed from ``P^T`` made contiguous, so both products are
    row-major GEMMs over M (a GEMM through a transposed view is far slower)."""
    ps = _orthogonalize_each(p_sums, state.orthogonalization_epsilon, dim=1)
    return ps, [p.t().contiguous() @ _set(c.m) for c, p in zip(calls, ps)]


def _finish(state: PowerSGDState, call: _Call, p: torch.Tensor, qt_sum: torch.Tensor) -> None:
    """After the last collective: ``grad = P Q^T`` with ``Q`` averaged; the error and warm Q
    kept."""
    qt = qt_sum / state.world_size
    approx_for_error, approx = _low_rank_products(p, qt)
    if call.error is not None:
        call.error.sub_(approx_for_error)
    if call.warm_q is not None:
        call.warm_q.copy_(qt)
    call.grad.copy_(approx.view_as(call.grad))


def powerSGD_hook(
    state: PowerSGDState, grad: torch.Tensor, *, param: torch.Tensor | None = None
) -> None:
    """Average ``grad`` across ``state.process_group`` in place, PowerSGD-compressed once
    ``state.start_powerSGD_iter`` steps are done (see the module docstring).

    ``param`` is the parameter ``grad`` belongs to (DDP's adapter :func:`ddp_comm_hook` passes
    it): the state is kept per parameter. Called without it, the state is kept per ``grad``
    tensor, which must then be the same tensor every step.

    ``powerSGD_hook.reduce_async(state, bucket)`` is its form for DDP's C++ reducer
    (:func:`reduce_bucket_async`).
    """
    call = _begin(state, grad, param)
    group, n_ranks = state.process_group, state.world_size
    if call.kind == AVERAGE:
        grad.copy_(fcol.all_reduce(grad / n_ranks, "sum", group))
    elif call.kind == SUM:
        grad.copy_(fcol.all_reduce(grad, "sum", group) / n_ranks)
    else:
        (p_local,) = _p_locals(state, [call])
        (p,), (qt,) = _q_locals(state, [call], [fcol.all_reduce(p_local, "sum", group)])
        _finish(state, call, p, fcol.all_reduce(qt, "sum", group))


def _all_reduce_async(state: PowerSGDState, flat: torch.Tensor) -> torch.futures.Future[Any]:
    return dist.all_reduce(
        flat, dist.ReduceOp.SUM, group=state.process_group, async_op=True
    ).get_future()


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflat(flat: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    return [
        part.view(shape) for part, shape in zip(flat.split([math.prod(s) for s in shapes]), shapes)
    ]


def reduce_bucket_async(state: PowerSGDState, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """:func:`powerSGD_hook` on every gradient of a DDP ``GradBucket``, with async collectives:
    the C++ reducer's form, which returns a future of the bucket's buffer at once.

    Each of the bucket's gradients gets :func:`powerSGD_hook`'s computation, from the same
    halves, with the same values (the orthogonalizations of one shape run as one batch); the
    collectives are batched per bucket, as torch's hook does::

        before compression:  all_reduce(buffer / N)
        compressing:         U = all_reduce(cat(uncompressed)) / N
                             P = all_reduce(cat(M Q))  -> orthogonalize -> Q^T = P^T M
                             Q = all_reduce(cat(Q^T))  -> grad = P Q^T / N  (continuations)

    The Q all_reduce is issued from P's continuation, in an order fixed when the hook is called
    (:class:`~compiled_hooks.in_order.InOrder`: U_k, P_k, Q_k, then bucket k+1's), so every rank
    issues the same sequence. Every check and every count runs before the first collective."""
    calls = [
        _begin(state, g, p, eager=True) for g, p in zip(bucket.gradients(), bucket.parameters())
    ]
    buffer, order = bucket.buffer(), state.in_order
    if all(c.kind == AVERAGE for c in calls):  # the gradients are views of the whole buffer
        slot = order.reserve()
        return order.fill(
            slot, lambda: _all_reduce_async(state, buffer.div_(state.world_size))
        ).then(lambda _: buffer)
    plain = [c for c in calls if c.kind == SUM]
    low = [c for c in calls if c.kind == LOW_RANK]
    u_slot = order.reserve() if plain else None
    p_slot, q_slot = (order.reserve(), order.reserve()) if low else (None, None)
    waits: list[torch.futures.Future[Any]] = []
    if u_slot is not None:
        u = _flat([c.grad for c in plain])

        def unpack_u(fut: torch.futures.Future[Any]) -> None:
            summed = fut.value()[0].div_(state.world_size)
            for c, part in zip(plain, _unflat(summed, [tuple(c.grad.shape) for c in plain])):
                c.grad.copy_(part)

        waits.append(order.fill(u_slot, lambda: _all_reduce_async(state, u)).then(unpack_u))
    if p_slot is not None and q_slot is not None:
        p_flat = _flat(_p_locals(state, low))
        p_shapes = [(_set(c.m).shape[0], _set(c.q_hat).shape[1]) for c in low]  # n x r
        q_shapes = [(_set(c.q_hat).shape[1], _set(c.m).shape[1]) for c in low]  # r x m
        ps: list[torch.Tensor] = []

        def compute_q(fut: torch.futures.Future[Any]) -> None:
            try:
                p_list, qts = _q_locals(state, low, _unflat(fut.value()[0], p_shapes))
                ps.extend(p_list)
                q_flat = _flat(qts)
            except Exception as e:  # the slot must be filled, or every later slot waits forever
                order.fill(q_slot, functools.partial(_failed, e))
                raise
            order.fill(q_slot, lambda: _all_reduce_async(state, q_flat))

        def decompress(fut: torch.futures.Future[Any]) -> None:
            for c, p, qt in zip(low, ps, _unflat(fut.value()[0], q_shapes)):
                _finish(state, c, p, qt)

        order.fill(p_slot, lambda: _all_reduce_async(state, p_flat)).then(compute_q)
        waits.append(q_slot.future.then(decompress))

    def result(fut: torch.futures.Future[list[torch.futures.Future[Any]]]) -> torch.Tensor:
        for f in fut.value():
            f.value()  # raises what a collective or a continuation raised
        return buffer

    return torch.futures.collect_all(waits).then(result)


def _failed(error: Exception) -> torch.futures.Future[Any]:
    raise error


give_reduce_async(powerSGD_hook, reduce_bucket_async)
