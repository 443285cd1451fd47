"""The worker's one job table: every transfer vLLM's steps order, from submission to end.

Loads, finish saves and step cuts (cuts.py) are all jobs here, each with an id and a
deadline counted from its submission (time queued included); `poll`, called once a step
(`get_transfer_results`), ends every job past its deadline and reports each ended load
and finish save exactly once: vLLM keeps a request's blocks until then, so a transfer
never reported would pin them for good. A job given up on has its guard closed before it
is reported, so nothing touches its blocks afterwards. A cut is not reported to vLLM:
its end is counted by its lane's `on_end` (cuts.py).

A job is past its copy (`copied`) once it no longer reads or writes its request's blocks:
a cut once its record is in a slot, every job once it ended (but a load whose given-up
reads may still write: below). Two asks of vLLM's are answered from that alone:
- `release`: vLLM freed these requests' blocks and may reuse them in this step's
  forward: their cuts not past their copy get the step budget to get there, then their
  guards close (a later copy is Abandoned: skipped, never read from another's blocks).
- `hold`: vLLM finished these requests and keeps their blocks until `poll` names them in
  finished_sending, once every job of theirs in the table is past its copy, or the
  hold's bound passed, or `starved_s` passed while `starved()` (no save slot free) holds
  (their jobs' guards close then: the rest end skipped).

A load that ended while reads it gave up may still write its blocks (a direct read the
kernel still holds: `Job.hold`) is reported, and past its copy, only once they returned;
the load lane is stuck meanwhile. A running load given up `grace_s` past its deadline is
held the same way until its lane returned. A queued job is reported at its deadline.

Each kind of job has one lane: `width` threads that take its jobs in submission order; a
job that ended before its lane took it (deadline passed, request aborted, guard closed)
never starts. A lane all of whose threads run a job past its deadline by more than
`grace_s` is stuck: new jobs of that kind end at once until one returns.

The table counts its changes (a job ended, or got past its copy: `copied`), so that an
idle step can wait for the next one (`wait_change`, idle.py) instead of polling.

The table knows nothing of vLLM or of what a job does: `run(job)` per kind does the work
and returns (ok, reason, details); `on_end(job, details)` is told once per job.
"""

from __future__ import annotations

import itertools
import logging
import math
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

Kind = Literal["load", "save", "cut"]
Details = dict[str, Any]
Run = Callable[["Job"], tuple[bool, str, Details]]
OnEnd = Callable[["Job", Details], None]
_TAKE = threading.Lock()


@dataclass(eq=False)
class Job:
    kind: Kind
    transfer: Transfer
    deadline: float  # the table's clock, counted from submission
    id: int = 0
    guard: Guard = field(default_factory=Guard)
    payload: Any = None  # what the submitter hands its run (a cut's order): `take` it
    copied: threading.Event = field(default_factory=threading.Event)  # past its copy
    over: threading.Event = field(default_factory=threading.Event)  # ended
    started: float | None = None  # when a lane thread took it
    thread: int | None = None  # that thread's ident
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

    def take(self) -> Any:
        """The payload, once: a run and a give-up may race for what it owns (a slot)."""
        with _TAKE:
            payload, self.payload = self.payload, None
        return payload


@dataclass
class _Hold:
    """A finished request whose blocks vLLM keeps until its jobs are past their copy."""

    start: float
    end: float  # its bound
    short: bool = False  # a job of it (not aborted) ended short of its copy meanwhile


@dataclass
class _Lane:
    kind: Kind
    run: Run
    on_end: OnEnd
    width: int
    queue: queue.Queue[Job | None] = field(default_factory=queue.Queue)
    current: dict[int, Job] = field(default_factory=dict)  # thread index -> its job
    threads: list[threading.Thread] = field(default_factory=list)


