"""Run a function on N gloo ranks (spawned processes) and collect what each rank returns.

A rank that raises, dies (e.g. an abort inside gloo) or hangs past ``timeout`` fails the
caller with a message naming the rank, so a distributed test can never hang the suite.
"""

from __future__ import annotations

import io
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankError(RuntimeError):
    pass


def _entry(fn: Callable, rank: int, world_size: int, store_path: str, q, args: tuple, backend: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    reported = False
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(result, buf)
        q.put((rank, "ok", buf.getvalue()))
        reported = True
        # gloo aborts a process whose peer tore the group down first: leave together
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # report everything, including SystemExit/KeyboardInterrupt
        if not reported:
            q.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
              backend: str = "gloo") -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, each in its own process."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, store_path, q, args, backend), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) + len(errors) < world_size:
                try:
                    rank, status, payload = q.get(timeout=1.0)
                except queue.Empty:
                    reported = set(results) | set(errors)
                    died = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in reported]
                    if died:
                        codes = ", ".join(f"rank {r} exit code {procs[r].exitcode}" for r in died)
                        raise RankError(f"{fn.__name__}: rank(s) died without reporting ({codes})") from None
                    if time.monotonic() > deadline:
                        raise RankError(
                            f"{fn.__name__}: {world_size - len(results) - len(errors)} rank(s) gave no "
                            f"answer within {timeout}s (hang)"
                        ) from None
                    continue
                if status == "ok":
                    results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
                else:
                    errors[rank] = payload
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        if errors:
            raise RankError(f"{fn.__name__} failed:\n" + "\n".join(f"rank {r}: {m}" for r, m in sorted(errors.items())))
        return [results[r] for r in range(world_size)]
