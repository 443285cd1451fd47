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
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
Work = Callable[[int, threading.Event], T]


def run_within(timeout: float, work: Callable[[], T], late: Callable[[T], None] | None = None) -> T:
    """`work()` on a thread of its own: its result or its exception, or TimeoutError when
    it has not returned within `timeout` seconds (it goes on alone; a result it gives
    after that goes to `late`, e.g. to close a file nobody will use)."""
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
                late(got)
        finally:
            done.set()

    threading.Thread(target=body, name="bsr-file-io", daemon=True).start()
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
