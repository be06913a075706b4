"""Run a function on N gloo ranks (one process each) and collect what each rank returns.

A rank that raises, dies (e.g. an abort inside gloo) or hangs past ``timeout`` fails the
caller with a message naming the rank, so a distributed test can never hang the suite.
:func:`rank_outcomes` reports those instead of raising, for tests about failures themselves.

Every rank's Python stacks (all threads) reach that message when it hangs or dies by a
signal: before a hung rank is killed it gets ``SIGUSR1``, on which ``faulthandler`` writes
its stacks to a file of the run's, and a fatal signal writes them there too. So a hang in CI
names the function and the collective each rank sat in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import io
import os
import queue
import signal
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
    stacks: str = ""  # the rank's Python stacks, where it hung or died by a signal

    def describe(self, rank: int) -> str:
        """The outcome as a report's paragraph: the status, an error's text, the stacks."""
        head = f"--- rank {rank}: {self.status}"
        if self.status == "died":
            head += f" (exit code {self.exitcode})"
        if self.status == "hung":
            head += f" after {self.seconds:.0f}s"
        body = self.result if self.status == "error" else ""
        if self.stacks:
            body += f"Python stacks, all threads:\n{self.stacks}"
        elif self.status in ("hung", "died"):
            body += "(no stacks: the process wrote none)\n"
        return f"{head} ---\n{body}"


# Seconds a hung rank gets to write its stacks after SIGUSR1.
STACKS_WAIT_S = 3.0

_stacks_file = None  # the rank's open stacks file: faulthandler writes to its descriptor


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
    global _stacks_file
    _stacks_file = open(_stacks_path(store_path, rank), "w")  # open for the process
    faulthandler.enable(_stacks_file, all_threads=True)  # a fatal signal: the stacks, then death
    faulthandler.register(signal.SIGUSR1, _stacks_file, all_threads=True)  # a hang: the stacks
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


def _stacks_path(store_path: str, rank: int) -> str:
    return f"{store_path}.stacks.{rank}"


def _collect_stacks(procs: list, outcomes: dict[int, Outcome], store_path: str) -> None:
    """Signal every hung rank still running to write its stacks, then read every hung or dead
    rank's stacks file into its outcome."""
    signalled = [p for r, p in enumerate(procs) if outcomes[r].status == "hung" and p.is_alive()]
    for p in signalled:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGUSR1)
    deadline = time.monotonic() + STACKS_WAIT_S
    for r, p in enumerate(procs):
        if p not in signalled:
            continue
        path = _stacks_path(store_path, r)
        size = -1
        while time.monotonic() < deadline:  # written once the file stops growing
            time.sleep(0.2)
            now = os.path.getsize(path) if os.path.exists(path) else 0
            if now and now == size:
                break
            size = now
    for r, o in outcomes.items():
        path = _stacks_path(store_path, r)
        if o.status in ("hung", "died") and os.path.exists(path):
            with open(path, errors="replace") as f:
                o.stacks = f.read()


def _threads() -> int:
    """The threads this process runs (Linux; 0 elsewhere)."""
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0


# The threads the importing process ran once this module was imported: in a rank, the forkserver's
# after its preload (this module is its last), so the threads each rank was forked beside.
SERVER_THREADS = _threads()

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
    # A process that forks while other threads run can leave the child a lock that nobody will
    # release. Importing torch imports numpy, whose OpenBLAS starts a thread per core unless
    # told otherwise; with this the server runs one thread (SERVER_THREADS).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
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
            _collect_stacks(procs, outcomes, store_path)
        finally:
            for r, p in enumerate(procs):
                if r not in outcomes or outcomes[r].status != "hung":  # a hung one: killed now
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
    failed = {s for o in outcomes for s in [o.status] if s != "ok"}
    if not failed:
        return [o.result for o in outcomes]
    what = {
        "died": "died without reporting",
        "hung": f"gave no answer within {timeout}s (hang)",
        "error": "raised",
    }
    summary = "; ".join(
        f"rank(s) {', '.join(str(r) for r, o in enumerate(outcomes) if o.status == s)} {what[s]}"
        for s in ("died", "hung", "error")
        if s in failed
    )
    raise RankError(
        f"{fn.__name__}: {summary}\n"
        + "".join(o.describe(r) for r, o in enumerate(outcomes) if o.status != "ok")
    )
