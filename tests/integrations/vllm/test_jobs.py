"""The worker's one job table (integrations/vllm/jobs.py), with real lane threads: every job
is reported exactly once and by its deadline counted from submission, whatever the job
in front of it does; a stuck lane takes no new work; an aborted request's load stops.

The jobs' work is a function that blocks on an event on purpose (a save whose write or
sync never returns), the one double here, standing in for a hung device.
"""

from __future__ import annotations

import threading
import time

from bsr_io.integrations.vllm.jobs import Job, JobTable
from bsr_io.integrations.vllm.metadata import Transfer

GRACE = 0.3


def transfer(rid: str) -> Transfer:
    return Transfer(rid, "model", ())


class Work:
    """Lane work that records what ran and blocks while `hold` is clear."""

    def __init__(self) -> None:
        self.hold = threading.Event()
        self.ran: list[str] = []
        self.ended: list[tuple[str, bool, str]] = []
        self.details: dict[str, dict[str, object]] = {}

    def run(self, job: Job) -> tuple[bool, str, dict[str, object]]:
        self.ran.append(job.request_id)
        while not self.hold.wait(0.01):
            if job.should_stop():
                return True, "", {}  # a load that noticed the stop and returned
        return True, "", {}

    def hung(self, job: Job) -> tuple[bool, str, dict[str, object]]:
        """A wait that polls nothing (a device that never answers): ends on `hold` only."""
        self.ran.append(job.request_id)
        self.hold.wait()
        return True, "", {}

    def fast(self, job: Job) -> tuple[bool, str, dict[str, object]]:
        self.ran.append(job.request_id)
        return True, "", {}

    def on_end(self, job: Job, details: dict[str, object]) -> None:
        self.ended.append((job.request_id, job.ok, job.reason))
        self.details[job.request_id] = details


def table(work: Work, load=None, save=None) -> JobTable:
    return JobTable(
        {"load": load or work.fast, "save": save or work.fast}, work.on_end, grace_s=GRACE
    )


def poll_until(t: JobTable, want: int, timeout_s: float = 10.0) -> tuple[set, set, set]:
    """Poll like vLLM does each step until `want` jobs were reported."""
    sending, recving, failed = set(), set(), set()
    end = time.monotonic() + timeout_s
    while len(sending) + len(recving) < want and time.monotonic() < end:
        s, r, f = t.poll()
        sending |= s
        recving |= r
        failed |= f
        time.sleep(0.02)
    return sending, recving, failed


def test_a_queued_save_is_reported_by_its_own_deadline_behind_a_hung_one():
    work = Work()
    t = table(work, save=work.hung)
    try:
        t.submit("save", transfer("hung"), 0.4)
        time.sleep(0.05)  # the lane took it and hangs
        t0 = time.monotonic()
        queued = t.submit("save", transfer("queued"), 0.4)
        sending, _, _ = poll_until(t, 1)
        took = time.monotonic() - t0
        # Reported at its own deadline (0.4 s), not when the hung save ends (never).
        assert sending == {"queued"} and took < 0.4 + GRACE, took
        assert not queued.ok and "queued" in queued.reason
        assert queued.guard.open is False  # nothing may touch its blocks any more
        assert work.ran == ["hung"]  # the queued one never started
    finally:
        work.hold.set()
        t.close()


def test_a_hung_job_is_given_up_on_then_its_lane_takes_no_new_saves():
    work = Work()
    t = table(work, save=work.hung)
    try:
        hung = t.submit("save", transfer("hung"), 0.2)
        sending, _, _ = poll_until(t, 1)
        assert sending == {"hung"} and not hung.ok and "running" in hung.reason
        assert "save of hung" in t.stuck("save")
        # While the lane is stuck a new finish-save ends at once, as a future miss.
        late = t.submit("save", transfer("late"), 30)
        assert late.done and not late.ok and "stuck" in late.reason
        assert t.poll()[0] == {"late"}
        # The hung save returns at last: it is not reported a second time.
        work.hold.set()
        time.sleep(0.2)
        assert t.poll() == (set(), set(), set())
        assert [e[0] for e in work.ended] == ["hung", "late"]
        assert t.stuck("save") == ""
        # The lane works again.
        t.submit("save", transfer("after"), 5)
        assert poll_until(t, 1)[0] == {"after"}
        assert work.ran == ["hung", "after"]
    finally:
        work.hold.set()
        t.close()


