"""`bsr-lab bench serve --write-stall SECONDS[:EVERY]`: holds measured under load.

The bsr-io server's store is served through the kernel's FUSE (`late_dir`,
tests/fuse_stall.py: a pass-through of the store directory by a process of its own) whose
server answers the first write of a record's temp file SECONDS late, on every record or
every EVERY-th: the connector's cuts and finish saves really wait in the kernel (their
slots stay busy, queued cuts wait for one, finished requests are held) while the serving
load runs. The other servers never touch the store: their figures are the same run
without the stall. The bench starts the FUSE server before the servers and ends it (by
its PID: `umount -l`, then wait, then kill) on any exit of the bench it can see, SIGTERM
included; a mount left by a bench killed outright is taken down at the next run's start.

While a hold or a cut is pending the bsr-io engine steps without pause (the connector's
`has_pending_push_work`): in the smoke run on 2 cores, the reference driven right after
bsr-io's warm-up waited 20.9 s for its first tokens, until bsr-io's holds had ended (their
bound). So after each of bsr-io's rounds the bench waits until its engine is idle again
(`drain`) before it drives another server, and reports those waits (`drain_s`): the
references' figures are then the run without the stall.

The report (`write_stall`): the writes the FUSE server held; the holds (count, seconds
p50/p90/max, why any ended short); the cuts and finish saves by outcome, the unwritten
ones by reason; and per phase the bsr-io server's output throughput and TTFT p50
against the reference (and the control's, the noise floor), i.e. what the holds cost.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

import bsr_lab
from bsr_lab.vllm import sched

# The FUSE server of the project's stall tests, run from the source checkout (the lab is
# installed editable from it): one implementation of the kernel stall, not two.
FUSE_STALL = Path(bsr_lab.__file__).resolve().parents[2] / "tests" / "fuse_stall.py"
TEMP_SUFFIX = ".tmp"  # a record's temp file (bsr_io.tiers.files.records.tmp_path)


@dataclass(frozen=True)
class WriteStall:
    seconds: float
    every: int = 1


def parse(text: str) -> WriteStall:
    """`SECONDS[:EVERY]` (ValueError naming what is wrong)."""
    secs, _, every = text.partition(":")
    try:
        stall = WriteStall(float(secs), int(every) if every else 1)
    except ValueError:
        raise ValueError(f"--write-stall {text!r}: expected SECONDS[:EVERY]") from None
    if not stall.seconds > 0 or stall.every < 1:
        raise ValueError(f"--write-stall {text!r}: SECONDS must be > 0 and EVERY >= 1")
    return stall


def refused() -> str:
    """Why this machine cannot stall a write through FUSE ("" when it can)."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        return "--write-stall mounts a FUSE file system: it needs root and /dev/fuse"
    if not FUSE_STALL.exists():
        return f"--write-stall runs {FUSE_STALL}: run the bench from a source checkout"
    return ""


def _fuse_stall() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fuse_stall", FUSE_STALL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def unmount_stale(store: Path) -> None:
    """Take down a FUSE mount left on `store` by a bench killed outright (its server
    gone, every call there fails with ENOTCONN)."""
    real = str(store.parent.resolve() / store.name)  # no call on the dead mount itself
    with open("/proc/self/mountinfo") as f:
        mounted = any(line.split()[4] == real for line in f)
    if mounted:
        subprocess.run(["umount", "-l", real], check=False, capture_output=True)


@contextmanager
def stalled_store(store: Path, stall: WriteStall, log: Path) -> Iterator[Any]:
    """`store` (created empty) served with its records' writes held by `stall` until
    the block ends, each held write a line of `log`; SIGTERM meanwhile ends the bench
    through its `finally` blocks."""
    store.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    before = signal.getsignal(signal.SIGTERM)

    def leave(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)
    try:
        with _fuse_stall().late_dir(
            store, stall.seconds, ["write"], TEMP_SUFFIX, stall.every, True, log
        ) as late:
            yield late
    finally:
        signal.signal(signal.SIGTERM, before)


