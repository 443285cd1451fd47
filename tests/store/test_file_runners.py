"""The threads that run a tier's file calls under a deadline (bounded.py's `Runners`):
kept and reused, never queued behind a stalled call, on the caller's CPUs, and usable
again in a forked child."""

from __future__ import annotations

import os
import threading

import pytest

from bsr_io.tiers.files.bounded import run_within, runners


def test_runners_are_reused_call_after_call() -> None:
    # Counted as threads started, not as calls that found a marked thread: runners left
    # idle by earlier tests take calls too (each its first), so that count depended on
    # which tests ran before.
    before = {t.ident for t in threading.enumerate()}
    used: set[int | None] = set()
    for _ in range(50):
        run_within(1.0, lambda: used.add(threading.get_ident()))
    started = used - before
    # A thread per call (what a save paid three times before) would start 50; one may
    # start when none was idle, and one more if an idle runner timed out meanwhile.
    assert len(started) <= 2, len(started)


def test_a_stalled_call_does_not_hold_the_next() -> None:
    release = threading.Event()
    run_within(1.0, lambda: None)  # one idle runner: the stalled call takes it
    try:
        with pytest.raises(TimeoutError):
            run_within(0.1, lambda: release.wait(30))
        # Queued behind the stalled runner, this would time out too.
        assert run_within(2.0, lambda: "next") == "next"
    finally:
        release.set()


def test_a_late_result_goes_to_late_and_the_runner_is_reused() -> None:
    release = threading.Event()
    dropped: list[int] = []
    handed = threading.Event()

    def late(v: int) -> None:
        dropped.append(v)
        handed.set()

    with pytest.raises(TimeoutError):
        run_within(0.05, lambda: (release.wait(30), 41)[1], late=late)
    release.set()
    assert handed.wait(5)
    assert dropped == [41]
    started = runners().started
    assert run_within(1.0, lambda: 1) == 1
    assert run_within(1.0, lambda: 2) == 2
    assert runners().started == started  # the late call's runner went back idle


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell apart")
def test_a_call_runs_on_its_callers_cpus() -> None:
    cpus = sorted(os.sched_getaffinity(0))[:2]
    seen: dict[int, set[int]] = {}

    def caller(cpu: int) -> None:
        os.sched_setaffinity(0, {cpu})
        seen[cpu] = run_within(2.0, lambda: os.sched_getaffinity(0))

    for cpu in cpus:  # one after the other: the second finds the first's runner idle
        t = threading.Thread(target=caller, args=(cpu,))
        t.start()
        t.join()
    assert seen == {cpu: {cpu} for cpu in cpus}


def test_a_call_runs_with_its_callers_policy_and_nice() -> None:
    seen: dict[str, tuple[int, int]] = {}

    def placement() -> tuple[int, int]:
        return os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)

    def caller(name: str, lower: bool) -> None:
        if lower:  # as a pool's data threads may run
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, 0, 19)
        seen[name] = run_within(2.0, placement)

    for name, lower in (("idle", True), ("normal", False)):  # the second finds an idle runner
        t = threading.Thread(target=caller, args=(name, lower))
        t.start()
        t.join()
    assert seen["idle"] == (os.SCHED_IDLE, 19)
    assert seen["normal"] == placement()  # not served by the idle caller's runner


def test_calls_work_in_a_forked_child() -> None:
    run_within(1.0, lambda: None)  # the parent has an idle runner; the child has none
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports by its exit status
        try:
            ok = run_within(2.0, lambda: 7) == 7
        except BaseException:  # noqa: BLE001 - any failure is the status below
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
