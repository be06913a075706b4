"""The benchmarks' launcher: rates it accepts, and why it falls back to loopback; their output
arguments."""

import argparse
import os
import sys
import types

import pytest

from benchmarks.common import launch, results


@pytest.mark.parametrize("rate", ["2gbit", "500mbit", "100kbit", "1.5gbit", "800bit"])
def test_rates(rate):
    assert launch.link_rate(rate) == rate


@pytest.mark.parametrize("rate", ["2gbps", "2G", "fast", "-1gbit", ""])
def test_bad_rate_is_refused(rate):
    parser = argparse.ArgumentParser()
    launch.add_link_argument(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--link", rate])


def test_says_why_it_cannot_shape(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert launch.link_problem() == "network namespaces need root"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(
        launch.shutil, "which", lambda tool: None if tool == "tc" else f"/sbin/{tool}"
    )
    assert launch.link_problem() == "tc not found"


def test_a_link_that_cannot_be_made_is_reported_not_run(monkeypatch):
    def fail(*_):
        raise launch.subprocess.CalledProcessError(
            2, ["ip", "netns", "add", "x"], stderr="Operation not permitted\n"
        )

    cleaned = []
    monkeypatch.setattr(launch, "_make_link", fail)
    monkeypatch.setattr(launch.subprocess, "run", lambda cmd, **_: cleaned.append(cmd))
    monkeypatch.setattr(
        launch.subprocess, "Popen", lambda *a, **k: pytest.fail("a rank was started")
    )
    with pytest.raises(launch.LinkUnavailable, match="ip netns add x: Operation not permitted"):
        launch.run_on_link("2gbit", ["true"])
    assert [c[:3] for c in cleaned] == [["ip", "netns", "del"]] * 2  # whatever was made is removed


def test_plot_without_matplotlib_is_refused_before_the_run(monkeypatch):
    parser = argparse.ArgumentParser()
    results.add_output_arguments(parser)
    monkeypatch.setitem(sys.modules, "matplotlib", types.ModuleType("matplotlib"))
    assert parser.parse_args(["--plot", "out.png"]).plot == "out.png"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # its import raises ImportError
    assert parser.parse_args(["--json", "out.json"]).plot is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--plot", "out.png"])


@pytest.mark.parametrize(
    "argv,chosen",
    [
        ([], ["a", "b", "c", "d"]),
        (["--smoke"], ["b", "d"]),
        (["--configs", "c"], ["b", "c", "d"]),
        (["--smoke", "--configs", "a"], ["a", "b", "d"]),
    ],
)
def test_chosen_configs_keep_what_the_report_needs_in_order(argv, chosen):
    parser = argparse.ArgumentParser()
    launch.add_smoke_argument(parser)
    launch.add_configs_argument(parser, ["a", "b", "c", "d"])
    assert (
        launch.chosen_configs(parser.parse_args(argv), ["a", "b", "c", "d"], ["d", "b"]) == chosen
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--configs", "e"])


def test_interleaved_median_ms_runs_one_of_each_in_turn(monkeypatch):
    """Round by round, each step once in order; each median from its own runs (a fake clock
    that advances by the step's own duration)."""
    clock, order = [0.0], []

    def step(name, seconds):
        def run():
            order.append(name)
            clock[0] += seconds.pop(0)

        return run

    monkeypatch.setattr(launch.time, "perf_counter", lambda: clock[0])
    steps = {"a": step("a", [0.001, 0.003, 0.002]), "b": step("b", [0.010, 0.030, 0.020])}
    medians = launch.interleaved_median_ms(steps, 3)
    assert order == ["a", "b"] * 3
    assert medians == pytest.approx({"a": 2.0, "b": 20.0})
