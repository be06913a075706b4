import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


SUMMARY: list[str] = []  # lines tests want in the terminal summary (seeds, counts)


def pytest_terminal_summary(terminalreporter):
    for line in SUMMARY:
        terminalreporter.write_line(line)


@contextlib.contextmanager
def fake_process_group(world_size: int):
    """An in-process default group of ``world_size`` fake ranks (no communication)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fake_pg():
    with fake_process_group(8) as pg:
        yield pg


@pytest.fixture(autouse=True)
def _reset_dynamo_and_fake_group():
    yield
    torch._dynamo.reset()
    if dist.is_initialized() and dist.get_backend() == "fake":  # left by passes.testing.trace
        dist.destroy_process_group()


def pytest_report_header(config):
    from compiled_hooks import compat

    return "compat: " + "; ".join(f"{k} -> {v}" for k, v in compat.resolved().items())
