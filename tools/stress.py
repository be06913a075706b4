"""Run multi-rank test families K times each beside a CPU hog on every core, and report every
hang with the stacks the rank harness collected.

    python tools/stress.py                          # every family, 10 rounds
    python tools/stress.py --rounds 3 --families int8 data_parallel
    python tools/stress.py --rounds 5 -- tests/fsdp/test_data_parallel.py -k int8

Each family is one pytest run (``--stress K``: each selected test K times, pytest-xdist's two
workers) while one busy process per core competes with it. A test that hangs fails with
``tests.ranks.RankError`` ("... (hang)", every rank's stacks) or ``tests.processes.ScriptTimeout``
("ran past"); the report counts those apart from other failures and prints their messages.
Exits non-zero when any test failed or hung.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pathlib
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parent.parent

# family -> pytest arguments: the multi-rank tests of each part of the package
FAMILIES: dict[str, list[str]] = {
    "hooks": ["tests/hooks/test_hooks.py", "tests/hooks/test_grad_scaler.py", "-m", "not slow"],
    "ddp": ["tests/hooks/test_ddp.py", "tests/hooks/test_reducer_hooks.py", "-m", "not slow"],
    "data_parallel": [
        "tests/fsdp/test_data_parallel.py",
        "tests/fsdp/test_fsdp.py",
        "-m",
        "not slow",
    ],
    "data_parallel_compiled": [
        "tests/fsdp/test_data_parallel.py",
        "tests/fsdp/test_composition.py",
        "-k",
        "int8_gathers and compiled or composition",
    ],
    "zero": ["tests/zero/test_zero.py", "tests/zero/test_zero_optimizer.py", "-m", "not slow"],
    "int8": [
        "tests/hooks/test_int8_collectives.py",
        "tests/hooks/test_quantized.py",
        "-m",
        "not slow",
    ],
    "powersgd": ["tests/hooks/test_powersgd.py", "-m", "not slow"],
    "tensor_parallel": ["tests/fsdp/test_tensor_parallel.py", "-k", "eager or comm_hooks"],
    "rank_guard": ["tests/hooks/test_rank_guard.py", "-k", "every_rank or false_positive"],
    "faults": ["tests/test_faults.py", "-k", "dead_rank"],
}


def _hog() -> None:
    while True:
        pass


def _failures(junit: pathlib.Path) -> tuple[int, list[tuple[str, str]]]:
    """(tests run, [(test id, failure message)]) from a JUnit XML report."""
    cases = ET.parse(junit).getroot().iter("testcase")
    ran, failed = 0, []
    for case in cases:
        if case.find("skipped") is not None:
            continue
        ran += 1
        for bad in (*case.findall("failure"), *case.findall("error")):
            failed.append((f"{case.get('classname')}::{case.get('name')}", bad.text or ""))
    return ran, failed


def _is_hang(message: str) -> bool:
    return "(hang)" in message or "ran past" in message


def run_family(name: str, args: list[str], rounds: int, workers: int, out: pathlib.Path) -> dict:
    junit = out / f"{name}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--stress={rounds}"]
    cmd += ["-n", str(workers), f"--junitxml={junit}", *args]
    start = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.monotonic() - start
    if not junit.exists():
        return {"family": name, "rc": rc, "ran": 0, "failed": [], "seconds": seconds}
    ran, failed = _failures(junit)
    return {"family": name, "rc": rc, "ran": ran, "failed": failed, "seconds": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="runs of each test (default 10)")
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=sorted(FAMILIES))
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 1, help="busy processes")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "stress-logs")
    parser.add_argument("pytest_args", nargs="*", help="after --: a selection of your own")
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    families = (
        {"selection": opts.pytest_args}
        if opts.pytest_args
        else {f: FAMILIES[f] for f in opts.families}
    )
    hogs = [multiprocessing.Process(target=_hog, daemon=True) for _ in range(opts.hogs)]
    for h in hogs:
        h.start()
    results = []
    try:
        for name, args in families.items():
            r = run_family(name, args, opts.rounds, opts.workers, opts.out)
            hangs = sum(_is_hang(m) for _, m in r["failed"])
            print(
                f"{name}: {r['ran']} runs, {len(r['failed']) - hangs} failed, {hangs} hung, "
                f"{r['seconds']:.0f} s (pytest exit {r['rc']}; log {opts.out / name}.log)",
                flush=True,
            )
            results.append(r)
    finally:
        for h in hogs:
            h.kill()
    bad = [(r["family"], t, m) for r in results for t, m in r["failed"]]
    for family, test, message in bad:
        kind = "HANG" if _is_hang(message) else "FAILED"
        print(f"\n=== {kind} {family}: {test}\n{message[-6000:]}")
    total = sum(r["ran"] for r in results)
    hung = sum(_is_hang(m) for _, _, m in bad)
    print(
        f"\nstress: {total} test runs in {len(results)} families, {opts.rounds} rounds each, "
        f"{opts.hogs} CPU hogs: {len(bad) - hung} failed, {hung} hung"
    )
    return 1 if bad or any(r["rc"] not in (0,) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
