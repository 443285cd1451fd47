"""The GPU check script (tests/gpu) is kept runnable: without a device it must say so and
exit 2 (never pass silently); with one, every check must pass. Its hybrid-pools check
also runs here on the CPU: the same pools, saves, damaged record and cut, so a device
machine's short time is not spent finding a broken setup."""

from __future__ import annotations

import importlib.util
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
        assert proc.stdout.count("PASS") == 5
    else:
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "no CUDA device" in proc.stdout


def test_the_hybrid_pools_check_passes_on_the_cpu(tmp_path):
    """Every pool byte-exact and committed whole, then a damaged C4-indexer record ending
    every pool's prefix at its page (the check asserts each pool's verdict)."""
    spec = importlib.util.spec_from_file_location("check_cuda", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.check_hybrid_pools_commit_together(tmp_path, device="cpu")
