"""The benchmarks' two-way contention reference (``achievable.contended_ms``)."""

import pytest

from benchmarks.common.achievable import contended_ms


def test_no_slowdown_overlaps_fully():
    assert contended_ms(40.0, 40.0, 100.0, 100.0) == pytest.approx(100.0)
    assert contended_ms(120.0, 120.0, 100.0, 100.0) == pytest.approx(120.0)


def test_overlap_that_does_not_pay_runs_both_alone():
    # each side at half its rate while they overlap: overlap gains nothing
    assert contended_ms(40.0, 80.0, 100.0, 200.0) == pytest.approx(140.0)
    assert contended_ms(40.0, 100.0, 100.0, 300.0) == pytest.approx(140.0)


def test_overlap_until_the_shorter_side_ends():
    # 40 ms of overlap end the compute and do 40/60 of the collectives; 50/3 ms remain alone
    assert contended_ms(30.0, 40.0, 50.0, 60.0) == pytest.approx(40.0 + 50.0 / 3)
    # collectives end first: 60 ms of overlap do 60/90 of the compute, 20 ms remain alone
    assert contended_ms(60.0, 90.0, 50.0, 60.0) == pytest.approx(60.0 + 20.0)


def test_no_collectives_or_unknown_ones():
    assert contended_ms(40.0, 80.0, 0.0, 0.0) == 40.0
    assert contended_ms(40.0, 80.0, None, None) is None
    assert contended_ms(40.0, 80.0, 100.0, None) is None