class JobTable:
    def __init__(
        self,
        runs: dict[Kind, Run],
        on_end: OnEnd,
        *,
        on_hold: Callable[[str, float, str], None] | None = None,
        grace_s: float = 2.0,
        hold_running_loads: bool = True,
        starved: Callable[[], bool] = lambda: False,
        starved_s: float = math.inf,
        name: str = "bsr",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._on_end = on_end
        # A hold's end: (request, its seconds, why not every job copied: "" when all did).
        self._on_hold = on_hold or (lambda rid, seconds, why: None)
        self._grace_s = grace_s
        # False where loads read only into slots: they write their blocks only through
        # their guard, closed when they are given up, so there is nothing to hold.
        self._hold_running = hold_running_loads
        # A hold ends after `starved_s` while `starved()` says no cut can get a slot soon
        # (every save slot held by a write): its cuts are skipped rather than wait.
        self._starved, self.starved_s = starved, starved_s
        self._name = name
        self._clock = clock
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._jobs: dict[int, Job] = {}  # submitted, not yet reported, by id
        self._holds: dict[str, _Hold] = {}  # held request -> its hold
        self._closed = False
        self._polled = clock()  # a long gap between polls: the worker itself did not step
        self._changes = 0  # jobs ended or past their copy so far (`wait_change`)
        self._changed = threading.Condition()
        self._lanes: dict[Kind, _Lane] = {}
        for kind, run in runs.items():
            self.add_lane(kind, run)

    def add_lane(
        self, kind: Kind, run: Run, *, width: int = 1, on_end: OnEnd | None = None
    ) -> None:
        """`width` threads that run the `kind` jobs (`on_end`: told of their ends instead
        of the table's own)."""
        lane = _Lane(kind, run, on_end or self._on_end, width)
        for i in range(width):
            th = threading.Thread(
                target=self._serve, args=(lane, i), name=f"{self._name}-{kind}{i}", daemon=True
            )
            lane.threads.append(th)
        self._lanes[kind] = lane
        for th in lane.threads:
            th.start()

    def lane_threads(self, kind: Kind) -> list[int]:
        """The native ids of the `kind` lane's threads (cpus.py sets their priority)."""
        return [th.native_id for th in self._lanes[kind].threads if th.native_id is not None]

    # -- what the worker calls --------------------------------------------------------
    def submit(
        self,
        kind: Kind,
        transfer: Transfer,
        timeout_s: float,
        *,
        payload: Any = None,
        copied: bool = False,
    ) -> Job:
        """A new job, due `timeout_s` from now (`copied`: it no longer needs its blocks)."""
        job = self._new(kind, transfer, timeout_s, payload, copied)
        stuck = self.stuck(kind)
        if self._closed or stuck:
            why = "the table is closed" if self._closed else f"the {kind} lane is stuck ({stuck})"
            self._end(job, False, f"not started: {why}", {})
        else:
            self._lanes[kind].queue.put(job)
        return job

    def end_at_once(self, kind: Kind, transfer: Transfer, reason: str, details: Details) -> Job:
        """A job that failed before it could be queued (counted like any other)."""
        job = self._new(kind, transfer, 0.0, None, False)
        self._end(job, False, reason, details)
        return job

    def abort(self, request_ids: Iterable[str], kind: Kind = "load") -> int:
        """Stop the `kind` jobs of requests vLLM finished (aborted): a queued one ends
        at once, a running one at its next record. Returns the jobs stopped."""
        hit = self._of(set(request_ids), kind, lambda j: not j.done)
        for job in hit:
            job.aborted = True
        for job in hit:
            if job.started is None:
                self._end(job, False, f"the request was aborted before its {kind} started", {})
        return len(hit)

    def release(self, request_ids: Iterable[str], budget_s: float, kind: Kind = "cut") -> None:
        """vLLM may hand these requests' blocks to others in this step: their `kind`
        jobs not past their copy get `budget_s` in all to get there, then their guards
        close (a copy in progress ends first; a later one is Abandoned)."""
        end = self._clock() + budget_s
        left = self._of(set(request_ids), kind, lambda j: not j.copied.is_set())
        for job in left:
            job.copied.wait(max(0.0, end - self._clock()))
        for job in left:
            job.guard.close()

    def hold(self, request_ids: Iterable[str], bound_s: float) -> None:
        """vLLM keeps these finished requests' blocks until `poll` names them."""
        now = self._clock()
        with self._lock:
            for rid in request_ids:
                self._holds[rid] = _Hold(now, now + bound_s)

    def wait_ended(self, request_id: str, kind: Kind, deadline: float) -> None:
        """Until the request's `kind` jobs in the table ended, at most until `deadline`."""
        for job in self._of({request_id}, kind):
            job.over.wait(max(0.0, deadline - self._clock()))

    def copied(self, job: Job) -> None:
        """`job` no longer needs its blocks (a cut's record is in its slot)."""
        job.copied.set()
        self._note_change()

    def changes(self) -> int:
        """How many times a job ended or got past its copy so far."""
        with self._changed:
            return self._changes

    def wait_change(self, seen: int, timeout_s: float) -> int:
        """Until `changes()` is no longer `seen`, at most `timeout_s`: the count then."""
        with self._changed:
            self._changed.wait_for(lambda: self._changes != seen, max(0.0, timeout_s))
            return self._changes

    def jobs_of(self, request_id: str) -> list[Job]:
        """The request's jobs in the table, every kind, in submission order."""
        with self._lock:
            return [j for j in self._jobs.values() if j.request_id == request_id]

    def poll(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call: ended
        finish saves and held requests, ended loads, failed ones. First gives up on every
        job past its deadline."""
        now = self._clock()
        gap, self._polled = now - self._polled, now
        with self._lock:
            late = [j for j in self._jobs.values() if not j.done and now > self._limit(j)]
        for job in late:
            self._give_up(job, gap)
        sending = self._end_holds(now)
        recving: set[str] = set()
        failed: set[str] = set()
        with self._lock:
            for job in self._jobs.values():
                if job.done and job.hold is not None and job.hold[1]():
                    job.hold = None  # the memory is the blocks' owner's again: report it
                    job.copied.set()
            ended = [j for j in self._jobs.values() if j.done and j.hold is None]
            for job in ended:
                del self._jobs[job.id]
        for job in ended:
            if job.kind == "load":
                recving.add(job.request_id)
                if not job.ok:
                    failed.add(job.request_id)
            elif job.kind == "save":
                sending.add(job.request_id)
        return sending, recving, failed

    def stuck(self, kind: Kind) -> str:
        """Why the `kind` lane cannot take work now ("" when it can)."""
        with self._lock:
            held = [j for j in self._jobs.values() if j.kind == kind and j.hold is not None]
        for j in held:
            if j.hold is not None:
                return f"{kind} of {j.request_id} holds its blocks: {j.hold[0]}"
        lane = self._lanes[kind]
        running = list(lane.current.values())
        late = [j for j in running if self._clock() > j.deadline + self._grace_s]
        if late and len(late) == lane.width:
            job = late[0]
            return f"{kind} of {job.request_id} still running {self._grace_s:g} s past its deadline"
        return ""

    def running(self, kind: Kind) -> bool:
        return bool(self._lanes[kind].current)

    def pending(self) -> int:
        with self._lock:
            return len(self._jobs)

    def close(self, timeout_s: float = 5.0, stop: Iterable[Kind] = ("cut",)) -> None:
        """Stop the lanes, once their queued jobs ended; the `stop` kinds' jobs have
        their guards closed first (queued ones never start: counted ended)."""
        self._closed = True
        kinds = set(stop)
        with self._lock:
            left = [j for j in self._jobs.values() if not j.done and j.kind in kinds]
        for job in left:
            job.guard.close()
        for lane in self._lanes.values():
            for _ in lane.threads:
                lane.queue.put(None)
        end = time.monotonic() + timeout_s
        for lane in self._lanes.values():
            for th in lane.threads:
                th.join(timeout=max(0.0, end - time.monotonic()))

    # -- inside ----------------------------------------------------------------------
    def _note_change(self) -> None:
        with self._changed:
            self._changes += 1
            self._changed.notify_all()

    def _new(
        self, kind: Kind, transfer: Transfer, timeout_s: float, payload: Any, copied: bool
    ) -> Job:
        job = Job(kind, transfer, self._clock() + timeout_s, next(self._ids), payload=payload)
        if copied:
            job.copied.set()
        with self._lock:
            self._jobs[job.id] = job
        return job

    def _of(
        self, request_ids: set[str], kind: Kind, keep: Callable[[Job], bool] = lambda j: True
    ) -> list[Job]:
        with self._lock:
            return [
                j
                for j in self._jobs.values()
                if j.kind == kind and j.request_id in request_ids and keep(j)
            ]

    def _give_up(self, job: Job, gap: float) -> None:
        where = "queued" if job.started is None else "running"
        # A running job past its deadline ignored it somewhere: say where it is. (The gap
        # since the previous poll tells a stalled lane from a worker that was not
        # stepping, or not running, meanwhile.)
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
            until_returned=self._hold_running and job.kind == "load" and job.started is not None,
        )

    def _end_holds(self, now: float) -> set[str]:
        """Held requests none of whose jobs needs their blocks any more (or whose bound
        passed: their jobs' guards close now). vLLM may free the blocks."""
        ended: list[tuple[str, float, list[Job], str]] = []
        with self._lock:
            for rid, h in list(self._holds.items()):
                left = [
                    j for j in self._jobs.values() if j.request_id == rid and not j.copied.is_set()
                ]
                starved = bool(left) and now - h.start >= self.starved_s and self._starved()
                if left and now < h.end and not starved:
                    continue
                del self._holds[rid]
                why = "cuts ended short of their copy" if h.short else ""
                if left:
                    why = "the hold's bound passed with cuts not copied"
                    if starved and now < h.end:
                        why = "every save slot was held by a write: cuts not copied"
                ended.append((rid, now - h.start, left, why))
        for rid, seconds, left, why in ended:
            for job in left:
                job.guard.close()  # a copy in progress ends first; a later one is Abandoned
            self._on_hold(rid, seconds, why)
        return {rid for rid, *_ in ended}

    def _stack(self, job: Job) -> list[str]:
        """Where `job`'s lane thread is now (its innermost frames), if it still runs it."""
        frame = sys._current_frames().get(job.thread) if job.thread is not None else None
        if frame is None or job not in self._lanes[job.kind].current.values():
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
            hold = self._holds.get(job.request_id)
            if hold is not None and not ok and not job.aborted and not job.copied.is_set():
                hold.short = True  # it ended short of its copy: the hold saved nothing of it
            if until_returned:
                self._hold_until_returned(job)
            if job.hold is None:
                job.copied.set()
        job.over.set()
        lane = self._lanes.get(job.kind)
        try:
            (lane.on_end if lane is not None else self._on_end)(job, details)
        except Exception:  # noqa: BLE001 - reporting a job never stops a lane
            log.exception("bsr-io: on_end of %s %s failed", job.kind, job.request_id)
        # Last: a step woken by it finds what on_end queued for its report (a lost cut).
        self._note_change()

    def _hold_until_returned(self, job: Job) -> None:
        """Hold `job` until its lane returned from it (and any hold it set itself ended)."""
        lane = self._lanes[job.kind]
        before = job.hold

        def returned() -> bool:
            return job not in lane.current.values() and (before is None or before[1]())

        job.hold = (
            f"given up {self._grace_s:g} s past its deadline, its lane has not returned "
            "(a read it started may still write the blocks)",
            returned,
        )

    @staticmethod
    def _why_not(job: Job) -> str:
        if job.aborted:
            return "the request was aborted"
        return "its blocks were released" if not job.guard.open else "past its deadline"

    def _serve(self, lane: _Lane, index: int) -> None:
        while True:
            job = lane.queue.get()
            if job is None:
                return
            if job.should_stop() or self._clock() > job.deadline:
                if not job.done:
                    self._end(job, False, f"{job.kind} not started: {self._why_not(job)}", {})
                continue
            lane.current[index] = job  # first: a started job always is its lane's current
            job.thread = threading.get_ident()
            job.started = self._clock()
            try:
                ok, reason, details = lane.run(job)
            except Exception as exc:  # noqa: BLE001 - any failure is a zero-reuse outcome
                log.exception("bsr-io %s of %s failed", job.kind, job.request_id)
                ok, reason, details = False, f"{type(exc).__name__}: {exc}", {}
            finally:
                del lane.current[index]
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
