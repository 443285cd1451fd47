"""The GPU check script (tests/gpu) is kept runnable: without a device it must say so and
exit 2 (never pass silently); with one, every check must pass."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).parents[1] / "gpu" / "check_cuda.py"


def test_gpu_checks_run_or_say_there_is_no_device():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600
    )
    if torch.cuda.is_available():
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.count("PASS") == 4
    else:
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "no CUDA device" in proc.stdout
