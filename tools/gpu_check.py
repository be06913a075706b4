"""What runs on one device, run, and a short report: see tools/gpu_check.sh."""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ("quickstart", "train_ddp", "train_fsdp", "train_zero")
SMALL_DEVICE_TEST = "test_data_parallel_one_collective_per_block"  # without --full


def run(name: str, cmd: list[str], env: dict[str, str], timeout: int) -> dict:
    """Run ``cmd`` from the project root, echo its output, and return what the report needs."""
    print(f"\n=== {name}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
        out, code = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, code = (
            (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""),
            "timeout",
        )
    print(out, flush=True)
    return {
        "name": name,
        "ok": code == 0,
        "code": code,
        "seconds": time.perf_counter() - start,
        "out": out,
    }


def pytest_counts(out: str) -> str:
    """pytest's closing counts ("12 passed, 1 failed ..."), or why there are none."""
    lines = [
        line.strip("= ")
        for line in out.splitlines()
        if re.search(r"\d+ (passed|failed|error)", line)
    ]
    return re.sub(r" in [\d.]+s.*", "", lines[-1]) if lines else "no pytest summary"


def example_result(out: str) -> str:
    """The example's verdict and the median step time after the first step (which compiles),
    from rank 0's output: of its last section (``--- name ---``, the compiled run where an
    eager reference runs first) and, where a line times several models, of the first."""
    final = [line for line in out.splitlines() if line.startswith("final loss")]
    last = out.split("\n--- ")[-1]
    ms = [
        float(m.group(1))
        for line in last.splitlines()
        if line.startswith("step")
        for m in [re.search(r"([\d.]+) ms", line)]
        if m
    ]
    verdict = "OK" if final and "(OK" in final[-1] else "FAIL" if final else "no verdict"
    step = f", median step {statistics.median(ms[1:]):.1f} ms" if len(ms) > 1 else ""
    return verdict + step


def header(device: str) -> str:
    import torch

    from compiled_hooks import compat

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none visible"
    lines = [
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), python {sys.version.split()[0]}",
        f"device: {device}; GPU: {gpu}; GPUs visible: {torch.cuda.device_count()}",
        "compat: " + "; ".join(f"{k} -> {v}" for k, v in compat.resolved().items() if k != "torch"),
    ]
    return "\n".join(lines)


def example_runs(device: str, steps: int, full: bool) -> list[tuple[str, list[str]]]:
    """(label, arguments) for every example (the quick start alone unless ``full``): NCCL at
    world size 1 and gloo with 2 ranks sharing the GPU on CUDA; 2 gloo ranks on CPU. The quick
    start picks its device itself (CUDA when there is a GPU per rank), so under torchrun with one
    rank it runs on the GPU."""
    py = sys.executable
    if device == "cuda":
        runs = [
            (
                "quickstart nccl-1",
                [
                    py,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nproc-per-node",
                    "1",
                    "examples/quickstart.py",
                ],
            )
        ]
        layouts = [
            ("nccl-1", ["--backend", "nccl", "--world-size", "1"]),
            ("gloo-2", ["--backend", "gloo", "--world-size", "2"]),
        ]
    else:
        runs = [("quickstart gloo-2", [py, "examples/quickstart.py"])]
        layouts = [("gloo-2", ["--backend", "gloo", "--world-size", "2"])]
    for name in EXAMPLES[1:] if full else ():
        for label, extra in layouts:
            runs.append(
                (
                    f"{name} {label}",
                    [py, f"examples/{name}.py", "--device", device, "--steps", str(steps), *extra],
                )
            )
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=6, help="training steps per example")
    parser.add_argument(
        "--full",
        action=argparse.BooleanOptionalAction,
        help="every device test and every example (default: on cuda; on cpu, where the test "
        "suite's slow tier runs them, one device test and the quick start keep the script alive)",
    )
    parser.add_argument(
        "--suite",
        choices=["fast", "none"],
        help="the test suite's fast tier as well (default: fast on cuda, none on cpu)",
    )
    args = parser.parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    suite = args.suite or ("fast" if device == "cuda" else "none")
    full = device == "cuda" if args.full is None else args.full
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "COMPILED_HOOKS_TEST_DEVICE": device,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    info = header(device)
    print(info, flush=True)
    tests = [
        run(
            "device tests",
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "tests/test_device.py",
                *([] if full else ["-k", SMALL_DEVICE_TEST]),
            ],
            env,
            1800,
        )
    ]
    if suite == "fast":
        tests.append(
            run(
                "fast tier",
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow"],
                env,
                1800,
            )
        )
    examples = [run(label, cmd, env, 900) for label, cmd in example_runs(device, args.steps, full)]

    print("\n=== gpu_check report\n" + info)
    for r in tests:
        print(
            f"{r['name']:<22} {'ok  ' if r['ok'] else 'FAIL'} {pytest_counts(r['out'])} "
            f"({r['seconds']:.0f} s)"
        )
    if suite == "none":
        print(f"{'fast tier':<22} not run (--suite none)")
    for r in examples:
        verdict = (
            example_result(r["out"]) if r["ok"] else f"exit {r['code']}; {example_result(r['out'])}"
        )
        print(f"{r['name']:<22} {'ok  ' if r['ok'] else 'FAIL'} {verdict} ({r['seconds']:.0f} s)")
    failed = [r["name"] for r in tests + examples if not r["ok"]]
    print(
        f"gpu_check: {len(tests) + len(examples) - len(failed)} passed, {len(failed)} failed"
        + (f": {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
