"""The README's main example runs as written and its two runs agree."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_train_ddp_example():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_ddp.py"), "--steps", "6"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--- compiled DDP + bf16_compress_hook ---" in proc.stdout
    assert proc.stdout.count("step ") == 12
    final = [line for line in proc.stdout.splitlines() if line.startswith("final loss")]
    assert len(final) == 1 and "(OK" in final[0], proc.stdout
