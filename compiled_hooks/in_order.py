"""Collectives issued from future callbacks, in one order on every rank.

A gloo (or NCCL) process group matches collectives by the order they are issued in: two ranks
that issue the same collectives in different orders exchange the wrong buffers, and gloo
aborts the process ("Received data size doesn't match expected size"). A hook that issues a
collective from a future's continuation (PowerSGD's Q after its P) runs it on the backend's
thread, at a time that differs between ranks, while the main thread goes on issuing the next
buckets' collectives: torch's own ``powerSGD_hook`` aborts this way on gloo when DDP has more
than one bucket.

:class:`InOrder` fixes the order when the work is known, not when it is ready: a slot is
reserved in the main thread (the same sequence on every rank), filled later from any thread
with a function that issues the collective, and issued once every slot before it has been::

    p, q = order.reserve(), order.reserve()      # main thread, hook call k: P_k, then Q_k
    order.fill(p, lambda: all_reduce(P_k))       # issued now (if every earlier slot was)
    ... in P_k's continuation: order.fill(q, lambda: all_reduce(Q_k))

Nothing waits: a slot that is not ready holds back only the slots reserved after it.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["InOrder"]

Issue = Callable[[], "torch.futures.Future[Any]"]


class Slot:
    """A reserved place in the order; ``future`` completes as the issued collective's does."""

    __slots__ = ["issue", "future"]

    def __init__(self) -> None:
        self.issue: Issue | None = None
        self.future: torch.futures.Future[Any] = torch.futures.Future()


def _forward(source: torch.futures.Future[Any], target: torch.futures.Future[Any]) -> None:
    def done(fut: torch.futures.Future[Any]) -> None:
        try:
            value = fut.value()
        except Exception as e:  # handed on to whoever waits for the slot
            target.set_exception(e)
        else:
            target.set_result(value)

    source.add_done_callback(done)


class InOrder:
    """Issue functions run in the order their slots were reserved (see the module docstring).
    Thread-safe; the function that fills the slot at the head issues it and every ready slot
    after it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._slots: collections.deque[Slot] = collections.deque()
        self._issuing = False  # a thread is in the loop of _issue_ready (re-entry only fills)

    def reserve(self) -> Slot:
        slot = Slot()
        with self._lock:
            self._slots.append(slot)
        return slot

    def fill(self, slot: Slot, issue: Issue) -> torch.futures.Future[Any]:
        """Give ``slot`` its issue function; returns ``slot.future``."""
        with self._lock:
            slot.issue = issue
            self._issue_ready()
        return slot.future

    def _issue_ready(self) -> None:
        if self._issuing:  # a continuation that ran inline, inside an issue below
            return
        self._issuing = True
        try:
            while self._slots and self._slots[0].issue is not None:
                slot = self._slots.popleft()
                issue = slot.issue
                assert issue is not None, "checked before the pop"
                try:
                    issued = issue()
                except Exception as e:
                    # the slot's waiter sees it; the order goes on
                    slot.future.set_exception(e)
                else:
                    _forward(issued, slot.future)
        finally:
            self._issuing = False

    def pending(self) -> int:
        """Slots reserved and not yet issued."""
        with self._lock:
            return len(self._slots)
