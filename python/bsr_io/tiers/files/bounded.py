"""Plain file syscalls (a buffered write, its fdatasync, a header pwrite) with a deadline.

A stalled drive or mount blocks such a call in the kernel for as long as it likes, and
no timeout can be asked of it. So the call runs on a thread of its own and the caller
waits for it until its deadline only: past it the caller gets TimeoutError and goes on
(the record's save fails, its temp file is removed, nothing is published).

The stalled call must not touch what the caller then reuses. It works on a duplicate of
the caller's descriptor, closed when it returns, so the caller closing its own (and the
process reusing the number for another file) never redirects a late write; and `stop`,
set at the deadline, tells the work not to start its next syscall (it may otherwise read
a payload buffer its caller has reused, and write it into the doomed temp file).

The threads are kept (`Runners`): an L3 record's save makes three such calls, and starting a
Python thread for each cost more of the GIL than the calls themselves, taken from the
thread that runs the model's forward in the same process. A call takes an idle runner
or, none being idle, starts a new one: a call stalled in the kernel holds its runner,
never the next call. Runners are kept per CPU set, scheduling policy and nice value of
the calling thread, as a thread of its own would have inherited them: a call runs where
and as its caller would (the vLLM connector pins its threads off the forward's cores; a
pool's data threads may run SCHED_IDLE, and a runner they started must not serve others).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
Work = Callable[[int, threading.Event], T]
log = logging.getLogger("bsr_io")
IDLE_S = 30.0  # a runner idle this long ends


class Runners:
    """Threads that run calls one at a time, reused while idle, one more started when
    none is. Invariant: `idle` = runners waiting on the queue - calls put for them not
    yet taken, never below 0; a runner ends only by taking one from `idle`."""

    def __init__(self, name: str = "bsr-file-io") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._idle = 0
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.started = 0  # runner threads started so far (a test reads it)

    def run(self, call: Callable[[], None]) -> None:
        with self._lock:
            reuse = self._idle > 0
            if reuse:
                self._idle -= 1
            else:
                self.started += 1
        if reuse:
            self._calls.put(call)
        else:
            threading.Thread(target=self._serve, args=(call,), name=self.name, daemon=True).start()

    def _serve(self, call: Callable[[], None]) -> None:
        while True:
            call()  # never raises: run_within's body keeps what it raised
            del call
            with self._lock:
                self._idle += 1
            while True:
                try:
                    call = self._calls.get(timeout=IDLE_S)
                    break
                except queue.Empty:
                    with self._lock:
                        if self._idle > 0:  # nobody counts on this runner: it may end
                            self._idle -= 1
                            return


Placement = tuple[frozenset[int], int, int]  # CPUs, scheduling policy, nice
_runners: dict[Placement, Runners] = {}
_runners_lock = threading.Lock()


def runners() -> Runners:
    """The runners for the calling thread's placement (what a new thread inherits)."""
    # On Linux these calls read the calling thread's own settings (0 = this thread).
    key = (
        frozenset(os.sched_getaffinity(0)),
        os.sched_getscheduler(0),
        os.getpriority(os.PRIO_PROCESS, 0),
    )
    with _runners_lock:
        got = _runners.get(key)
        if got is None:
            got = _runners[key] = Runners()
        return got


def _forget_runners() -> None:
    # A forked child has none of its parent's threads: the counts would hand calls to
    # runners that do not exist there.
    global _runners_lock
    _runners.clear()
    _runners_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_runners)


def run_within(timeout: float, work: Callable[[], T], late: Callable[[T], None] | None = None) -> T:
    """`work()` on a runner thread: its result or its exception, or TimeoutError when it
    has not returned within `timeout` seconds (it goes on alone; a result it gives after
    that goes to `late`, e.g. to close a file nobody will use)."""
    lock = threading.Lock()
    done = threading.Event()
    out: list[T] = []
    err: list[BaseException] = []
    given_up = False

    def body() -> None:
        try:
            got = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller as is
            err.append(exc)
        else:
            with lock:
                orphan = given_up
                if not orphan:
                    out.append(got)
            if orphan and late is not None:
                try:
                    late(got)
                except Exception:  # noqa: BLE001 - nobody waits on it: logged
                    log.warning("bsr-io: cleanup after a late file call failed", exc_info=True)
        finally:
            done.set()

    runners().run(body)
    if not done.wait(max(0.0, timeout)):
        with lock:
            if not out and not err:
                given_up = True
                raise TimeoutError(f"file call did not return within {timeout:.3g} s")
        done.wait()  # it ended just now: its result or error is (being) stored
    if err:
        raise err.pop()
    return out[0]


def call_within(timeout: float, fd: int, work: Work[T]) -> T:
    """`work(dup of fd, stop)` on a thread of its own (`run_within`); `stop` is set when
    the caller gave up on it."""
    dup = os.dup(fd)
    stop = threading.Event()

    def run() -> T:
        try:
            return work(dup, stop)
        finally:
            os.close(dup)

    try:
        return run_within(timeout, run)
    except TimeoutError:
        stop.set()
        raise


def pwrite_all(fd: int, data: memoryview, offset: int, stop: threading.Event | None = None) -> None:
    """Write all of `data` at `offset`; stops before the next call once `stop` is set."""
    while data:
        if stop is not None and stop.is_set():
            raise TimeoutError("write given up at its deadline")
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n
