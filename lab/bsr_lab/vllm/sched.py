"""How a `vllm serve` tree's forward thread and engine core were scheduled over a phase,
read from /proc (Linux, a kernel with scheduler statistics).

On a CPU host the forward runs on the worker process's main thread, bound to vLLM's
OpenMP cores, and the engine core polls for each step's output on a core of its own
when nothing else wants it. What a KV connector can cost them there is not CPU time of
its own but scheduling: the forward thread blocking (a GIL another thread of the worker
holds, a lock) and the engine core moved onto the forward's core while it does. Counted
here per phase: `blocked` (voluntary switches), `preempted` (involuntary ones),
`migrations`, and the seconds each thread ran (`run_s`) and waited to run (`wait_s`).
"""

from __future__ import annotations

from typing import Any

Counters = dict[str, dict[str, float]]  # role -> counter -> value
# comm (the kernel's 15-character thread name) prefix -> role
ROLES = {"VLLM::Worker": "forward", "VLLM::EngineCor": "engine_core"}
_SCHED = {
    "nr_voluntary_switches": "blocked",
    "nr_involuntary_switches": "preempted",
    "se.nr_migrations": "migrations",
}


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the process ended, or no such file on this kernel
        return None


def thread_counters(pid: int) -> dict[str, float] | None:
    """The counters of process `pid`'s main thread, or None where /proc lacks them."""
    sched, stat = _read(f"/proc/{pid}/task/{pid}/sched"), _read(f"/proc/{pid}/task/{pid}/schedstat")
    if sched is None or stat is None:
        return None
    out: dict[str, float] = {}
    for line in sched.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in _SCHED:
            out[_SCHED[key.strip()]] = float(value)
    run_ns, wait_ns = (int(x) for x in stat.split()[:2])
    out |= {"run_s": run_ns / 1e9, "wait_s": wait_ns / 1e9}
    return out if len(out) == len(_SCHED) + 2 else None


def counters(pids: list[int]) -> Counters:
    """Per role (ROLES), the counters of its process's main thread, summed over the
    processes that play it."""
    out: Counters = {}
    for pid in pids:
        comm = (_read(f"/proc/{pid}/comm") or "").strip()
        role = next((r for prefix, r in ROLES.items() if comm.startswith(prefix)), None)
        got = thread_counters(pid) if role else None
        if role and got:
            have = out.setdefault(role, dict.fromkeys(got, 0.0))
            for k, v in got.items():
                have[k] += v
    return out


def delta(before: Counters, after: Counters) -> Counters:
    """after - before, per role both hold (a role restarted between them is left out)."""
    return {
        role: {k: after[role][k] - v for k, v in before[role].items()}
        for role in before.keys() & after.keys()
        if all(after[role][k] >= v for k, v in before[role].items())
    }


def rates(phases: list[dict[str, Any]]) -> Counters:
    """Per role, each counter over the phases' summed wall time (per second; `run_s` and
    `wait_s` then read as the share of the time)."""
    wall = sum(ph["wall_s"] for ph in phases if "sched" in ph)
    out: Counters = {}
    for ph in phases:
        for role, c in ph.get("sched", {}).items():
            have = out.setdefault(role, dict.fromkeys(c, 0.0))
            for k, v in c.items():
                have[k] += v / wall
    return {role: {k: round(v, 4) for k, v in c.items()} for role, c in out.items()}