def test_a_job_given_up_while_running_says_where_its_lane_was(caplog):
    """A running job past its deadline ignored it somewhere: its report carries the lane's
    stack at the give-up (the event log's `stack`), and its late return is logged. A job
    given up while still queued has no stack to give."""
    work = Work()
    t = table(work, save=work.hung)
    try:
        with caplog.at_level("WARNING", logger="bsr_io.vllm"):
            t.submit("save", transfer("hung"), 0.2)
            time.sleep(0.05)  # the lane took it and hangs
            t.submit("save", transfer("queued"), 0.1)
            assert poll_until(t, 2)[0] == {"hung", "queued"}
            stack = "".join(work.details["hung"]["stack"])  # type: ignore[arg-type]
            assert "in hung" in stack and "self.hold.wait()" in stack, stack
            assert "stack" not in work.details["queued"]
            assert 0 <= work.details["hung"]["poll_gap_s"] < 5  # type: ignore[operator]
            work.hold.set()
            end = time.monotonic() + 5
            while "returned" not in caplog.text and time.monotonic() < end:
                time.sleep(0.02)
        assert "save of hung returned" in caplog.text, caplog.text
    finally:
        work.hold.set()
        t.close()


def test_a_hung_load_is_reported_failed_only_once_its_lane_returned():
    """A running load given up past its deadline may still have a read writing its
    blocks: vLLM must keep them until the lane returned. Before, the load was reported
    failed (blocks freed) at deadline + grace with the lane still inside it. Meanwhile
    the load lane is stuck: a new load ends at once and is reported, a queued one at its
    own deadline."""
    work = Work()
    t = table(work, load=work.hung)
    try:
        hung = t.submit("load", transfer("r1"), 0.2)
        time.sleep(0.05)  # the lane took it and hangs
        queued = t.submit("load", transfer("queued"), 0.3)
        _, recving, failed = poll_until(t, 1)
        assert recving == failed == {"queued"} and "queued" in queued.reason
        time.sleep(0.2 + GRACE + 0.1)  # r1 is past deadline + grace now
        assert t.poll() == (set(), set(), set())  # given up on, not reported
        assert hung.done and not hung.ok and not hung.guard.open
        assert "holds its blocks" in t.stuck("load") and t.running("load")
        new = t.submit("load", transfer("new"), 30)
        assert new.done and not new.ok and "stuck" in new.reason
        assert t.poll()[1:] == ({"new"}, {"new"})
        time.sleep(0.2)
        assert t.poll() == (set(), set(), set())  # still inside the lane: still held
        work.hold.set()  # the lane returns
        _, recving, failed = poll_until(t, 1)
        assert recving == failed == {"r1"}, (recving, failed)
        assert [e[0] for e in work.ended] == ["queued", "r1", "new"]
        assert t.stuck("load") == "" and t.pending() == 0
    finally:
        work.hold.set()
        t.close()


def test_an_aborted_request_stops_its_running_load_and_never_starts_a_queued_one():
    work = Work()
    t = table(work, load=work.run)
    try:
        running = t.submit("load", transfer("running"), 30)
        time.sleep(0.05)
        queued = t.submit("load", transfer("queued"), 30)
        assert t.abort({"running", "queued", "unknown"}) == 2
        _, recving, failed = poll_until(t, 2)
        assert recving == failed == {"running", "queued"}
        assert "aborted" in running.reason and "aborted" in queued.reason
        assert work.ran == ["running"]
        assert not t.running("load")  # the running load stopped at once, not at 30 s
    finally:
        work.hold.set()
        t.close()


def test_abort_leaves_saves_alone():
    # vLLM's finished requests are the ones whose saves run now: never stop those.
    work = Work()
    t = table(work)
    try:
        t.submit("save", transfer("r"), 30)
        assert t.abort({"r"}) == 0
        assert poll_until(t, 1)[0] == {"r"}
        assert work.ended == [("r", True, "")]
    finally:
        t.close()


