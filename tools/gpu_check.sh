#!/usr/bin/env bash
# Run what this project can run on one device, and print a short report.
#
#   tools/gpu_check.sh                  # --device cuda where a GPU is visible, else cpu
#   tools/gpu_check.sh --device cpu     # what CI runs: one device test and the quick start
#   tools/gpu_check.sh --device cpu --full   # everything, on CPU
#
# On a one-GPU machine it uses the torch already installed there (2.11 on the lent machines)
# and reads the project from this working tree, no install: it needs only pytest and
# expecttest (carry their wheels where the image lacks them). It runs
#   1. tests/test_device.py on the device (COMPILED_HOOKS_TEST_DEVICE): the hooks compiled
#      whole, compiled DDP's bf16 bucket read in Inductor's generated code (one all_reduce, the
#      cast inside the kernels that write the bucket), data_parallel's one collective per block;
#   2. on CUDA, the fast tier of the test suite as well (--suite fast|none);
#   3. every example on the device: NCCL at world size 1 and gloo with 2 ranks sharing the
#      GPU (CPU: 2 gloo ranks), --steps N each (default 6);
# on CPU, unless --full, only data_parallel's device test and the quick start (the slow tier of
# the test suite runs the rest on CPU);
# then a report: torch, GPU, pass/fail counts, each example's verdict and median step time.
# Exits non-zero when anything failed.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m tools.gpu_check "$@"  # from the root: this tree's packages
