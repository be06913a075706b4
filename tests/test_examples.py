"""The README's examples run as written and their two runs agree, with the rank-divergence
guard on (``PASSES_CHECK_RANKS=1``: no false positive, and it did check the compiled graphs)."""

import os
import pathlib
import sys

import pytest

from tests.processes import run_script

pytestmark = pytest.mark.slow  # each runs an example: several ranks compiling for 20-40 s

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUARD = {"PASSES_CHECK_RANKS": "1"}


def assert_guard_checked(stdout: str) -> None:
    assert any(
        line.startswith("rank guard: ") and "no divergence" in line for line in stdout.splitlines()
    ), stdout


def test_train_ddp_example_with_verified_passes():
    # every rewrite checked
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PASSES_VERIFY": "1",
        **GUARD,
    }
    proc = run_script(
        [sys.executable, str(ROOT / "examples" / "train_ddp.py"), "--steps", "6"],
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--- compiled DDP + bf16_compress_hook + passes ---" in proc.stdout
    # the passes rewrote the example's backward and the verifier found nothing wrong
    passes_line = next(line for line in proc.stdout.splitlines() if line.startswith("passes: "))
    assert "bucketed" in passes_line and "bucket_compressed_collectives: verified" in passes_line, (
        passes_line
    )
    assert proc.stdout.count("step ") == 12
    final = [line for line in proc.stdout.splitlines() if line.startswith("final loss")]
    assert len(final) == 1 and "(OK" in final[0], proc.stdout
    assert_guard_checked(proc.stdout)


def test_train_fsdp2_example():
    proc = run_script(
        [sys.executable, str(ROOT / "examples" / "train_fsdp2.py"), "--steps", "4"],
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **GUARD},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("bf16_compress_hook: loss") == 4
    final = [line for line in proc.stdout.splitlines() if line.startswith("final loss")]
    assert len(final) == 1 and "(OK" in final[0], proc.stdout
    assert_guard_checked(proc.stdout)


def test_train_fsdp_example():
    proc = run_script(
        [sys.executable, str(ROOT / "examples" / "train_fsdp.py"), "--steps", "4"],
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **GUARD},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("data_parallel + bf16_compress_hook: loss") == 4
    final = [line for line in proc.stdout.splitlines() if line.startswith("final loss")]
    assert len(final) == 1 and "(OK" in final[0], proc.stdout
    assert_guard_checked(proc.stdout)


def test_train_zero_example_sharded_with_verified_passes():
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PASSES_VERIFY": "1", **GUARD}
    proc = run_script(
        [
            sys.executable,
            str(ROOT / "examples" / "train_zero.py"),
            "--steps",
            "4",
            "--shard-buckets",
        ],
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("step ") == 4
    passes_line = next(line for line in proc.stdout.splitlines() if line.startswith("passes: "))
    for done in (
        "-> reduce_scatter",
        "-> all_gather",
        "interleave_zero_broadcasts: verified",
        "shard_weight_update: verified",
    ):
        assert done in passes_line, passes_line
    assert "identical on all ranks: True" in proc.stdout
    final = [line for line in proc.stdout.splitlines() if line.startswith("final loss")]
    assert len(final) == 1 and "(OK" in final[0], proc.stdout
    assert_guard_checked(proc.stdout)
