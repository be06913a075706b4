"""Every benchmark script starts: its ``--help`` in the fast tier (in this process), and in the
slow tier the smallest configuration (a subprocess, as a user runs it: loopback, two steps).
The step benchmarks take ``--smoke`` for it (``launch.add_smoke_argument``: one small model, the
configurations their report needs). What a benchmark computes is tested beside it
(``test_benchmark_*.py``; ``fsdp_memory.py``'s rows in ``test_benchmark_fsdp_memory.py``).
The shared parts are modules of ``benchmarks.common``, not scripts; each script runs as a
module from the repository root, ``python -m benchmarks.<name>``."""

from __future__ import annotations

import contextlib
import io
import pathlib
import runpy
import sys

import pytest

from tests.processes import run_script

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(
    p.stem for p in BENCHMARKS.glob("*.py") if 'if __name__ == "__main__":' in p.read_text()
)

# each script's smallest configuration; None: not run here (the comment says why)
SMOKE = {
    "accumulation": ["--smoke"],
    "ddp_sync": None,  # link_sweep's smoke runs ddp_sync --smoke (over a shaped link)
    "fsdp_2d": ["--smoke"],
    "first_step": ["--smoke"],
    "fsdp_memory": None,  # test_benchmark_fsdp_memory.py runs its rows
    "fsdp_step": ["--smoke", "--timeline", "data_parallel keep + passes"],
    "gloo_collectives": ["--sizes-mb", "1", "--reps", "2", "--chunk-kib", "256"],
    "gpu_step": ["--device", "cpu"],  # CI's CPU mode: the smallest sizes
    "int8_step_cpu": ["--smoke"],
    # one rate, ddp_sync --smoke, the projection beside it
    "link_sweep": ["--smoke", "--benchmarks", "ddp_sync", "--send-ns", "2", "--receive-ns", "1"],
    "pipeline": ["--smoke"],
    "pass_time": ["--calls", "20", "40", "--repeat", "1"],
    "powersgd": ["--smoke"],
    "projection": ["--params", "1e9", "--send-ns", "0.02", "--receive-ns", "0.01"],
    "quantize_cost": ["--numel", "4096", "--reps", "2", "--device", "cpu"],
    "rank_guard": ["--steps", "2"],
    "reducer_hooks": ["--smoke"],
    "plot": None,  # plots another run's JSON: needs matplotlib (the bench extra)
    "zero_step": ["--smoke"],
    "zero_update_layouts": ["--numel", "20000", "--members", "4", "--calls", "2"],
}


def test_every_script_has_a_smoke_entry():
    assert sorted(SMOKE) == SCRIPTS


# importing a script imports torch modules the suite had not: their own deprecation notices
@pytest.mark.filterwarnings("ignore::DeprecationWarning:torch")
@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script, monkeypatch):
    """``--help`` prints the script's usage and exits 0: it imports, and its options parse."""
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--help"])
    # run as __main__ on its own, not beside the module another test imported
    monkeypatch.delitem(sys.modules, f"benchmarks.{script}", raising=False)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        runpy.run_module(f"benchmarks.{script}", run_name="__main__")
    assert done.value.code == 0
    assert out.getvalue().startswith("usage:"), out.getvalue()[:200]


@pytest.mark.slow
@pytest.mark.parametrize("script", [s for s in SCRIPTS if SMOKE.get(s) is not None])
def test_smallest_configuration_runs(script):
    proc = run_script(
        [sys.executable, "-m", f"benchmarks.{script}", *SMOKE[script]],
        timeout=900,
        merge_stderr=True,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    if "--smoke" in SMOKE[script]:  # a step benchmark's report: its table
        assert "|---|" in proc.stdout, proc.stdout[-4000:]
    if "--timeline" in SMOKE[script]:
        assert proc.stdout.count("    collective 0: issued") == 2, proc.stdout[-4000:]  # 2 ranks
    if script == "link_sweep":  # ddp_sync's own report, then the sweep's
        assert proc.stdout.count("| compiled + int8 hook + passes |") == 1, proc.stdout[-4000:]
        assert "ddp_sync: int8 pays at" in proc.stdout, proc.stdout[-4000:]
