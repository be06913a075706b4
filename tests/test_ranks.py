"""The rank harness (``tests/ranks.py``) reports a hang or a death with every rank's stacks."""

import os
import signal
import threading

import pytest
import torch
import torch.distributed as dist

from tests.ranks import RankError, run_ranks


def deadlocked_receives(rank, world_size):
    """Each rank waits for a message from the other, which is waiting too."""
    dist.recv(torch.zeros(1), src=1 - rank)


@pytest.mark.slow  # waits out its timeout
def test_a_hang_reports_every_ranks_stacks():
    with pytest.raises(RankError) as info:
        run_ranks(deadlocked_receives, 2, timeout=8)
    message = str(info.value)
    assert "rank(s) 0, 1 gave no answer within 8s (hang)" in message, message
    for rank in (0, 1):
        report = message.split(f"--- rank {rank}: hung")[1].split("--- rank")[0]
        assert "in deadlocked_receives" in report, report  # the test's own frame
        assert "in recv" in report and "distributed_c10d.py" in report, report  # the collective


def raise_or_wait(rank, world_size):
    """Rank 0 raises while rank 1 waits for an event that never comes (in a collective, it
    would raise too: rank 0's exit resets the connection)."""
    if rank == 0:
        raise ValueError("rank 0 gave up")
    threading.Event().wait()


@pytest.mark.slow  # waits out its timeout
def test_a_peer_that_raised_is_reported_beside_the_hung_rank():
    with pytest.raises(RankError) as info:
        run_ranks(raise_or_wait, 2, timeout=8)
    message = str(info.value)
    assert "rank(s) 1 gave no answer" in message and "rank(s) 0 raised" in message, message
    assert "ValueError: rank 0 gave up" in message, message
    assert "in raise_or_wait" in message.split("--- rank 1: hung")[1], message


def crash_with_a_worker_thread(rank, world_size):
    """Rank 1 dies of a segmentation fault while a thread of its own sleeps."""
    if rank == 1:
        threading.Thread(target=threading.Event().wait, name="sleeper", daemon=True).start()
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.all_reduce(torch.ones(1))


def test_a_rank_killed_by_a_signal_reports_its_stacks():
    with pytest.raises(RankError) as info:
        run_ranks(crash_with_a_worker_thread, 2, timeout=30)
    message = str(info.value)
    assert "rank(s) 1 died without reporting" in message, message
    report = message.split("--- rank 1: died")[1].split("--- rank")[0]
    assert "Segmentation fault" in report and "in crash_with_a_worker_thread" in report, report
    assert "in wait" in report, report  # the other thread's stack too


def server_threads(rank, world_size):
    import tests.ranks

    return tests.ranks.SERVER_THREADS


def test_ranks_fork_from_a_server_that_runs_one_thread():
    """A fork beside other threads can hand the child a lock held forever; the server that
    forks the ranks has imported torch, Dynamo and Inductor and runs no thread but its own."""
    assert run_ranks(server_threads, 2) == [1, 1]
