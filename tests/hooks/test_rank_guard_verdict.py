"""The rank guard's verdict is one text on every rank: a rank that times out waiting for the
others publishes it where their watchdogs read it, and a second verdict does not replace the
first. In one process, on a shared store, with no collective."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from compiled_hooks import compat, rank_guard
from compiled_hooks.rank_guard import protocol
from passes.testing import fake_process_group


def group(store, me, timeout=0.05):
    return protocol._Group("g", None, [0, 1], me, store, timeout)


def test_a_timeout_verdict_is_published_for_every_rank():
    store = dist.HashStore()
    waiting, late = group(store, 0), group(store, 1)
    entries = [["all_reduce", ["sum"], ["float32", [4]], "model.py:1"]]
    with pytest.raises(rank_guard.RankDivergenceError) as raised:
        protocol._exchange(waiting, entries)
    assert "did not reach collective #0" in str(raised.value)
    assert late.read_verdict()
    assert late.verdict == str(raised.value)


def test_the_first_verdict_stands():
    store = dist.HashStore()
    first, second = group(store, 0), group(store, 1)
    first.publish("rank guard: first")
    second.publish("rank guard: second")
    assert first.verdict == second.verdict == "rank guard: first"


def test_group_timeout_falls_back_to_the_default_without_backend_options():
    pg = fake_process_group(2)
    assert compat.group_timeout(pg) == dist.distributed_c10d.default_pg_timeout
    assert isinstance(compat.group_timeout(pg), datetime.timedelta)