def test_a_job_that_raises_is_a_failed_load_and_the_lane_goes_on():
    work = Work()

    def boom(job: Job) -> tuple[bool, str, dict[str, object]]:
        if job.request_id == "bad":
            raise RuntimeError("extract failed")
        return work.fast(job)

    t = table(work, load=boom)
    try:
        t.submit("load", transfer("bad"), 5)
        t.submit("load", transfer("good"), 5)
        _, recving, failed = poll_until(t, 2)
        assert recving == {"bad", "good"} and failed == {"bad"}
        assert ("bad", False, "RuntimeError: extract failed") in work.ended
    finally:
        t.close()


def test_without_deadlines_from_submission_the_queued_save_would_wait():
    """Control: the same hung lane, with the queued save's deadline pushed far out,
    is not reported while the hung one runs: the first test's bound is the deadline's."""
    work = Work()
    t = table(work, save=work.hung)
    try:
        t.submit("save", transfer("hung"), 30)
        time.sleep(0.05)
        t.submit("save", transfer("queued"), 30)
        assert poll_until(t, 1, timeout_s=1.0) == (set(), set(), set())
    finally:
        work.hold.set()
        t.close()


def test_a_load_and_a_cut_of_one_request_are_one_tables_and_a_hold_waits_for_both_copies():
    """Every transfer of a request is a job of the one table, with its id and its
    deadline from submission; a hold (vLLM keeps a finished request's blocks) ends
    exactly when every job of the request is past its copy: not before its load has
    stopped writing the blocks, not after its cut has its bytes (its write may go on)."""
    work = Work()
    copy, write = threading.Event(), threading.Event()

    def cut(job: Job) -> tuple[bool, str, dict[str, object]]:
        copy.wait()
        job.copied.set()  # the record is in a slot: the blocks are free to go
        write.wait()
        return True, "", {}

    holds: list[tuple[str, str]] = []
    t = JobTable(
        {"load": work.run},
        work.on_end,
        on_hold=lambda rid, seconds, why: holds.append((rid, why)),
        grace_s=GRACE,
    )
    t.add_lane("cut", cut, width=2, on_end=lambda job, details: None)
    try:
        load = t.submit("load", transfer("r"), 5)
        c = t.submit("cut", transfer("r"), 7)
        assert [(j.kind, j.id) for j in t.jobs_of("r")] == [("load", load.id), ("cut", c.id)]
        assert load.id != c.id and 1.5 < c.deadline - load.deadline < 2.5
        t.hold({"r"}, 30)
        assert t.poll() == (set(), set(), set()) and holds == []  # nothing copied
        copy.set()
        assert c.copied.wait(5)
        time.sleep(0.05)
        assert t.poll() == (set(), set(), set()) and holds == []  # the load still writes
        t.abort({"r"})  # vLLM finished it: the load stops
        sending, recving, failed = poll_until(t, 2)
        assert sending == recving == failed == {"r"}, (sending, recving, failed)
        assert holds == [("r", "")]  # complete: the aborted load lost it nothing
        assert not c.done and t.jobs_of("r") == [c]  # the cut is still writing
    finally:
        copy.set()
        write.set()
        t.close()


def test_a_hold_whose_cuts_wait_behind_writes_holding_every_slot_ends_early():
    """While no save slot is free (every one held by a write: a stalled drive), a hold
    ends after `starved_s`, its cut skipped (its guard closed), not at its bound: vLLM
    gets the blocks back. Control: with a slot free, the same hold waits on."""
    for starved in (True, False):
        gate = threading.Event()
        holds: list[tuple[str, str]] = []

        def cut(job: Job, gate: threading.Event = gate) -> tuple[bool, str, dict[str, object]]:
            gate.wait()  # waiting for a slot that never comes in time
            return False, "abandoned", {}

        t = JobTable(
            {},
            lambda job, details: None,
            on_hold=lambda rid, seconds, why, holds=holds: holds.append((rid, why)),
            grace_s=GRACE,
            starved=lambda s=starved: s,
            starved_s=0.1,
        )
        t.add_lane("cut", cut, width=1, on_end=lambda job, details: None)
        try:
            c = t.submit("cut", transfer("r"), 30)
            t.hold({"r"}, 30)
            assert t.poll()[0] == set()  # held: its cut has not copied
            time.sleep(0.3)
            sending = t.poll()[0]
            if starved:
                assert sending == {"r"} and not c.guard.open
                assert holds == [("r", "every save slot was held by a write: cuts not copied")]
            else:
                assert sending == set() and holds == [] and c.guard.open
        finally:
            gate.set()
            t.close()
