"""What this machine allows a step: the references behind the benchmarks' "vs achievable" column.

A step that overlaps its communication with its compute fully takes the larger of
- its collectives alone: the same collectives (recorded by the profiler from one step) issued
  back to back with nothing else, the time gloo needs for them here (:func:`replay_ms`);
- its compute while the wire is busy: the compute alone while a second gloo group sends
  all_to_alls as fast as the link takes them, from a thread of each rank
  (:func:`under_traffic_ms`); on a machine whose ranks share few cores, this is what
  overlapping communication makes the compute cost.

``vs achievable`` is a step's median divided by that larger one (:func:`achievable_ms`). It is
a reference for a shaped link: over loopback the traffic runs at 1 GB/s on the ranks' own cores,
and the compute beside it takes longer than most steps.

The contention is two-way: the collectives too take longer while the cores compute
(:func:`under_compute_ms`). :func:`contended_ms` combines the four times into the least a step
can take when overlapping slows both sides by as much as measured.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fcol

from passes.core.groups import ALL_TO_ALL_CHUNK_BYTES

from .launch import itemsize, link_bytes_per_s, median_ms

TRAFFIC_ROW = "compute alone, gloo traffic at the link rate alongside"

Call = tuple[str, list[int], str, int]

# collective -> which input holds its full size, and whether that input is one rank's part of it
_FULL_SIZE = {
    "_c10d_functional::all_gather_into_tensor": (0, True),
    "_c10d_functional::reduce_scatter_tensor": (0, False),
    "_c10d_functional::all_to_all_single": (0, False),
    "_c10d_functional::all_reduce": (0, False),
    "_c10d_functional::all_reduce_": (0, False),
    "_c10d_functional::broadcast": (0, False),
    "c10d::_allgather_base_": (0, False),
    "c10d::_reduce_scatter_base_": (1, False),
    "c10d::allreduce_": (0, False),
}
_DTYPE = {
    "float": torch.float32,
    "c10::BFloat16": torch.bfloat16,
    "c10::Half": torch.float16,
    "signed char": torch.int8,
}


def record_collectives(step: Callable[[], object], world: int) -> list[Call] | None:
    """The collectives one ``step()`` issues, from the profiler's recorded shapes: (name, shape of
    the input that holds its size, dtype, full size in bytes: an all-gather's output, a
    reduce-scatter's, all-to-all's or all-reduce's input). None where the profiler did not record
    a collective's size (``c10d::allreduce_`` of a tensor list, as DDP's C++ reducer issues it)."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
    ) as prof:
        step()
    calls = []
    for e in prof.events():
        if e.name not in _FULL_SIZE or _inside_collective(e):
            continue
        arg, part = _FULL_SIZE[e.name]
        shape = e.input_shapes[arg]
        shape = shape[0] if shape and isinstance(shape[0], list) else shape  # a list of tensors
        dtype = e.input_dtypes[arg] if e.input_dtypes else "float"
        if dtype == "TensorList":
            return None
        numel = 1
        for d in shape:
            numel *= d
        calls.append((e.name, list(shape), dtype, numel * itemsize(dtype) * (world if part else 1)))
    return calls


