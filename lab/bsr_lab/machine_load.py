"""What else the machine was doing while a bench ran.

Benches on a shared machine read their figures against a reference taken in the same
run, but a reference cannot undo everything: a neighbour that takes a core mid-round
hits whichever path runs then. So every bench JSON carries the load averages and the
processes that used the most CPU over a short sample, before and between rounds.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_ticks() -> dict[int, tuple[int, str]]:
    """utime + stime (all threads) and a short command line, per process."""
    out: dict[int, tuple[int, str]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue  # ended meanwhile, or not ours to read
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(d.name)] = (int(fields[11]) + int(fields[12]), _short(cmd, stat))
    return out


def _short(cmdline: bytes, stat: str) -> str:
    """The command with each path cut to its last part (no temporary paths in the JSON)."""
    args = [a.decode(errors="replace") for a in cmdline.split(b"\0") if a]
    if not args:  # a kernel thread
        return stat[stat.index("(") + 1 : stat.rindex(")")]
    return " ".join(a.rsplit("/", 1)[-1] if "/" in a else a for a in args)[:80]


def busiest(sample_s: float = 0.5, top: int = 5) -> list[dict[str, Any]]:
    """The `top` processes by CPU used over `sample_s` seconds (1.0 = one core busy)."""
    before = _cpu_ticks()
    time.sleep(sample_s)
    after = _cpu_ticks()
    rows: list[dict[str, Any]] = []
    for pid, (ticks, cmd) in after.items():
        used = ticks - before.get(pid, (ticks, ""))[0]
        if used > 0:
            rows.append(
                {
                    "pid": pid,
                    "cores": round(used / _TICKS / sample_s, 2),
                    "cmd": cmd,
                    "self": pid == os.getpid(),
                }
            )
    rows.sort(key=lambda r: -r["cores"])
    return rows[:top]


def snapshot(sample_s: float = 0.5) -> dict[str, Any]:
    """Load averages, cores, and the busiest processes right now."""
    busy = busiest(sample_s)
    return {
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "others_cores": round(sum(r["cores"] for r in busy if not r["self"]), 2),
        "busiest": busy,
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def summary(snaps: list[dict[str, Any]]) -> dict[str, Any]:
    """The range of load seen over a run's snapshots (for the report line)."""
    loads = [s["loadavg"][0] for s in snaps]
    others = [s["others_cores"] for s in snaps]
    return {
        "loadavg_1m_min": min(loads),
        "loadavg_1m_max": max(loads),
        "others_cores_max": max(others),
        "others_cores_median": sorted(others)[len(others) // 2],
    }
