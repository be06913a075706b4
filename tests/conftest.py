import pytest
import torch
import torch.distributed as dist

from passes.testing import fake_process_group

SUMMARY: list[str] = []  # lines tests want in the terminal summary (seeds, counts)


def pytest_terminal_summary(terminalreporter):
    for line in SUMMARY:
        terminalreporter.write_line(line)


@pytest.fixture
def fake_pg():
    """A fake default group of 8 ranks (no communication), removed after the test."""
    return fake_process_group(8)


@pytest.fixture(autouse=True)
def _reset_dynamo_and_fake_group():
    yield
    torch._dynamo.reset()
    if dist.is_initialized() and dist.get_backend() == "fake":  # fake_process_group's
        dist.destroy_process_group()


def pytest_report_header(config):
    from compiled_hooks import compat

    return "compat: " + "; ".join(f"{k} -> {v}" for k, v in compat.resolved().items())