def _inside_collective(event) -> bool:
    """Whether ``event`` runs inside another collective's event (a functional collective
    dispatches to the ``c10d::`` op of its process group): counted once, as the outer one."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in _FULL_SIZE:
            return True
        parent = parent.cpu_parent
    return False


def replay_ms(calls: list[Call] | None, world: int, reps: int = 5) -> float | None:
    """Median time of the same collectives issued back to back with nothing else: what gloo
    needs for them on this link, against which the step's own overlap is judged (0 for none,
    None for unknown ones)."""
    if not calls:
        return None if calls is None else 0.0
    group = dist.group.WORLD
    tensors = [
        (name, torch.zeros(shape, dtype=_DTYPE.get(dtype, torch.float32)))
        for name, shape, dtype, _ in calls
    ]

    def once() -> None:
        for name, x in tensors:
            if name == "_c10d_functional::all_gather_into_tensor":
                fcol.wait_tensor(fcol.all_gather_tensor(x, 0, group))
            elif name == "_c10d_functional::reduce_scatter_tensor":
                fcol.wait_tensor(fcol.reduce_scatter_tensor(x, "sum", 0, group))
            elif name == "_c10d_functional::all_to_all_single":
                fcol.wait_tensor(fcol.all_to_all_single(x, None, None, group))
            elif name in (
                "_c10d_functional::all_reduce",
                "_c10d_functional::all_reduce_",
                "c10d::allreduce_",
            ):
                dist.all_reduce(x)
            elif name == "_c10d_functional::broadcast":
                dist.broadcast(x, 0)
            elif name == "c10d::_allgather_base_":  # x is the output
                dist.all_gather_into_tensor(x.reshape(-1), x.new_empty(x.numel() // world))
            else:  # c10d::_reduce_scatter_base_
                dist.reduce_scatter_tensor(x.new_empty(x.numel() // world), x.reshape(-1))

    return median_ms(once, reps)


def under_traffic_ms(
    step: Callable[[], object], traffic, world: int, seconds: float, rate: float | None
) -> float:
    """Median time of ``step()`` while a thread sends all_to_alls on the ``traffic`` group for
    about ``seconds`` at ``rate`` (a fixed number of rounds, the same on every rank)."""
    # one chunk per destination
    piece = torch.ones(world * ALL_TO_ALL_CHUNK_BYTES // 2, dtype=torch.bfloat16)
    per_round = 4 * (world - 1) * ALL_TO_ALL_CHUNK_BYTES
    rounds = torch.tensor([max(20, int(seconds * (rate or 1e9) / per_round))])
    dist.all_reduce(rounds, dist.ReduceOp.MAX)  # every rank sends as many
    rounds = int(rounds)

    def pump() -> None:
        for _ in range(rounds):
            for handle in [fcol.all_to_all_single(piece, None, None, traffic) for _ in range(4)]:
                fcol.wait_tensor(handle)

    dist.barrier()
    thread = threading.Thread(target=pump)
    thread.start()
    times = []
    while thread.is_alive():
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    thread.join()
    return statistics.median(times[:-1] or times) * 1e3  # the last step may outlast the traffic


def under_compute_ms(
    calls: list[Call] | None, world: int, compute_step: Callable[[], object], reps: int = 5
) -> float | None:
    """:func:`replay_ms` of ``calls`` while a thread of each rank runs ``compute_step()`` (a step
    issuing no collective) over and over: what the collectives take while the cores compute."""
    if not calls:
        return replay_ms(calls, world)
    stop = threading.Event()
    failed: list[BaseException] = []
    # Dynamo's settings are each thread's own (torch 2.13 on): the step's DDP mode goes with it
    optimize_ddp = torch._dynamo.config.optimize_ddp

    def spin() -> None:
        try:
            with torch._dynamo.config.patch(optimize_ddp=optimize_ddp):
                while not stop.is_set():
                    compute_step()
        except BaseException as e:  # re-raised below: a time without the compute is no answer
            failed.append(e)

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        ms = replay_ms(calls, world, reps)
    finally:
        stop.set()
        thread.join()
    if failed:
        raise RuntimeError("under_compute_ms: the compute step failed") from failed[0]
    return ms


def contended_ms(
    compute_ms: float, compute_busy_ms: float, alone_ms: float | None, alone_busy_ms: float | None
) -> float | None:
    """The least time of a step whose compute takes ``compute_ms`` alone and ``compute_busy_ms``
    with traffic alongside, and whose collectives take ``alone_ms`` alone and ``alone_busy_ms``
    with compute alongside, if overlap advances each side at its slowed rate: ``x`` ms of
    overlap do ``x / compute_busy_ms`` of the compute and ``x / alone_busy_ms`` of the
    collectives, and the rest of each runs alone, so the step takes
    ``T(x) = compute_ms + alone_ms + x * (1 - compute_ms / compute_busy_ms - alone_ms /
    alone_busy_ms)`` for ``0 <= x <= min(compute_busy_ms, alone_busy_ms)``: least at the largest
    ``x`` where the bracket is negative (overlap pays), at ``x = 0`` otherwise. The order the
    step needs (a block's gather before its compute) is ignored, so no step of this model beats
    it. None where a time is unknown."""
    if alone_ms is None or alone_busy_ms is None:
        return None
    if alone_ms == 0:
        return compute_ms
    gain = 1 - compute_ms / compute_busy_ms - alone_ms / alone_busy_ms
    return compute_ms + alone_ms + min(0.0, gain) * min(compute_busy_ms, alone_busy_ms)


def compute_busy_ms(
    step: Callable[[], object], times: list[float], traffic, link: str | None
) -> float:
    """:func:`under_traffic_ms` of the compute-alone ``step``, with traffic for as long as its
    timed steps took (``times``, in s) at ``link``'s rate."""
    return under_traffic_ms(
        step,
        traffic,
        dist.get_world_size(),
        len(times) * statistics.median(times),
        link_bytes_per_s(link),
    )


def achievable_ms(busy_ms: float, alone_ms: float | None) -> float | None:
    """What this machine allows a step whose compute under traffic takes ``busy_ms`` and whose
    collectives alone take ``alone_ms`` (None where those are unknown)."""
    return None if alone_ms is None else max(busy_ms, alone_ms)


def vs_achievable(step_ms: float, achievable: float | None) -> str:
    """The column's cell: the ratio and the reference, or "-" where the reference is unknown."""
    return "-" if achievable is None else f"{step_ms / achievable:.2f}x ({achievable:.0f} ms)"
