import os

# Inductor's CPU ISA probe compiles and loads one test library per vector ISA, in a child
# process, in every process that compiles (each pytest worker, each rank a test starts, which
# inherits this environment). The tests trust the CPU's flags instead, through torch's own
# switch; a run outside pytest keeps the probe. Set before torch is imported: Inductor's config
# reads it once.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from passes.testing import fake_process_group


@pytest.fixture
def summary(request):
    """``summary(line)``: a line for the terminal summary (seeds, counts). It travels in the
    test's report, so it is printed when the test ran in a pytest-xdist worker too."""
    return lambda line: request.node.user_properties.append(("summary", line))


def pytest_terminal_summary(terminalreporter):
    for outcome in ("passed", "failed"):
        for report in terminalreporter.stats.get(outcome, []):
            for key, line in getattr(report, "user_properties", ()):
                if key == "summary":
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


def pytest_addoption(parser):
    parser.addoption(
        "--stress",
        type=int,
        default=1,
        metavar="K",
        help="run every selected test K times, as K parametrized copies (tools/stress.py)",
    )


def pytest_generate_tests(metafunc):
    rounds = metafunc.config.getoption("stress")
    if rounds > 1:
        metafunc.fixturenames.append("stress_round")
        metafunc.parametrize("stress_round", range(rounds), ids=lambda i: f"round{i}")


def pytest_configure(config):
    # pytest-xdist (where installed) hands a worker one test at a time instead of a quarter of
    # its share up front, so the order below decides which worker runs what
    if getattr(config.option, "maxschedchunk", False) is None:
        config.option.maxschedchunk = 1


def pytest_collection_modifyitems(items):
    """The slow tier's tests run first (a stable sort: each tier keeps its order). Under
    pytest-xdist a long test that starts last keeps one worker busy after the other has run
    out of work; with the fast tier's many short tests last, the workers finish together."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_report_header(config):
    from compiled_hooks import compat

    return "compat: " + "; ".join(f"{k} -> {v}" for k, v in compat.resolved().items())
