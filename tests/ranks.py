"""Run a function on N gloo ranks (one process each) and collect what each rank returns.

A rank that raises, dies (e.g. an abort inside gloo) or hangs past ``timeout`` fails the
caller with a message naming the rank, so a distributed test can never hang the suite.
:func:`rank_outcomes` reports those instead of raising, for tests about failures themselves.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import io
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankError(RuntimeError):
    pass


@dataclasses.dataclass
class Outcome:
    # "ok", "error" (raised), "died" (no report, non-zero exit), "hung" (no report in time)
    status: str
    result: Any = None  # what fn returned, or the error text
    seconds: float | None = None  # from start to report
    exitcode: int | None = None  # None while the process still ran when it was killed


def _entry(
    fn: Callable,
    rank: int,
    world_size: int,
    store_path: str,
    q,
    args: tuple,
    backend: str,
    teardown: bool,
    pg_timeout_s: float | None,
) -> None:
    faulthandler.enable(all_threads=True)  # a rank killed by a signal prints its Python stacks
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    reported = False
    try:
        store = dist.FileStore(store_path, world_size)
        kw = {} if pg_timeout_s is None else {"timeout": datetime.timedelta(seconds=pg_timeout_s)}
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kw)
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(result, buf)
        q.put((rank, "ok", buf.getvalue()))
        reported = True
        if teardown:  # gloo aborts a process whose peer tore the group down first: leave together
            dist.barrier()
            dist.destroy_process_group()
    except BaseException as e:  # report everything, including SystemExit/KeyboardInterrupt
        if not reported:
            q.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


# What the rank processes' server imports once: every rank forks from it with these loaded.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "compiled_hooks",
    "passes",
    "tests.ranks",
]


def context() -> Any:
    """The multiprocessing context for rank processes: forked from a server that imported torch
    and the packages once, so a rank starts in a fraction of a second instead of importing torch
    again (a fresh interpreter per rank, as ``spawn`` makes, costs seconds per test)."""
    # The CUDA runtime's availability check marks every process forked afterwards as unable to
    # use CUDA; NVML's does not. The forkserver and its ranks inherit this environment.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def rank_outcomes(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    backend: str = "gloo",
    teardown: bool = True,
    pg_timeout_s: float | None = None,
) -> list[Outcome]:
    """Run ``fn(rank, world_size, *args)`` on every rank; what happened to each.
    ``teardown=False`` leaves out the final barrier, for groups a test leaves broken;
    ``pg_timeout_s``: the group's collective timeout (default: the backend's)."""
    ctx = context()
    q = ctx.Queue()
    outcomes: dict[int, Outcome] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_entry,
                args=(fn, r, world_size, store_path, q, args, backend, teardown, pg_timeout_s),
                daemon=True,
            )
            for r in range(world_size)
        ]
        start = time.monotonic()
        for p in procs:
            p.start()
        try:
            while len(outcomes) < world_size:
                try:
                    rank, status, payload = q.get(timeout=0.5)
                except queue.Empty:
                    for r, p in enumerate(procs):
                        if r not in outcomes and p.exitcode not in (None, 0):
                            outcomes[r] = Outcome("died", seconds=time.monotonic() - start)
                    if time.monotonic() - start > timeout:
                        for r in range(world_size):
                            outcomes.setdefault(
                                r, Outcome("hung", seconds=time.monotonic() - start)
                            )
                    continue
                result = (
                    torch.load(io.BytesIO(payload), weights_only=False)
                    if status == "ok"
                    else payload
                )
                outcomes[rank] = Outcome(status, result, time.monotonic() - start)
        finally:
            for r, p in enumerate(procs):
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
                elif r in outcomes:
                    outcomes[r].exitcode = p.exitcode
    return [outcomes[r] for r in range(world_size)]


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    backend: str = "gloo",
) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, each in its own process."""
    outcomes = rank_outcomes(fn, world_size, *args, timeout=timeout, backend=backend)
    died = [
        f"rank {r} exit code {o.exitcode}" for r, o in enumerate(outcomes) if o.status == "died"
    ]
    if died:
        raise RankError(f"{fn.__name__}: rank(s) died without reporting ({', '.join(died)})")
    hung = [r for r, o in enumerate(outcomes) if o.status == "hung"]
    if hung:
        raise RankError(
            f"{fn.__name__}: {len(hung)} rank(s) gave no answer within {timeout}s (hang)"
        )
    errors = {r: o.result for r, o in enumerate(outcomes) if o.status == "error"}
    if errors:
        raise RankError(
            f"{fn.__name__} failed:\n"
            + "\n".join(f"rank {r}: {m}" for r, m in sorted(errors.items()))
        )
    return [o.result for o in outcomes]
