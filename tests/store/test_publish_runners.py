"""The threads that publish L2 records (the engine's `publish`, rust/core/src/publish/
runners.rs): each publication runs on the caller's CPUs, scheduling policy and nice
value, a stalled one never holds the next, and a forked child publishes too. Which
thread ran it is read from the stall double (`stall_publish`), which records the
runners it held."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from bsr_io import Engine
from bsr_io._core import PublishStall, stall_publish
from bsr_io.cli.synthetic import fill_state
from bsr_io.model.layout import preset
from bsr_io.tiers import SSDTier

LAYOUT = preset("tiny")


def _placement(tid: int) -> tuple[set[int], int, int]:
    return (
        os.sched_getaffinity(tid),
        os.sched_getscheduler(tid),
        os.getpriority(os.PRIO_PROCESS, tid),
    )


def _held(stall: PublishStall, n: int = 1) -> list[int]:
    deadline = time.monotonic() + 10
    while stall.hits < n:
        assert time.monotonic() < deadline, "the publication never reached its step"
        time.sleep(0.01)
    return stall.threads


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell apart")
def test_a_publication_runs_where_and_as_its_caller_would(tmp_path: Path) -> None:
    cpu = max(os.sched_getaffinity(0))
    lowered = ({cpu}, os.SCHED_IDLE, 19)  # as the vLLM connector's pinned writers may run

    with Engine(2, LAYOUT.chunk_bytes) as engine:

        def caller(root: Path, lower: bool) -> None:
            if lower:
                os.sched_setaffinity(0, {cpu})
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, 0, 19)
            tier = SSDTier(root, None, engine, layout=LAYOUT)
            fill_state(tier, LAYOUT, LAYOUT.chunk_tokens, seed=1)

        seen = {}
        # The lowered caller first: its runner is then idle while the normal one calls,
        # and must not take that call.
        for name, lower in (("lowered", True), ("normal", False)):
            root = tmp_path / name
            stall = stall_publish("write", str(root))
            t = threading.Thread(target=caller, args=(root, lower))
            t.start()
            try:
                seen[name] = _placement(_held(stall)[0])
            finally:
                stall.release()
                t.join()
    assert seen["lowered"] == lowered
    assert seen["normal"] == _placement(threading.get_native_id())


def test_a_stalled_publication_does_not_hold_the_next(tmp_path: Path) -> None:
    with Engine(2, LAYOUT.chunk_bytes) as engine:
        held_root, free_root = tmp_path / "held", tmp_path / "free"
        stall = stall_publish("fdatasync", str(held_root))
        held = SSDTier(held_root, None, engine, layout=LAYOUT, write_timeout_s=30)
        t = threading.Thread(target=fill_state, args=(held, LAYOUT, LAYOUT.chunk_tokens))
        t.start()
        try:
            _held(stall)
            # A single publishing thread would keep this one behind the held fdatasync.
            free = SSDTier(free_root, None, engine, layout=LAYOUT, write_timeout_s=5)
            _, keys = fill_state(free, LAYOUT, LAYOUT.chunk_tokens, seed=2)
            assert free.keys() == keys
        finally:
            stall.release()
            t.join()
        assert len(held.keys()) == 1


def test_a_forked_child_publishes(tmp_path: Path) -> None:
    with Engine(2, LAYOUT.chunk_bytes) as engine:
        fill_state(SSDTier(tmp_path / "parent", None, engine, layout=LAYOUT), LAYOUT, 16)
    # The parent now has an idle runner; the child has none of its threads.
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports by its exit status
        try:
            with Engine(2, LAYOUT.chunk_bytes) as eng:
                tier = SSDTier(tmp_path / "child", None, eng, layout=LAYOUT, write_timeout_s=5)
                fill_state(tier, LAYOUT, LAYOUT.chunk_tokens, seed=3)
                ok = len(tier.keys()) == 1
        except BaseException:  # noqa: BLE001 - any failure is the status below
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
