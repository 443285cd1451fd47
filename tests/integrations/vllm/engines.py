"""Run the vLLM harness in a subprocess (vLLM spawns its engine core and workers there)
and read back its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HARNESS = "bsr_lab.vllm.harness"


def threads_env(tp: int) -> dict[str, str]:
    """The environment of an engine run: OpenMP threads pinned at every TP size, so an
    engine with the connector and the baseline without it compute on the same threads
    (vLLM's automatic binding differs when a KV connector is configured)."""
    env = dict(os.environ)
    cores = os.cpu_count() or 1
    if tp == 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}" if cores > 1 else "0")
    else:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % cores) for i in range(tp)))
    return env


def run_harness(
    what: str,
    tp: int,
    work: Path,
    timeout: float,
    module: str = HARNESS,
    extra: tuple[str, ...] = (),
) -> dict:
    """`python -m module what --tp .. --work .. --out .. *extra` (the harness's by default)."""
    out = work / f"{what}.json"
    cmd = [
        sys.executable,
        "-m",
        module,
        what,
        "--tp",
        str(tp),
        "--work",
        str(work / what),
        "--out",
        str(out),
        *extra,
    ]
    proc = subprocess.run(cmd, env=threads_env(tp), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{what} tp={tp} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def per_rank(events: list[dict], tp: int) -> dict[int, dict]:
    """A phase's events of one kind (its loads, its saves) by rank: exactly one per rank."""
    out = {e["rank"]: e for e in events}
    assert sorted(out) == list(range(tp)) and len(events) == tp, events
    return out
