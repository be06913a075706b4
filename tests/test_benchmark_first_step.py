"""``benchmarks/first_step.py --repeats``: each timing of a (configuration, depth) is the median
over its rounds, the rest the first round's; ``--retries``: a failed pair of jobs runs again on
a new cache, and fails the benchmark once its retries are spent."""

import pytest

from benchmarks import first_step
from benchmarks.first_step import JobFailed, median_job, run_pair


def _job(first, steady, hits):
    return {"config": "c", "first_s": first, "steady_ms": steady, "compile_s": 0, "caches": hits}


def test_a_row_over_rounds_takes_each_timings_median():
    rounds = [
        {"cold": _job(30.0, None, {"miss": 1}), "warm": _job(4.0, 250.0, {"hit": 1})},
        {"cold": _job(24.0, None, {"miss": 2}), "warm": _job(9.0, 240.0, {"hit": 2})},
        {"cold": _job(26.0, None, {"miss": 3}), "warm": _job(5.0, 300.0, {"hit": 3})},
    ]
    assert median_job(rounds, "cold") == _job(26.0, None, {"miss": 1})
    assert median_job(rounds, "warm") == _job(5.0, 250.0, {"hit": 1})


def test_a_failed_pair_runs_again_on_a_new_cache(monkeypatch):
    calls = []

    def run_job(config, depth, steps, cache, timeout, device):
        calls.append((steps, cache))
        if len(calls) == 2:
            raise JobFailed("c at depth 1 failed (exit codes [0, -6])")
        return {"steps": steps}

    monkeypatch.setattr(first_step, "run_job", run_job)
    assert run_pair("c", 1, 6, 60.0, retries=1) == {"cold": {"steps": 0}, "warm": {"steps": 6}}
    assert [s for s, _ in calls] == [0, 6, 0, 6]
    assert calls[0][1] == calls[1][1] != calls[2][1] == calls[3][1]
    calls.clear()
    with pytest.raises(SystemExit, match="exit codes"):
        run_pair("c", 1, 6, 60.0, retries=0)
