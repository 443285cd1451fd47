"""scripts/stages.sh, the bookkeeping of scripts/test.sh: a failed stage does not stop the
stages after it, every failure is listed at the end, and what was started in the
background is stopped when the script exits."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bash(script: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", f"set -uo pipefail; cd {ROOT}; . scripts/stages.sh; {script}"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )


def test_every_stage_runs_and_every_failure_is_listed(tmp_path: Path) -> None:
    done = tmp_path / "done"
    out = _bash(
        f"stage first false; stage second touch {done}; stage third sh -c 'exit 3'; finish",
        tmp_path,
    )
    assert out.returncode == 1
    assert done.exists()  # the stage after a failure ran
    tail = out.stdout[out.stdout.index("== FAILED after") :]
    assert "first (exit 1)" in tail and "third (exit 3)" in tail
    assert "second" not in tail


def test_all_passed_exits_zero(tmp_path: Path) -> None:
    out = _bash("stage one true; stage two true; finish", tmp_path)
    assert out.returncode == 0, out.stdout
    assert "== all checks passed" in out.stdout


def test_background_work_is_stopped_on_exit(tmp_path: Path) -> None:
    # A background job with a grandchild, as an install script running pip has; the
    # script then fails a stage and exits before waiting for it.
    pids = tmp_path / "pids"
    out = _bash(
        f"background {tmp_path}/log bash -c 'sleep 300 & echo $! > {pids}; wait'; "
        f"while [ ! -s {pids} ]; do sleep 0.05; done; stage broken false; finish",
        tmp_path,
    )
    assert out.returncode == 1
    grandchild = int(pids.read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.split(")")[-1].split()[0] != "Z"  # a zombie has exited
