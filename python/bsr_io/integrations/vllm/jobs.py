"""The worker's job table: every load and save vLLM asked for, from submission to report.

vLLM learns that a transfer ended only from what `get_transfer_results` reports, and
keeps the request's blocks until then: a transfer never reported pins its blocks for
good, and enough of those admit nothing. So every job's deadline counts from its
submission (time queued included), and `poll` reports each job exactly once: when its
lane finished it, or when its deadline passed, whichever comes first (a running load
given up on: once its lane returned, below). A job given up on
has its guard closed before it is reported, so nothing touches its blocks afterwards.

A job that ended while reads it gave up may still write its blocks (a direct read the
kernel still holds: `hold`) is reported only once they returned: until then vLLM keeps
the blocks allocated to the request (also when it was aborted), so it neither
recomputes into them nor hands them to another request; the lane meanwhile is stuck
(below), which says why. After an engine break-down that left a read with the kernel
for good, the job is never reported and its blocks stay the request's. A running load
given up `grace_s` past its deadline is held the same way until its lane returned (a
read it started may still write the blocks); a queued job is reported at its deadline.

Each kind of job has one lane (a thread) that runs its jobs in submission order; a job
that ended before its lane took it (deadline passed, request aborted) never starts. A
lane whose current job is past its deadline by more than `grace_s` is stuck: new jobs
of that kind end at once (a save then is a future miss, a load a recompute) until the
lane returns.

The table knows nothing of vLLM or of what a job does: `run(job)` per kind does the
work and returns (ok, reason, details); `on_end(job, details)` is told once per job.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from bsr_io.integrations.vllm.blocks import Guard
from bsr_io.integrations.vllm.metadata import Transfer

log = logging.getLogger("bsr_io.vllm")

Kind = Literal["load", "save"]
Details = dict[str, Any]
Run = Callable[["Job"], tuple[bool, str, Details]]


@dataclass(eq=False)
class Job:
    kind: Kind
    transfer: Transfer
    deadline: float  # time.monotonic(), counted from submission
    guard: Guard = field(default_factory=Guard)
    started: float | None = None  # when its lane took it
    aborted: bool = False  # vLLM finished the request (an abort): stop as soon as possible
    done: bool = False
    ok: bool = False
    reason: str = ""
    # Ended with reads it gave up still writing its blocks: (why, whether they returned).
    hold: tuple[str, Callable[[], bool]] | None = None

    @property
    def request_id(self) -> str:
        return self.transfer.request_id

    def should_stop(self) -> bool:
        """Polled by the running job between records."""
        return self.done or self.aborted or not self.guard.open


@dataclass
class _Lane:
    kind: Kind
    run: Run
    queue: queue.Queue[Job | None] = field(default_factory=queue.Queue)
    current: Job | None = None
    thread: threading.Thread | None = None


class JobTable:
    def __init__(
        self,
        runs: dict[Kind, Run],
        on_end: Callable[[Job, Details], None],
        *,
        grace_s: float = 2.0,
        hold_running_loads: bool = True,
        name: str = "bsr",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._on_end = on_end
        self._grace_s = grace_s
        # False where loads read only into slots: they write their blocks only through
        # their guard, closed when they are given up, so there is nothing to hold.
        self._hold_running = hold_running_loads
        self._clock = clock
        self._lock = threading.Lock()
        self._jobs: list[Job] = []  # submitted, not yet reported
        self._polled = clock()  # a long gap between polls: the worker itself did not step
        self._lanes = {kind: _Lane(kind, run) for kind, run in runs.items()}
        for lane in self._lanes.values():
            lane.thread = threading.Thread(
                target=self._serve, args=(lane,), name=f"{name}-{lane.kind}", daemon=True
            )
            lane.thread.start()

    # -- what the worker calls --------------------------------------------------------
    def submit(self, kind: Kind, transfer: Transfer, timeout_s: float) -> Job:
        job = Job(kind, transfer, self._clock() + timeout_s)
        stuck = self.stuck(kind)
        with self._lock:
            self._jobs.append(job)
        if stuck:
            self._end(job, False, f"not started: the {kind} lane is stuck ({stuck})", {})
        else:
            self._lanes[kind].queue.put(job)
        return job

    def abort(self, request_ids: Iterable[str], kind: Kind = "load") -> int:
        """Stop the `kind` jobs of requests vLLM finished (aborted): a queued one ends
        at once, a running one at its next record. Returns the jobs stopped."""
        ids = set(request_ids)
        if not ids:
            return 0
        with self._lock:
            hit = [j for j in self._jobs if j.kind == kind and j.request_id in ids and not j.done]
            for job in hit:
                job.aborted = True
        for job in hit:
            if job.started is None:
                self._end(job, False, "the request was aborted before its load started", {})
        return len(hit)

    def poll(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) of the jobs that ended
        since the last call; first gives up on every job past its deadline."""
        now = self._clock()
        gap, self._polled = now - self._polled, now
        with self._lock:
            late = [j for j in self._jobs if not j.done and now > self._limit(j)]
        for job in late:
            where = "queued" if job.started is None else "running"
            # A running job past its deadline ignored it somewhere: say where it is.
            # (The gap since the previous poll tells a stalled lane from a worker that
            # was not stepping, or not running, meanwhile.)
            stack = self._stack(job) if job.started is not None else []
            if stack:
                log.warning(
                    "bsr-io: %s of %s still running past its deadline (%.1f s since the "
                    "previous poll), at:\n%s",
                    job.kind,
                    job.request_id,
                    gap,
                    "".join(stack),
                )
            self._end(
                job,
                False,
                f"{job.kind} did not end within its deadline ({where})",
                {"poll_gap_s": round(gap, 3)} | ({"stack": stack} if stack else {}),
                until_returned=self._hold_running
                and job.kind == "load"
                and job.started is not None,
            )
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        with self._lock:
            for job in self._jobs:
                if job.done and job.hold is not None and job.hold[1]():
                    job.hold = None  # the memory is the blocks' owner's again: report it
            ended = [j for j in self._jobs if j.done and j.hold is None]
            self._jobs = [j for j in self._jobs if not (j.done and j.hold is None)]
        for job in ended:
            if job.kind == "load":
                recving.add(job.request_id)
                if not job.ok:
                    failed.add(job.request_id)
            else:
                sending.add(job.request_id)
        return sending, recving, failed

    def stuck(self, kind: Kind) -> str:
        """Why the `kind` lane cannot take work now ("" when it can)."""
        with self._lock:
            held = [j for j in self._jobs if j.kind == kind and j.hold is not None]
        for j in held:
            if j.hold is not None:
                return f"{kind} of {j.request_id} holds its blocks: {j.hold[0]}"
        job = self._lanes[kind].current
        if job is not None and self._clock() > job.deadline + self._grace_s:
            return f"{kind} of {job.request_id} still running {self._grace_s:g} s past its deadline"
        return ""

    def running(self, kind: Kind) -> bool:
        return self._lanes[kind].current is not None

    def pending(self) -> int:
        with self._lock:
            return len(self._jobs)

    def close(self, timeout_s: float = 5.0) -> None:
        for lane in self._lanes.values():
            lane.queue.put(None)
        for lane in self._lanes.values():
            if lane.thread is not None:
                lane.thread.join(timeout=timeout_s)

    # -- inside ----------------------------------------------------------------------
    def _stack(self, job: Job) -> list[str]:
        """Where `job`'s lane is now (its innermost frames), if it is still running it."""
        lane = self._lanes[job.kind]
        ident = lane.thread.ident if lane.thread is not None else None
        frame = sys._current_frames().get(ident) if ident is not None else None
        if frame is None or lane.current is not job:
            return []
        return traceback.format_stack(frame, limit=12)

    def _limit(self, job: Job) -> float:
        # A running job gets a grace past its deadline to return on its own (its reads
        # end at the deadline); a queued one none: nothing of it has started.
        return job.deadline + (self._grace_s if job.started is not None else 0.0)

    def _end(
        self, job: Job, ok: bool, reason: str, details: Details, *, until_returned: bool = False
    ) -> None:
        """Mark `job` ended once (the lane and a give-up may race: the first wins).
        A job that did not succeed has its blocks closed to it before it is reported.
        `until_returned`: a running load given up on is held (not reported) until its
        lane returned, since a read it started may still write its blocks meanwhile."""
        with self._lock:
            if job.done:
                return
        if not ok:
            job.guard.close()
        with self._lock:
            if job.done:
                return
            job.ok, job.reason, job.done = ok, reason, True
            if until_returned:
                self._hold_until_returned(job)
        try:
            self._on_end(job, details)
        except Exception:  # noqa: BLE001 - reporting a job never stops a lane
            log.exception("bsr-io: on_end of %s %s failed", job.kind, job.request_id)

    def _hold_until_returned(self, job: Job) -> None:
        """Hold `job` until its lane returned from it (and any hold it set itself ended)."""
        lane = self._lanes[job.kind]
        before = job.hold

        def returned() -> bool:
            return lane.current is not job and (before is None or before[1]())

        job.hold = (
            f"given up {self._grace_s:g} s past its deadline, its lane has not returned "
            "(a read it started may still write the blocks)",
            returned,
        )

    def _serve(self, lane: _Lane) -> None:
        while True:
            job = lane.queue.get()
            if job is None:
                return
            if job.should_stop() or self._clock() > job.deadline:
                if not job.done:
                    self._end(job, False, f"{job.kind} not started by its deadline", {})
                continue
            lane.current = job  # first: a started job always has its lane's current set
            job.started = self._clock()
            try:
                ok, reason, details = lane.run(job)
            except Exception as exc:  # noqa: BLE001 - any failure is a zero-reuse outcome
                log.exception("bsr-io %s of %s failed", job.kind, job.request_id)
                ok, reason, details = False, f"{type(exc).__name__}: {exc}", {}
            finally:
                lane.current = None
            if job.done:
                # Given up on already (reported): what the late run saw is only logged.
                log.warning(
                    "bsr-io: %s of %s returned %.1f s after it was given up (%s): %s",
                    job.kind,
                    job.request_id,
                    self._clock() - job.deadline,
                    reason or "ok",
                    details,
                )
                continue
            if job.aborted and ok and job.kind == "load":
                ok, reason = False, "the request was aborted during its load"
            self._end(job, ok, reason, details)
