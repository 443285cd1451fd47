"""The worker's event log (`events_path`): JSON lines written by a thread of its own.

A line comes from whichever thread ends a job, vLLM's forward thread among them. Written
there, each line's open, write and close gave the GIL away three times, and the save
threads took it: 0.13 ms of the forward thread per line at saturation (337 lines in a
19 s phase). Here the caller encodes the line and queues it; the log's thread writes
what has queued in one O_APPEND write (whole lines: the ranks' lines never mix) to a file
it keeps open. `flush` waits for what was queued before it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("bsr_io.vllm")


class EventLog:
    def __init__(self, path: str, on_start: Callable[[], None] = lambda: None) -> None:
        self.path = path
        self._on_start = on_start  # run first on the log's thread (its CPUs, its priority)
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._written = threading.Condition()
        self._queued = 0  # lines put so far
        self._done = 0  # lines written (or dropped by a failed write) so far
        self._thread: threading.Thread | None = None
        self._closed = False

    def put(self, line: bytes) -> None:
        with self._written:
            if self._closed:
                append_line(self.path, line)  # a lane that ended after close: written here
                return
            self._queued += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="bsr-events", daemon=True)
                self._thread.start()
        self._queue.put(line)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every line queued before this call is written; False on timeout."""
        with self._written:
            want = self._queued
            return self._written.wait_for(lambda: self._done >= want, timeout)

    def close(self, timeout: float = 10.0) -> None:
        with self._written:
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)

    def _run(self) -> None:
        fd: int | None = None
        try:
            self._on_start()
        except OSError:  # placement is best effort: the lines still get written
            log.exception("bsr-io: could not place the event log's thread")
        try:
            fd = _open(self.path)
        except OSError:
            log.exception("bsr-io: could not open the event log %s", self.path)
        end = False
        while not end:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            end = None in batch
            lines = [b for b in batch if b is not None]
            try:
                if fd is not None and lines:
                    os.write(fd, b"".join(lines))
            except OSError:
                log.exception("bsr-io: could not write %d event lines", len(lines))
            with self._written:
                self._done += len(lines)
                self._written.notify_all()
        if fd is not None:
            os.close(fd)


def append_line(path: str, line: bytes) -> None:
    """One line appended to `path` in one O_APPEND write (lines of several processes never
    mix), from the calling thread; a failure is logged, never raised."""
    try:
        fd = _open(path)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError:
        log.exception("bsr-io: could not write an event")


def _open(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
