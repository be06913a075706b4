"""``benchmarks/first_step.py --repeats``: each timing of a (configuration, depth) is the median
over its rounds, the rest the first round's."""

from benchmarks.first_step import median_job


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
