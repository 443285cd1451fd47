"""`bsr_lab.vllm.sched`: the scheduling counters `bench serve` records per phase, read
from /proc for real processes playing vLLM's two roles (named as vLLM names them)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bsr_lab.vllm import sched

# A child that takes a role's name, then either blocks `n` times (sleeps) or spins
# without blocking for as long, then waits to be read and killed.
CHILD = """
import sys, time
open("/proc/self/comm", "w").write(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
n, block = int(sys.argv[2]), sys.argv[3] == "block"
t_end = time.monotonic() + 0.5
for _ in range(n):
    time.sleep(0.002) if block else None
while time.monotonic() < t_end:
    pass
print("done", flush=True)
sys.stdin.readline()
"""


def _child(name: str, n: int, mode: str) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD, name, str(n), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    return p


def _step(p: subprocess.Popen[str]) -> None:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write("\n")
    p.stdin.flush()
    assert p.stdout.readline() == "done\n"


def test_a_phase_counts_the_forward_threads_blocks_and_not_a_spinning_ones():
    blocks = _child("VLLM::Worker", 100, "block")
    spins = _child("VLLM::EngineCore", 100, "spin")  # the kernel keeps 15 characters
    other = _child("python-other", 100, "block")
    kids = [blocks, spins, other]
    try:
        pids = [k.pid for k in kids]
        before = sched.counters(pids)
        cpu_before = {p: _cpu_s(p) for p in pids[:2]}
        assert set(before) == {"forward", "engine_core"}  # the third plays no role
        t0 = time.monotonic()
        for k in kids:
            _step(k)
        wall = time.monotonic() - t0
        d = sched.delta(before, sched.counters(pids))
        assert d["forward"]["blocked"] >= 100  # each sleep blocked it once
        assert d["engine_core"]["blocked"] < 10  # the control: it only spun
        # Run time is checked against the control the kernel keeps apart from schedstat:
        # each child's CPU time in /proc/PID/stat (clock ticks), not against a share of a
        # core that a loaded machine may not give.
        for role, pid in (("forward", blocks.pid), ("engine_core", spins.pid)):
            cpu = _cpu_s(pid) - cpu_before[pid]
            assert abs(d[role]["run_s"] - cpu) <= 0.03 + 0.1 * cpu, (role, d[role], cpu)
        assert d["engine_core"]["run_s"] <= wall + 0.05
        per_s = sched.rates([{"wall_s": wall, "sched": d}])
        assert per_s["forward"]["blocked"] >= 100 / wall - 1
    finally:
        for k in kids:
            k.kill()
            k.wait()


def _cpu_s(pid: int) -> float:
    """utime + stime of `pid` from /proc/PID/stat, in seconds."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_role_that_restarted_between_the_reads_is_left_out():
    before = {"forward": {"blocked": 50.0, "run_s": 2.0}, "engine_core": {"blocked": 1.0}}
    after = {"forward": {"blocked": 3.0, "run_s": 0.1}, "engine_core": {"blocked": 4.0}}
    assert sched.delta(before, after) == {"engine_core": {"blocked": 3.0}}