def drain(srv: Any, cap_s: float = 120.0, poll_s: float = 0.5) -> float:
    """Wait until `srv`'s engine core and forward thread are idle (under a fifth of a core
    together over two polls in a row), at most `cap_s`: the seconds waited."""
    t0 = time.monotonic()
    idle = 0
    before = sched.counters(srv.group_pids())
    while idle < 2 and time.monotonic() - t0 < cap_s:
        time.sleep(poll_s)
        after = sched.counters(srv.group_pids())
        busy = sum(c["run_s"] for c in sched.delta(before, after).values())
        idle = idle + 1 if busy < 0.2 * poll_s else 0
        before = after
    return time.monotonic() - t0


# -- the report ---------------------------------------------------------------------------
def spread(xs: list[float]) -> dict[str, float | int]:
    if not xs:
        return {"n": 0}
    a = np.asarray(xs)
    return {
        "n": len(xs),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "max": float(a.max()),
    }


def _reason(text: str) -> str:
    """A reason without the names that differ record by record (temp files, keys)."""
    text = re.sub(r"\S+\.tmp\b", "<temp file>", text or "")
    return re.sub(r"\b[0-9a-f]{12,}\b", "<key>", text)


def outcomes(events: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """`kind`'s saves ("step_save": cuts, "save": finish saves) by outcome, and the
    ones not written by reason."""
    mine = [e for e in events if e.get("kind") == kind]
    return {
        "by_outcome": dict(Counter(str(e.get("outcome")) for e in mine)),
        "unwritten_by_reason": dict(
            Counter(
                f"{e.get('outcome')}: {_reason(e.get('reason', ''))}"
                for e in mine
                if e.get("outcome") != "complete"
            )
        ),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def cost(
    rounds: dict[str, list[dict[str, Any]]], side: str, phases: tuple[str, ...]
) -> dict[str, Any]:
    """Per phase, `side`'s output throughput and TTFT p50 against the reference's, over
    every request of the phase pooled over the rounds."""

    def rate(s: str, ph: str) -> float | None:
        toks = sum(len(r["tokens"]) for rd in rounds[s] for r in rd[ph]["requests"])
        wall = sum(rd[ph]["wall_s"] for rd in rounds[s])
        return toks / wall if wall else None

    def ttft(s: str, ph: str) -> float | None:
        xs = [r["ttft_s"] for rd in rounds[s] for r in rd[ph]["requests"] if r["ttft_s"]]
        return float(np.median(xs)) if xs else None

    return {
        ph: {
            "throughput_ratio": _ratio(rate(side, ph), rate("baseline", ph)),
            "ttft_p50_ratio": _ratio(ttft(side, ph), ttft("baseline", ph)),
        }
        for ph in phases
    }


def report(
    stall: WriteStall,
    held: list[tuple[str, str, float]],
    events: list[dict[str, Any]],
    rounds: dict[str, list[dict[str, Any]]],
    phases: tuple[str, ...],
    control: str,
    drained: list[float],
) -> dict[str, Any]:
    holds = [e for e in events if e.get("kind") == "hold"]
    return {
        "seconds": stall.seconds,
        "every": stall.every,
        # After each of bsr-io's rounds (the warm-up first): its engine busy until idle.
        "drain_s": drained,
        # What the FUSE server saw: the record writes it answered late, and how late.
        "writes_held": spread([s for _, _, s in held]),
        "holds": spread([e["seconds"] for e in holds])
        | {"short": dict(Counter(e["reason"] for e in holds if e.get("reason")))},
        "cuts": outcomes(events, "step_save"),
        "finish_saves": outcomes(events, "save"),
        "vs_baseline": cost(rounds, "bsr_io", phases),
        **({"control_vs_baseline": cost(rounds, control, phases)} if rounds.get(control) else {}),
    }
